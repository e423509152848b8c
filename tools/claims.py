#!/usr/bin/env python3
"""The claims ledger: every number the prose states as measured, tied to the JSON field that holds it.

    python3 tools/claims.py              # check every claim; list stale results (exit 1 on a mismatch)
    python3 tools/claims.py --headline   # rewrite README's headline table from the ledger

``benchmarks/claims.toml`` holds one ``[[claim]]`` per number::

    [[claim]]
    id = "cb_over_static"
    where = "README.md"                       # or a notebook: its markdown cells are searched
    quote = "gives **{2.89}x** the output-token throughput"   # the prose, the number in braces
    result = "throughput_512.json"            # under benchmarks/results/ (or a path from the repository root)
    field = "summary.ratios.continuous/static.median_of_round_ratios"
    kind = "measured"                         # or "computed": bounds, predictions, simulations
    scale = 1                                 # 100 when the prose prints a fraction as a percentage
    offset = 0                                # optional: added before scaling (-1 with scale -100: "4% slower")
    tolerance = 0.005                         # optional; default half a unit of the last printed digit
    over = "summary.steps.continuous"         # optional: divide by this field of the same result (a ratio
                                              # the JSON does not store: "2.4x fewer forward passes")
    headline = "Continuous over static batching"   # optional: a row of README's headline table

A field path is dot-separated keys; ``[3]`` indexes a list and ``[k=4,batch=1]`` picks the list item whose
fields have those values; a key or a value that holds ``.``, ``,``, ``=`` or brackets is quoted:
``kernels[kernel="quant_gemv[int4,BN=128,chunks=1]",arch=sm_90]`` or ``rows."continuous/static".x``;
a final ``#`` counts the items of a list or dict (``kernels.#``: how many compiles a report holds).
``offset`` (default 0) is added to the value before ``scale``: ``offset = -1, scale = -100`` prints a speed ratio
of 0.962 as "4% slower". ``check`` fails when the quote is not in the prose (someone edited the number by
hand, or the sentence moved), when the field is missing, when the value and the printed number differ by
more than the rounding, when a figure is called measured but comes from a computed result or field, or when
the result was measured at a dirty tree (``metadata.git.dirty``: the commit alone does not say what ran).
A dirty result that cannot be measured again here (a GPU run) may be accepted by name, with the reason, in
the ledger's ``[dirty]`` table; each run prints those, and an entry whose result is not dirty is an error.
Results are not re-measured here: ``stale`` names the results whose recorded code fingerprint no longer
matches the tree (``minifer.bench.provenance``), for ``make results`` to measure again (a module whose docstrings
or comments alone changed, or that moved and is imported by its new name, leaves its results fresh: the file the
run imported, read back from the result's commit, runs the same code, ``tools/freshness.py``; ``DOCS-ONLY`` lists
those), and ``unrecorded``
those that carry no git record at all. Both are news, not failures.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tomllib
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

from freshness import same_code

ROOT = Path(__file__).resolve().parents[1]
LEDGER = ROOT / "benchmarks" / "claims.toml"
RESULTS = ROOT / "benchmarks" / "results"
HEADLINE_START, HEADLINE_END = "<!-- claims:headline:start -->", "<!-- claims:headline:end -->"
# Results that are computed rather than measured, and field names that hold computed figures.
COMPUTED_KINDS = {"bound"}
COMPUTED_SEGMENTS = {"bound", "step_bound", "simulated", "theory", "formula", "same_memory", "block_size_tradeoff"}
COMPUTED_PREFIXES = ("predicted", "expected")
# Words that label a computed figure in the prose around it.
COMPUTED_WORDS = re.compile(r"comput|bound|predict|expect|model|simulat|theor", re.I)
NUMBER = re.compile(r"\{([-+]?[\d,]*\.?\d+)\}")


@dataclass(frozen=True)
class Claim:
    id: str
    where: str
    quote: str
    result: str
    field: str
    kind: str = "measured"
    scale: float = 1.0
    offset: float = 0.0
    tolerance: float | None = None
    over: str | None = None  # a field of the same result to divide by
    headline: str | None = None
    article: str | None = None  # the article's own figure, for the headline table

    @property
    def printed(self) -> str:
        m = NUMBER.search(self.quote)
        if not m:
            raise ValueError(f"claim {self.id}: its quote marks no number in braces: {self.quote!r}")
        return m.group(1)

    @property
    def text(self) -> str:
        """The quote as the prose prints it (braces removed)."""
        return NUMBER.sub(lambda m: m.group(1), self.quote)

    def allowed_error(self) -> float:
        if self.tolerance is not None:
            return self.tolerance
        digits = -Decimal(self.printed.replace(",", "")).as_tuple().exponent
        return 0.5 * 10.0 ** -digits + 1e-12


def load(path: Path | None = None) -> list[Claim]:
    path = path or LEDGER
    claims = [Claim(**c) for c in tomllib.loads(path.read_text())["claim"]]
    ids = [c.id for c in claims]
    dup = {i for i in ids if ids.count(i) > 1}
    if dup:
        raise ValueError(f"duplicate claim ids in {path.name}: {sorted(dup)}")
    return claims


def accepted_dirty(path: Path | None = None) -> dict[str, str]:
    """``{result: why it stands}``: dirty-tree results the ledger accepts because they cannot be re-measured
    here (``[dirty]`` in the ledger). Kept short on purpose: each one is printed on every run."""
    return dict(tomllib.loads((path or LEDGER).read_text()).get("dirty", {}))


def prose(where: str) -> str:
    """What a reader reads: a notebook's markdown cells, or a markdown file."""
    path = ROOT / where
    if path.suffix == ".ipynb":
        cells = json.loads(path.read_text())["cells"]
        return "\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    return path.read_text()


