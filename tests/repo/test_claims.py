"""The claims ledger: every number the prose cites agrees with the JSON that holds it, and the check bites.

Stale results (code or weights changed since they were measured) are reported as warnings, not failures:
a refactor makes every result stale until the next ``make results``, and that is news, not a defect."""

from __future__ import annotations

import dataclasses
import json
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import claims  # noqa: E402
import freshness  # noqa: E402

from minifer.bench import provenance  # noqa: E402

LEDGER = claims.load()


@pytest.mark.parametrize("claim", LEDGER, ids=[c.id for c in LEDGER])
def test_the_prose_prints_what_the_result_holds(claim):
    assert claims.check(claim) is None, claims.check(claim)


def test_readme_headline_table_is_the_ledgers():
    readme = (ROOT / "README.md").read_text()
    assert readme == claims.render_readme(readme, LEDGER), "run: python3 tools/claims.py --headline"


def test_stale_results_are_named():
    report = claims.stale(LEDGER)
    for name, changed in report.items():
        warnings.warn(f"stale result {name} (re-run `make results`): {', '.join(changed[:5])}", stacklevel=1)
    assert set(report) <= set(claims.reported(LEDGER))
    assert {c.result for c in LEDGER} <= set(claims.reported(LEDGER)), "every cited result is reported"
    assert set(claims.reported(LEDGER)) >= {p.name for p in claims.RESULTS.glob("*.json")}, \
        "a result no prose cites (a notebook may read it in code) is reported too"


def test_every_accepted_dirty_result_is_cited_and_really_dirty():
    assert claims.waiver_problems(LEDGER) == []


def _claim(**kw):
    base = dict(id="t", where="README.md", quote="x", result="r.json", field="a.b")
    return claims.Claim(**{**base, **kw})


@pytest.fixture
def fake(monkeypatch, tmp_path):
    """A prose text and a result file of our own, so the checks can be shown to fail."""
    (tmp_path / "r.json").write_text(json.dumps({"kind": "throughput", "a": {"b": 2.8913, "bound": 3.1},
                                                 "rows": [{"k": 1, "v": 0.5}, {"k": 4, "v": 0.75}]}))
    (tmp_path / "b.json").write_text(json.dumps({"kind": "bound", "a": {"b": 2.0}}))
    text = {"value": "continuous batching gives **2.89x** static; the computed bound is 3.10x; 75% at k=4"}
    monkeypatch.setattr(claims, "RESULTS", tmp_path)
    monkeypatch.setattr(claims, "prose", lambda where: text["value"])
    monkeypatch.setattr(claims, "result_data", lambda name: json.loads((tmp_path / name).read_text()))
    return text


def test_a_matching_claim_passes_and_rounding_is_the_printed_digits(fake):
    assert claims.check(_claim(quote="gives **{2.89}x** static")) is None
    assert claims.check(_claim(quote="{75}% at k=4", field="rows[k=4].v", scale=100)) is None
    assert claims.check(_claim(quote="the computed bound is {3.10}x", field="a.bound", kind="computed")) is None


def test_a_hand_edited_number_fails(fake):
    claim = _claim(quote="gives **{2.89}x** static")
    fake["value"] = fake["value"].replace("2.89x", "2.95x")
    assert "no longer says" in claims.check(claim)
    # the ledger edited to match the hand-edited prose: now the JSON disagrees
    assert "prints 2.95" in claims.check(dataclasses.replace(claim, quote="gives **{2.95}x** static"))


def test_a_number_off_by_more_than_its_rounding_fails(fake):
    fake["value"] = "gives **2.88x** static"
    problem = claims.check(_claim(quote="gives **{2.88}x** static"))
    assert problem and "prints 2.88" in problem and "2.8913" in problem


def test_a_missing_field_or_file_fails(fake):
    assert "has no field" in claims.check(_claim(quote="gives **{2.89}x** static", field="a.c"))
    assert "has no field" in claims.check(_claim(quote="gives **{2.89}x** static", field="rows[k=9].v"))
    assert "no result file" in claims.check(_claim(quote="gives **{2.89}x** static", result="gone.json"))


