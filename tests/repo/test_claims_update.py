"""tools/claims_update.py: after a result moves, its numbers are rewritten in the prose and the ledger so that the
claims check passes again, overlapping quotes stay consistent, and nothing else is touched."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import claims  # noqa: E402
import claims_update as cu  # noqa: E402

README = """# Results

| run | adaptive / control |
|---|---|
| `a.json` | 0.993 [0.988, 0.996] |

Throughput rose to 1,234 tokens a second, 12% more than before.
"""

LEDGER = '''[[claim]]
id = "median"
where = "README.md"
quote = "| `a.json` | {0.993} [0.988, 0.996] |"
result = "r.json"
field = "run.median"

[[claim]]
id = "low"
where = "README.md"
quote = "| `a.json` | 0.993 [{0.988}, 0.996] |"
result = "r.json"
field = "run.ci[0]"

[[claim]]
id = "high"
where = "README.md"
quote = "0.993 [0.988, {0.996}] |"
result = "r.json"
field = "run.ci[1]"

[[claim]]
id = "tokens"
where = "README.md"
quote = "rose to {1,234} tokens"
result = "r.json"
field = "tokens"

[[claim]]
id = "more"
where = "README.md"
quote = "{12}% more"
result = "r.json"
field = "gain"
scale = 100
offset = -1

[[claim]]
id = "nb"
where = "ch.ipynb"
quote = "runs at {0.993}x\\nof the control"
result = "r.json"
field = "run.median"
'''


def _notebook(text: str) -> dict:
    cell = lambda kind, src: {"cell_type": kind, "metadata": {}, "source": src.splitlines(keepends=True),
                              **({"outputs": [], "execution_count": None} if kind == "code" else {})}
    return {"cells": [cell("markdown", text), cell("code", "# runs at 0.993x\n# of the control\n")],
            "metadata": {}, "nbformat": 4, "nbformat_minor": 5}


@pytest.fixture
def repo(monkeypatch, tmp_path):
    (tmp_path / "README.md").write_text(README)
    (tmp_path / "ch.ipynb").write_text(json.dumps(_notebook("Adaptive k runs at 0.993x\nof the control.\n"),
                                                  indent=1) + "\n")
    (tmp_path / "claims.toml").write_text(LEDGER)
    result = {"run": {"median": 0.99312, "ci": [0.98804, 0.99601]}, "tokens": 1234.4, "gain": 1.1204}
    (tmp_path / "r.json").write_text(json.dumps(result))
    monkeypatch.setattr(claims, "ROOT", tmp_path)
    monkeypatch.setattr(claims, "LEDGER", tmp_path / "claims.toml")
    monkeypatch.setattr(claims, "RESULTS", tmp_path)
    monkeypatch.setattr(claims, "result_data", lambda name: json.loads((tmp_path / name).read_text()))

    def remeasure(**fields):
        data = json.loads((tmp_path / "r.json").read_text())
        data.update(fields)
        (tmp_path / "r.json").write_text(json.dumps(data))

    return tmp_path, remeasure


def _mismatched() -> list[str]:
    return [p for c in claims.load() if (p := claims.check(c))]


def test_nothing_moved_nothing_planned(repo):
    assert _mismatched() == []
    edits, moved, problems = cu.plan(claims.load())
    assert (edits, moved, problems) == ([], [], [])


def test_moved_numbers_are_rewritten_in_prose_notebook_and_ledger(repo):
    root, remeasure = repo
    remeasure(run={"median": 0.9951, "ci": [0.9912, 0.9977]}, tokens=1500.4, gain=1.087)
    assert len(_mismatched()) == 6
    assert cu.main(["--write"]) == 0
    assert _mismatched() == []
    readme = (root / "README.md").read_text()
    assert "| `a.json` | 0.995 [0.991, 0.998] |" in readme
    assert "rose to 1,500 tokens a second, 9% more" in readme
    nb = json.loads((root / "ch.ipynb").read_text())
    assert "".join(nb["cells"][0]["source"]) == "Adaptive k runs at 0.995x\nof the control.\n"
    assert "".join(nb["cells"][1]["source"]) == "# runs at 0.993x\n# of the control\n", "a code cell is never edited"
    quotes = {c.id: c.quote for c in claims.load()}
    # each quote keeps its own braces and carries the other claims' new numbers
    assert quotes["median"] == "| `a.json` | {0.995} [0.991, 0.998] |"
    assert quotes["low"] == "| `a.json` | 0.995 [{0.991}, 0.998] |"
    assert quotes["high"] == "0.995 [0.991, {0.998}] |"
    assert quotes["nb"] == "runs at {0.995}x\nof the control"


def test_without_write_nothing_changes(repo):
    root, remeasure = repo
    remeasure(tokens=1500.4)
    before = {p.name: p.read_text() for p in root.iterdir()}
    cu.main([])
    assert {p.name: p.read_text() for p in root.iterdir()} == before


def test_other_failures_are_listed_not_touched(repo):
    root, remeasure = repo
    (root / "README.md").write_text(README.replace("1,234 tokens", "1,200 tokens"))  # edited by hand
    remeasure(gain=1.087)
    edits, moved, problems = cu.plan(claims.load())
    assert [c.id for c, _, _ in moved] == ["more"]
    assert len(problems) == 1 and "tokens" in problems[0] and "no longer says" in problems[0]
    assert cu.main(["--write"]) == 1
    assert "1,200 tokens a second, 9% more" in (root / "README.md").read_text()


def test_two_claims_on_one_number_must_agree(repo):
    root, _ = repo
    (root / "claims.toml").write_text(LEDGER + '''
[[claim]]
id = "median_again"
where = "README.md"
quote = "| `a.json` | {0.993} ["
result = "r.json"
field = "run.ci[1]"
''')
    with pytest.raises(ValueError, match="different values"):
        cu.plan(claims.load())


@pytest.mark.parametrize("value, like, printed", [(0.99512, "0.993", "0.995"), (1500.4, "1,234", "1,500"),
                                                  (1500.4, "1234", "1500"), (2.0, "1.000", "2.000"),
                                                  (0.04, "+0.1", "+0.0"), (-0.04, "+0.1", "-0.0"),
                                                  (-0.2, "0", "0"), (12345.678, "1,234.5", "12,345.7")])
def test_fmt_keeps_the_printed_style(value, like, printed):
    assert cu.fmt(value, like) == printed


def test_a_number_moved_in_an_exercise_notebook_moves_in_its_source(repo):
    """``exercises/NAME.ipynb`` is built from ``exercises/source/NAME.py``, whose prose is commented and wrapped
    differently: the number moves there too, and only there where the claim's words are."""
    root, remeasure = repo
    (root / "exercises" / "source").mkdir(parents=True)
    (root / "exercises" / "ch.ipynb").write_text((root / "ch.ipynb").read_text())
    source = "# %% [markdown]\n# Adaptive k runs at\n# 0.993x of the control.\n\n# %%\nx = 0.993\n"
    (root / "exercises" / "source" / "ch.py").write_text(source)
    ledger = (root / "claims.toml").read_text() + LEDGER.split("[[claim]]")[-1].replace(
        'id = "nb"', 'id = "ex"').replace('where = "ch.ipynb"', 'where = "exercises/ch.ipynb"').join(["[[claim]]", ""])
    (root / "claims.toml").write_text(ledger)
    remeasure(run={"median": 0.9951, "ci": [0.9912, 0.9977]})
    assert cu.main(["--write"]) == 0
    assert (root / "exercises" / "source" / "ch.py").read_text() == source.replace("# 0.993x", "# 0.995x")