_STEP = re.compile(r'(?P<count>\#)(?=$|[.\[])|"(?P<quoted>[^"]*)"|(?P<key>[^.\[\]"]+)|\[(?P<sel>(?:"[^"]*"|[^\]"])*)\]|(?P<dot>\.)')
_PAIR = re.compile(r'\s*(?P<k>"[^"]*"|[^=,"]+)=(?P<v>"[^"]*"|[^,"]*)\s*(?:,|$)')


def _unquote(text: str) -> str:
    return text[1:-1] if len(text) >= 2 and text[0] == text[-1] == '"' else text.strip()


def _steps(field: str) -> list[tuple[str, Any]]:
    """``a."b.c"[2][k="x,y",n=1]`` -> [("key", "a"), ("key", "b.c"), ("index", 2), ("select", {...})]."""
    steps: list[tuple[str, Any]] = []
    pos = 0
    while pos < len(field):
        m = _STEP.match(field, pos)
        if not m or m.end() == pos:
            raise KeyError(f"cannot parse the field path {field!r} at {field[pos:]!r}")
        pos = m.end()
        if m.group("dot"):
            continue
        if m.group("count"):
            steps.append(("count", None))
        elif m.group("quoted") is not None:
            steps.append(("key", m.group("quoted")))
        elif m.group("key") is not None:
            steps.append(("key", m.group("key")))
        else:
            inner = m.group("sel")
            if "=" not in inner:
                steps.append(("index", int(inner)))
                continue
            want, at = {}, 0
            while at < len(inner):
                pm = _PAIR.match(inner, at)
                if not pm or pm.end() == at:
                    raise KeyError(f"cannot parse the selector [{inner}]")
                want[_unquote(pm.group("k"))] = _unquote(pm.group("v"))
                at = pm.end()
            steps.append(("select", want))
    return steps


def lookup(data: Any, field: str) -> Any:
    """Follow ``a.b[2].c[k=4,batch=1].d`` into parsed JSON; KeyError names the first step that is missing.

    Quotes protect keys and selector values that contain ``. , = [ ]``: ``k[name="int4 [g128], sym"].v``."""
    node = data
    for kind, arg in _steps(field):
        if kind == "select":
            hits = [x for x in node if all(str(x.get(k)) == v for k, v in arg.items())]
            if len(hits) != 1:
                raise KeyError(f"{arg} matches {len(hits)} items")
            node = hits[0]
        elif kind == "index":
            node = node[arg]
        elif kind == "count":
            node = len(node)
        else:
            if arg not in node:
                raise KeyError(arg)
            node = node[arg]
    return node


_RESULTS_READ: dict[Path, Any] = {}  # a per-process cache, keyed by the full path (tests point RESULTS elsewhere)