def test_a_computed_figure_called_measured_fails(fake):
    fake["value"] += "; bound 2.0x"
    assert "computed figure" in claims.check(_claim(quote="the computed bound is {3.10}x", field="a.bound"))
    assert "computed figure" in claims.check(_claim(quote="bound {2.0}x", result="b.json"))
    # and a computed one whose prose does not say so
    fake["value"] = "gives **2.89x** static"
    assert "does not say so" in claims.check(_claim(quote="gives **{2.89}x** static", kind="computed"))
    # the label may sit anywhere in the same paragraph (a table's header, a list's lead), not in the next one
    fake["value"] = "Simulated, not timed:\n\n| run | x |\n|---|---|\n| paged | **2.89x** |"
    assert "does not say so" in claims.check(_claim(quote="| paged | **{2.89}x** |", kind="computed"))
    fake["value"] = "Simulated, not timed:\n| run | x |\n|---|---|\n| paged | **2.89x** |"
    assert claims.check(_claim(quote="| paged | **{2.89}x** |", kind="computed")) is None


def test_quoted_keys_and_selector_values_may_hold_brackets_commas_and_dots(fake):
    data = {"kernels": [{"kernel": "gemv[int4,BN=128]", "arch": "sm_80", "ipw": 5.59},
                        {"kernel": "gemv[int4,BN=128]", "arch": "sm_90", "ipw": 4.6},
                        {"kernel": "mma[int4,64x128]", "arch": "sm_90", "ipw": 3.83}],
            "a.b": {"c": 7}}
    assert claims.lookup(data, 'kernels[kernel="gemv[int4,BN=128]",arch=sm_90].ipw') == 4.6
    assert claims.lookup(data, 'kernels[arch=sm_90, kernel="mma[int4,64x128]"].ipw') == 3.83
    assert claims.lookup(data, '"a.b".c') == 7
    assert claims.lookup(data, "kernels[2].ipw") == 3.83
    assert claims.lookup(data, "kernels.#") == 3 and claims.lookup(data, '"a.b".#') == 1
    with pytest.raises(KeyError, match="matches 2 items"):
        claims.lookup(data, 'kernels[kernel="gemv[int4,BN=128]"].ipw')


def test_an_offset_turns_a_ratio_into_a_percentage_change(fake):
    # rows[k=4].v = 0.75: "25% slower" is (0.75 - 1) * -100
    fake["value"] = "the shuffled list decodes 25% slower"
    assert claims.check(_claim(quote="decodes {25}% slower", field="rows[k=4].v", offset=-1, scale=-100)) is None
    assert "prints 25" in claims.check(_claim(quote="decodes {25}% slower", field="rows[k=1].v", offset=-1,
                                              scale=-100))


def test_over_divides_by_a_second_field_and_a_missing_one_fails(fake):
    fake["value"] = "the big batch has 1.5x the small one's rate"
    assert claims.check(_claim(quote="has {1.5}x the small", field="rows[k=4].v", over="rows[k=1].v")) is None
    assert "has no field rows[k=2].v" in claims.check(_claim(quote="has {1.5}x the small", field="rows[k=4].v",
                                                             over="rows[k=2].v"))


def test_a_result_measured_at_a_dirty_tree_fails_unless_the_ledger_accepts_it(fake, tmp_path, monkeypatch):
    data = json.loads((tmp_path / "r.json").read_text())
    data["metadata"] = {"git": {"commit": "abc1234def", "dirty": True}}
    (tmp_path / "r.json").write_text(json.dumps(data))
    claim = _claim(quote="gives **{2.89}x** static")
    assert "dirty tree (commit abc1234" in claims.check(claim)
    # kernel reports keep their git record under "environment"
    (tmp_path / "k.json").write_text(json.dumps({"environment": {"git": {"dirty": True}}, "a": {"b": 2.89}}))
    assert "dirty tree" in claims.check(_claim(quote="gives **{2.89}x** static", result="k.json"))
    ledger = tmp_path / "claims.toml"
    ledger.write_text('[dirty]\n"r.json" = "a GPU run"\n')
    monkeypatch.setattr(claims, "LEDGER", ledger)
    assert claims.check(claim) is None
    assert claims.waiver_problems([claim]) == []
    # an acceptance outlives its reason once the result is clean again, or when nothing cites it
    data["metadata"]["git"]["dirty"] = False
    (tmp_path / "r.json").write_text(json.dumps(data))
    assert "not measured at a dirty tree" in claims.waiver_problems([claim])[0]
    assert "no claim cites it" in claims.waiver_problems([_claim(result="k.json")])[0]


def test_a_quote_without_a_marked_number_is_refused(fake):
    with pytest.raises(ValueError, match="no number in braces"):
        claims.check(_claim(quote="gives **2.89x** static"))


def test_stale_sources_name_a_changed_or_moved_file(tmp_path, monkeypatch):
    monkeypatch.setattr(provenance, "ROOT", tmp_path)
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "b.py").write_text("y = 2\n")
    recorded = {"a.py": provenance._sha(tmp_path / "a.py"), "b.py": provenance._sha(tmp_path / "b.py")}
    assert provenance.stale_sources(recorded) == []
    (tmp_path / "a.py").write_text("x = 3\n")
    (tmp_path / "b.py").unlink()
    assert provenance.stale_sources(recorded) == ["a.py", "b.py"]


def test_code_only_sees_code_and_not_docstrings_or_comments():
    base = '"""Module."""\nimport os\n\n\ndef f(x):\n    """Why f."""\n    return x + 1  # one more\n'
    same = '"""A longer module docstring."""\nimport os\n\n\ndef f(x):\n    return x + 1\n'
    assert freshness.code_only(base) == freshness.code_only(same)
    assert freshness.code_only(base) != freshness.code_only(base.replace("x + 1", "x + 2"))
    assert freshness.code_only(base) != freshness.code_only(base.replace('"""Why f."""', 'print("Why f.")'))


def test_code_only_names_a_renamed_module_by_its_new_name_and_nothing_else():
    renames = {"pkg.old": "pkg.new"}
    old = 'from pkg.old import f\nimport pkg.old.sub as s\nLAZY = {"f": "pkg.old"}\nNOTE = "pkg.older"\n'
    new = 'from pkg.new import f\nimport pkg.new.sub as s\nLAZY = {"f": "pkg.new"}\nNOTE = "pkg.older"\n'
    assert freshness.code_only(old, renames) == freshness.code_only(new)
    assert freshness.code_only(old) != freshness.code_only(new), "without the renaming the imports differ"
    assert freshness.code_only(old, renames) != freshness.code_only(new.replace("pkg.new import", "pkg.other import"))
    assert freshness.code_only(old, renames) != freshness.code_only(new.replace('"pkg.older"', '"pkg.newer"'))
    # A moved module imported from its package: ``from pkg import old as m`` may become ``from pkg2 import old as m``
    # (the full name ``pkg.old`` is what moved), but must keep binding the same name.
    moved = {"pkg.old": "pkg2.old", "pkg.a": "pkg.b"}
    assert freshness.code_only("from pkg import old as m\n", moved) == freshness.code_only("from pkg2 import old as m\n")
    assert freshness.code_only("from pkg import a\n", moved) == freshness.code_only("from pkg import b as a\n")
    assert freshness.code_only("from pkg import a\n", moved) != freshness.code_only("from pkg import b\n")
    assert freshness.code_only("from pkg import old as m\n", moved) != freshness.code_only("from pkg import old as m\n")
    assert freshness.code_only("from pkg import f\n", moved) != freshness.code_only("from pkg2 import f\n")
    nested = {"pkg": "pkg2", "pkg.a": "other.a"}  # the most specific rename wins, whatever the order
    assert freshness.code_only("from pkg.a import f\nfrom pkg.b import g\n", nested) == \
        freshness.code_only("from other.a import f\nfrom pkg2.b import g\n")
    # A module named inside a string (a command, a parser's prog) takes its new name, as a whole name only.
    assert freshness.code_only('P = "python -m pkg.a --out x"\nQ = f"{P} pkg.b.f"\n', nested) == \
        freshness.code_only('P = "python -m other.a --out x"\nQ = f"{P} pkg2.b.f"\n')
    assert freshness.code_only('P = "python -m pkg.a"\n', nested) != freshness.code_only('P = "python -m pkg.a"\n')
    untouched = 'P = "run pkgs.a, x.pkg.a"\n'  # a longer name, or a name inside another, is not the module's
    assert freshness.code_only(untouched, nested) == freshness.code_only(untouched)
    assert freshness.code_only('P = "python -m pkg.a"\n', nested) != freshness.code_only('P = "python -m pkg.b"\n')