def result_path(name: str) -> Path:
    """A result under benchmarks/results/ by its name, or any other committed JSON by its path from the root
    (``minifer/assets/models/train_report.json``: the bundled models' training record)."""
    return ROOT / name if "/" in name else RESULTS / name


def result_data(name: str) -> Any:
    path = result_path(name)
    if path not in _RESULTS_READ:
        _RESULTS_READ[path] = json.loads(path.read_text())
    return _RESULTS_READ[path]


def git_record(data: Any) -> dict[str, Any] | None:
    """Where a result says it was measured: ``metadata.git`` (``environment.git`` in the kernel reports)."""
    if not isinstance(data, dict):
        return None
    for section in ("metadata", "environment"):
        git = data.get(section, {}).get("git") if isinstance(data.get(section), dict) else None
        if isinstance(git, dict):
            return git
    return None


def measured_dirty(data: Any) -> bool:
    git = git_record(data)
    return bool(git and git.get("dirty"))


def paragraph(text: str, quote: str) -> str:
    """The paragraph (or table, or list) that holds the quote: where a reader looks for "simulated" or "bound"."""
    at = text.index(quote)
    start = text.rfind("\n\n", 0, at)
    end = text.find("\n\n", at + len(quote))
    return text[start + 2 if start >= 0 else 0:end if end >= 0 else len(text)]


def check(claim: Claim) -> str | None:
    """None if the claim holds, else what is wrong, in a sentence that names the claim."""
    text = prose(claim.where)
    if claim.text not in text:
        return f"{claim.id}: {claim.where} no longer says {claim.text!r} (edited by hand, or the sentence moved)"
    try:
        data = result_data(claim.result)
    except FileNotFoundError:
        shown = claim.result if "/" in claim.result else f"benchmarks/results/{claim.result}"
        return f"{claim.id}: no result file {shown}"
    value = _value(claim, data)
    if isinstance(value, str):
        return value
    if measured_dirty(data) and claim.result not in accepted_dirty():
        commit = (git_record(data) or {}).get("commit") or "?"
        return (f"{claim.id}: {claim.result} was measured at a dirty tree (commit {commit[:7]} plus uncommitted "
                f"changes): measure it again at a clean commit")
    if claim.kind == "measured":
        kind = data.get("kind") if isinstance(data, dict) else None
        segments = [arg for kind, arg in _steps(claim.field) if kind == "key"]
        if (kind in COMPUTED_KINDS or COMPUTED_SEGMENTS.intersection(segments)
                or segments[-1].startswith(COMPUTED_PREFIXES)):
            return f"{claim.id}: called measured, but {claim.result}:{claim.field} is a computed figure"
    elif claim.kind == "computed":
        if not COMPUTED_WORDS.search(paragraph(text, claim.text)):
            return f"{claim.id}: a computed figure whose paragraph does not say so: {claim.text!r}"
    else:
        return f"{claim.id}: kind must be 'measured' or 'computed', not {claim.kind!r}"
    printed = float(claim.printed.replace(",", ""))
    got = (value + claim.offset) * claim.scale
    if abs(got - printed) > claim.allowed_error():
        return (f"{claim.id}: {claim.where} prints {claim.printed} but {claim.result}:{claim.field} gives "
                f"{got:.6g} (allowed error {claim.allowed_error():.3g})")
    return None


def _value(claim: Claim, data: Any) -> float | str:
    """The cited number (divided by ``over`` when given), or a sentence saying which field is missing."""
    fields = [claim.field] + ([claim.over] if claim.over else [])
    values = []
    for field in fields:
        try:
            values.append(float(lookup(data, field)))
        except (KeyError, IndexError, TypeError, ValueError) as e:
            return f"{claim.id}: {claim.result} has no field {field} ({e})"
    return values[0] / values[1] if claim.over else values[0]


def waiver_problems(claims: list[Claim], accepted: dict[str, str] | None = None) -> list[str]:
    """A ``[dirty]`` entry must name a cited result that really is dirty; otherwise it would outlive its reason."""
    accepted = accepted_dirty() if accepted is None else accepted
    cited = {c.result for c in claims}
    problems = []
    for name in sorted(accepted):
        if name not in cited:
            problems.append(f"[dirty] {name}: no claim cites it; drop the entry")
            continue
        try:
            dirty = measured_dirty(result_data(name))
        except FileNotFoundError:
            dirty = False
        if not dirty:
            problems.append(f"[dirty] {name}: not measured at a dirty tree (any more); drop the entry")
    return problems