def _repo(tmp_path, monkeypatch, files: dict[str, str]) -> tuple[Callable, str]:
    import subprocess

    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True,
                       capture_output=True)

    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    git("init", "-q")
    git("add", ".")
    git("commit", "-qm", "m")
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True).stdout.strip()
    monkeypatch.setattr(freshness, "ROOT", tmp_path)
    return git, commit


def test_a_docstring_edit_leaves_a_result_fresh_and_a_code_edit_does_not(tmp_path, monkeypatch):
    _, commit = _repo(tmp_path, monkeypatch, {"m.py": '"""Old words."""\nX = 1\n'})
    recorded = provenance._sha(tmp_path / "m.py")
    (tmp_path / "m.py").write_text('"""New words, and more of them."""\nX = 1  # why one\n')
    assert freshness.same_code("m.py", recorded, commit)
    assert not freshness.same_code("m.py", recorded, None), "a run at a modified tree has no commit to compare with"
    assert not freshness.same_code("m.py", "0" * 16, commit), "the commit's file must be the one that ran"
    (tmp_path / "m.py").write_text('"""Old words."""\nX = 2\n')
    assert not freshness.same_code("m.py", recorded, commit)


def test_a_moved_module_leaves_a_result_fresh_only_when_the_program_is_the_same(tmp_path, monkeypatch):
    body = "def f(x):\n    return x + 1\n" + "\n".join(f"C{i} = {i}" for i in range(40)) + "\n"  # git sees a move
    git, commit = _repo(tmp_path, monkeypatch, {"pkg/__init__.py": "", "pkg/old.py": body,
                                                "pkg/user.py": "from pkg.old import f\nY = f(1)\n"})
    recorded = {rel: provenance._sha(tmp_path / rel) for rel in ("pkg/old.py", "pkg/user.py")}
    git("mv", "pkg/old.py", "pkg/new.py")
    (tmp_path / "pkg/user.py").write_text("from pkg.new import f\nY = f(1)\n")
    assert freshness.renames_since(commit) == {"pkg/old.py": "pkg/new.py"}
    assert all(freshness.same_code(rel, sha, commit) for rel, sha in recorded.items())

    (tmp_path / "pkg/new.py").write_text(body.replace("x + 1", "x + 2"))  # moved and changed
    git("add", ".")
    freshness._renames.cache_clear()
    assert not freshness.same_code("pkg/old.py", recorded["pkg/old.py"], commit)


def test_an_import_re_pointed_to_another_module_is_a_change(tmp_path, monkeypatch):
    git, commit = _repo(tmp_path, monkeypatch, {"a.py": "def f():\n    return 1\n", "b.py": "def f():\n    return 2\n",
                                                "user.py": "from a import f\n"})
    recorded = provenance._sha(tmp_path / "user.py")
    (tmp_path / "user.py").write_text("from b import f\n")
    assert not freshness.same_code("user.py", recorded, commit)


def test_a_saved_result_records_the_code_it_ran_and_the_checkpoints_it_read(tmp_path, monkeypatch):
    import minifer.core.sched.scheduler  # noqa: F401  (a module the "run" executed)
    from minifer import model_loader as loader

    monkeypatch.setattr(provenance, "_bundled_read", set())  # a fresh process: nothing read yet
    loader.load_config(loader.resolve_model("tinystories-target"))
    path = provenance.save_result({"kind": "t", "metadata": {"git": {}}}, tmp_path / "r.json")
    code = json.loads(path.read_text())["metadata"]["code"]
    assert code["minifer/core/sched/scheduler.py"] == provenance._sha(ROOT / "minifer/core/sched/scheduler.py")
    assert "minifer/assets/models/tinystories-target/model.safetensors" in code
    assert not any("tinystories-target-eagle" in f or "tinystories-draft" in f for f in code), \
        "a checkpoint the run never read is not part of what it measured"
    assert provenance.stale_sources(code) == []
    loader.read_checkpoint(ROOT / "minifer/assets/models/tinystories-draft")  # a path, not a name, counts too
    assert "minifer/assets/models/tinystories-draft/model.safetensors" in provenance.code_fingerprint()


@pytest.fixture
def copy_of_the_tree(tmp_path, monkeypatch):
    """A copy of one real notebook, its result JSON and the ledger's claims on them, for edits that must fail."""
    mine = [c for c in LEDGER if c.where == "notebooks/06_measure_before_stacking.ipynb"]
    assert mine, "the ledger has no claims on chapter 06 any more: pick another notebook here"
    (tmp_path / "notebooks").mkdir()
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    for c in mine:
        for rel in (c.where, f"benchmarks/results/{c.result}"):
            (tmp_path / rel).write_bytes((ROOT / rel).read_bytes())
    monkeypatch.setattr(claims, "ROOT", tmp_path)
    monkeypatch.setattr(claims, "RESULTS", tmp_path / "benchmarks" / "results")
    monkeypatch.setattr(claims, "_RESULTS_READ", {})
    return tmp_path, mine


def _edit_markdown(path, old, new):
    nb = json.loads(path.read_text())
    for cell in nb["cells"]:
        text = "".join(cell["source"])
        if cell["cell_type"] == "markdown" and old in text:
            cell["source"] = text.replace(old, new, 1).splitlines(keepends=True)
            path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
            return
    raise AssertionError(f"no markdown cell says {old!r}")


def test_the_real_claims_hold_in_a_copy_and_fail_once_the_copy_is_edited(copy_of_the_tree):
    root, mine = copy_of_the_tree
    assert [claims.check(c) for c in mine] == [None] * len(mine)
    claim = mine[0]
    # the prose edited by hand
    _edit_markdown(root / claim.where, claim.text, claim.text.replace(claim.printed, claim.printed + "9"))
    assert "no longer says" in claims.check(claim)


def test_a_copied_result_edited_dirtied_or_cut_fails(copy_of_the_tree):
    root, mine = copy_of_the_tree
    claim = mine[0]
    path = root / "benchmarks" / "results" / claim.result
    original = json.loads(path.read_text())

    def rewrite(change):
        data = json.loads(json.dumps(original))
        change(data)
        path.write_text(json.dumps(data))
        claims._RESULTS_READ.pop(path, None)  # the ledger reads each result once per process
        return claims.check(claim)

    parent, leaf = claim.field.rsplit(".", 1)

    def scale_field(data):  # the cited number moves by 10%
        claims.lookup(data, parent)[leaf] *= 1.1

    assert "prints" in rewrite(scale_field)
    assert "dirty tree" in rewrite(lambda d: d["metadata"]["git"].update(dirty=True))
    assert "has no field" in rewrite(lambda d: claims.lookup(d, parent).pop(leaf))


def test_main_names_stale_results_without_failing(copy_of_the_tree, monkeypatch, capsys):
    root, mine = copy_of_the_tree
    (root / "ledger.toml").write_text("")
    monkeypatch.setattr(claims, "LEDGER", root / "ledger.toml")
    monkeypatch.setattr(claims, "load", lambda path=None: mine)
    monkeypatch.setattr(provenance, "ROOT", root)  # no source file exists here: every fingerprint is stale
    assert claims.main([]) == 0
    out = capsys.readouterr().out
    assert f"STALE {mine[0].result}:" in out and f"{len(mine)} claims, 0 mismatched" in out