def reported(claims: list[Claim]) -> list[str]:
    """The results whose provenance is reported: every cited one, and every JSON in benchmarks/results/ (the
    notebooks read some of them in code cells, so a result no prose cites can still reach a reader)."""
    return sorted({c.result for c in claims} | {p.name for p in RESULTS.glob("*.json")})


def uncited_dirty(claims: list[Claim]) -> list[str]:
    """Results nobody cites that were measured at a dirty tree (a cited one is a mismatch instead)."""
    cited = {c.result for c in claims}
    return [name for name in reported(claims) if name not in cited and measured_dirty(result_data(name))]


def unrecorded(claims: list[Claim]) -> list[str]:
    """Results with no git record at all (written before results recorded their commit)."""
    out = []
    for name in reported(claims):
        try:
            if git_record(result_data(name)) is None:
                out.append(name)
        except FileNotFoundError:
            continue
    return out


def stale(claims: list[Claim], docs: dict[str, list[str]] | None = None) -> dict[str, list[str]]:
    """Results whose code or weights changed since they were measured: ``{result: [changed files]}``.

    A module whose docstrings, comments or module path alone changed does not make a result stale
    (:func:`freshness.same_code`); pass ``docs`` to collect those files per result."""
    sys.path.insert(0, str(ROOT))
    from minifer.bench.provenance import stale_sources

    out: dict[str, list[str]] = {}
    for name in reported(claims):
        try:
            data = result_data(name)
        except FileNotFoundError:
            continue
        meta = data.get("metadata", {})
        code = meta.get("code") if isinstance(meta, dict) else None
        if code is None:
            out[name] = ["(recorded before code fingerprints)"]
            continue
        record = git_record(data)
        commit = record["commit"] if record and not record.get("dirty") else None
        changed = stale_sources(code)
        text_only = [rel for rel in changed if same_code(rel, code[rel], commit)]
        if docs is not None and text_only:
            docs[name] = text_only
        if changed := [rel for rel in changed if rel not in text_only]:
            out[name] = changed
    return out


def headline_table(claims: list[Claim]) -> str:
    rows = ["| claim | the article | measured here | from |", "|---|---|---|---|"]
    for c in claims:
        if c.headline:
            rows.append(f"| {c.headline} | {c.article or ''} | {c.text.strip('*')} | "
                        f"[`{c.result}`](benchmarks/results/{c.result}) `{c.field}` |")
    return "\n".join(rows)


def render_readme(readme: str, claims: list[Claim]) -> str:
    a, b = readme.index(HEADLINE_START) + len(HEADLINE_START), readme.index(HEADLINE_END)
    return readme[:a] + "\n" + headline_table(claims) + "\n" + readme[b:]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--headline", action="store_true", help="rewrite README's headline table from the ledger")
    args = ap.parse_args(argv)
    claims = load()
    if args.headline:
        readme = ROOT / "README.md"
        readme.write_text(render_readme(readme.read_text(), claims))
        print("README.md: headline table rewritten")
    problems = [p for c in claims if (p := check(c))] + waiver_problems(claims)
    for p in problems:
        print("MISMATCH", p)
    docs: dict[str, list[str]] = {}
    for name, changed in stale(claims, docs).items():
        print(f"STALE {name}: {', '.join(changed[:6])}{' ...' if len(changed) > 6 else ''}")
    if docs:
        files = sorted({rel for changed in docs.values() for rel in changed})
        print(f"DOCS-ONLY {len(files)} modules changed in docstrings, comments or module paths alone since "
              f"{len(docs)} results were measured (they stay fresh): {', '.join(files[:6])}"
              f"{' ...' if len(files) > 6 else ''}")
    for name in unrecorded(claims):
        print(f"UNRECORDED {name}: no git record of the commit it was measured at")
    for name in uncited_dirty(claims):
        print(f"DIRTY {name}: measured at a modified tree (no claim cites it; a notebook may read it)")
    for name, why in accepted_dirty().items():
        print(f"DIRTY-ACCEPTED {name}: {why}")
    print(f"{len(claims)} claims, {len(problems)} mismatched")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
