#!/usr/bin/env python3
"""After results are measured again: write their new numbers into the prose and the ledger, and list what moved.

    python3 tools/claims_update.py            # show what would change (nothing is written)
    python3 tools/claims_update.py --write    # rewrite the prose and benchmarks/claims.toml

Why a tool: a change of engine code makes every result stale (``tools/claims.py``), and measuring them again moves
hundreds of quoted numbers by a little. Copying each by hand is slow and error-prone; so this rewrites every claim
whose number no longer matches its result, printed with the digits the prose used, in the prose (every place its
quote appears: markdown files, notebooks' markdown cells) and in the quotes of the ledger (a claim's quote may hold
another claim's number: both are rewritten from the same edit).

What it does not do is read: a sentence around a moved number ("slower in 1 of 14 cells", "missed by 0.17", "the
interval reaches 1.0") may now be wrong in words. So it prints every moved number with its paragraph, old -> new,
for a person to read before committing; the claims check (``tools/claims.py``) then confirms the numbers.
Claims that fail for another reason (a quote not found, a missing field, a dirty result) are listed, not touched.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import claims  # noqa: E402


@dataclass(frozen=True)
class Edit:
    where: str  # the prose file
    doc: int  # which text in it: 0 for a markdown file, the cell's index for a notebook
    start: int  # the number's span in that text
    end: int
    new: str
    old: str


def fmt(value: float, like: str) -> str:
    """``value`` printed as ``like`` is: the same number of decimals, thousands commas if it has them, and a sign if
    it has one (a claim's quote keeps its style when its number moves)."""
    body = like.replace(",", "").lstrip("+")
    digits = max(0, -Decimal(body.lstrip("-")).as_tuple().exponent)
    text = f"{value:,.{digits}f}" if "," in like else f"{value:.{digits}f}"
    if digits == 0 and text in ("-0", "+0"):
        text = "0"
    return ("+" + text) if like.startswith("+") and not text.startswith("-") else text


def documents(where: str) -> list[str | None]:
    """The texts a reader reads in ``where``: a markdown file whole, or each cell of a notebook (None for a code cell,
    which is never edited)."""
    path = claims.ROOT / where
    if path.suffix == ".ipynb":
        return ["".join(c["source"]) if c["cell_type"] == "markdown" else None
                for c in json.loads(path.read_text())["cells"]]
    return [path.read_text()]


def number_offset(claim: claims.Claim) -> int:
    """Where the claim's number starts in its printed text (the quote without its braces)."""
    return claims.NUMBER.search(claim.quote).start()


def occurrences(claim: claims.Claim, docs: list[str | None]) -> list[tuple[int, int]]:
    """``(doc, start)`` of every place the claim's printed text appears."""
    found = []
    for d, text in enumerate(docs):
        if text is None:
            continue
        found.extend((d, m.start()) for m in re.finditer(re.escape(claim.text), text))
    return found


def plan(ledger: list[claims.Claim], value_of=None) -> tuple[list[Edit], list[tuple[claims.Claim, str, str]], list[str]]:
    """The edits that bring every drifted number in line with its result, the ``(claim, old, new)`` they come from,
    and the problems left for a person (claims that fail for any other reason than a moved number)."""
    value_of = value_of or _current_value
    edits, moved, problems = [], [], []
    cache: dict[str, list[str | None]] = {}
    for claim in ledger:
        docs = cache.setdefault(claim.where, documents(claim.where))
        where = occurrences(claim, docs)
        if not where:
            problems.append(f"{claim.id}: {claim.where} no longer says {claim.text!r}")
            continue
        value = value_of(claim)
        if isinstance(value, str):
            problems.append(value)
            continue
        got = (value + claim.offset) * claim.scale
        new = claim.printed  # a claim that holds pins its number: another claim on it may not move it
        if abs(got - float(claim.printed.replace(",", ""))) > claim.allowed_error():
            new = fmt(got, claim.printed)
            moved.append((claim, claim.printed, new))
        at = number_offset(claim)
        edits.extend(Edit(claim.where, d, s + at, s + at + len(claim.printed), new, claim.printed) for d, s in where)
    return [e for e in _unique(edits) if e.new != e.old], moved, problems


def _current_value(claim: claims.Claim) -> float | str:
    try:
        data = claims.result_data(claim.result)
    except FileNotFoundError:
        return f"{claim.id}: no result file {claim.result}"
    return claims._value(claim, data)


def _unique(edits: list[Edit]) -> list[Edit]:
    """One edit per span; two claims on the same printed number must agree on its new value."""
    by_span: dict[tuple, Edit] = {}
    for e in edits:
        key = (e.where, e.doc, e.start, e.end)
        if key in by_span and by_span[key].new != e.new:
            raise ValueError(f"{e.where}: two claims give the number at {e.start} different values "
                             f"({by_span[key].new} and {e.new}); fix the ledger")
        by_span[key] = e
    return sorted(by_span.values(), key=lambda e: (e.where, e.doc, e.start))


def apply(text: str, edits: list[Edit], lo: int = 0, hi: int | None = None) -> str:
    """``text[lo:hi]`` with the edits that fall inside it applied."""
    hi = len(text) if hi is None else hi
    out, at = [], lo
    for e in sorted(edits, key=lambda e: e.start):
        if lo <= e.start and e.end <= hi:
            out.append(text[at:e.start] + e.new)
            at = e.end
    return "".join(out) + text[at:hi]


def new_quotes(ledger: list[claims.Claim], edits: list[Edit]) -> dict[str, str]:
    """``{claim id: its new quote}`` for every claim whose printed text an edit touches (its own number or another
    claim's inside its quote), read from its first occurrence."""
    quotes = {}
    cache: dict[str, list[str | None]] = {}
    for claim in ledger:
        docs = cache.setdefault(claim.where, documents(claim.where))
        where = occurrences(claim, docs)
        if not where:
            continue
        d, s = where[0]
        inside = [e for e in edits if e.where == claim.where and e.doc == d and s <= e.start and e.end <= s + len(claim.text)]
        if not inside:
            continue
        at = s + number_offset(claim)
        text = docs[d]
        own = next((e for e in inside if e.start == at), None)
        before = apply(text, inside, s, at)
        number = own.new if own else claim.printed
        after = apply(text, inside, at + len(claim.printed), s + len(claim.text))
        quotes[claim.id] = before + "{" + number + "}" + after
    return quotes


def write_prose(edits: list[Edit]) -> None:
    for where in sorted({e.where for e in edits}):
        path = claims.ROOT / where
        mine = [e for e in edits if e.where == where]
        if path.suffix == ".ipynb":
            nb = json.loads(path.read_text())
            for d in sorted({e.doc for e in mine}):
                cell = nb["cells"][d]
                cell["source"] = apply("".join(cell["source"]), [e for e in mine if e.doc == d]).splitlines(keepends=True)
            path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
        else:
            path.write_text(apply(path.read_text(), mine))


def write_sources(moved: list[tuple[claims.Claim, str, str]], root: Path | None = None) -> list[str]:
    """The exercise notebooks are built from ``exercises/source/NAME.py`` (``tools/build_exercises.py``): a number
    moved in ``exercises/NAME.ipynb`` or ``solutions/NAME.ipynb`` is moved in that source too, or the next build
    would put the old one back. There the prose is commented ("# " lines, wrapped anywhere), so the claim's text is
    matched with any run of spaces, line breaks and comment marks between its words. Returns the sources written."""
    root = root or claims.ROOT
    written = []
    for claim, old, new in moved:
        m = re.fullmatch(r"(?:exercises|solutions)/(.+)\.ipynb", claim.where)
        source = root / "exercises" / "source" / f"{m.group(1)}.py" if m else None
        if source is None or not source.exists():
            continue
        at = number_offset(claim)
        gap = r"(?:\s+(?:#[ \t]*)?)"  # the words' separator: spaces, or a line break and the next line's "# "
        words = lambda t: gap.join(re.escape(w) for w in t.split())  # noqa: E731
        before, after = claim.text[:at], claim.text[at + len(old):]
        pattern = (words(before) + (gap if before[-1:].isspace() else "") + "(" + re.escape(old) + ")"
                   + (gap if after[:1].isspace() else "") + words(after))
        text = source.read_text()
        found = re.search(pattern, text)
        if found:
            source.write_text(text[:found.start(1)] + new + text[found.end(1):])
            written.append(str(source.relative_to(root)))
    return sorted(set(written))


def toml_string(text: str) -> str:
    """A TOML basic string (JSON's escapes are TOML's, for what quotes hold)."""
    return json.dumps(text, ensure_ascii=False)


def write_ledger(quotes: dict[str, str], path: Path | None = None) -> None:
    """Replace the ``quote = ...`` line of each claim in ``quotes`` (found by its ``id`` line)."""
    path = path or claims.LEDGER
    lines = path.read_text().splitlines(keepends=True)
    current = None
    for i, line in enumerate(lines):
        m = re.match(r'id\s*=\s*"([^"]+)"', line)
        if m:
            current = m.group(1)
        elif current in quotes and re.match(r"quote\s*=", line):
            lines[i] = f"quote = {toml_string(quotes[current])}\n"
            current = None
    path.write_text("".join(lines))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--write", action="store_true", help="rewrite the prose and the ledger (default: only show)")
    args = ap.parse_args(argv)
    ledger = claims.load()
    edits, moved, problems = plan(ledger)
    for claim, old, new in moved:
        docs = documents(claim.where)
        d, s = occurrences(claim, docs)[0]
        print(f"{claim.id} ({claim.where}): {old} -> {new}\n    {claims.paragraph(docs[d], claim.text)[:600]}\n")
    for p in problems:
        print("NOT UPDATED", p)
    print(f"{len(moved)} numbers moved, {len(edits)} places in the prose; {len(problems)} claims need a person")
    if args.write and edits:
        quotes = new_quotes(ledger, edits)
        write_prose(edits)
        write_ledger(quotes)
        for source in write_sources(moved):
            print(f"{source}: moved numbers written; run tools/build_exercises.py to rebuild its notebooks")
        still = [p for c in claims.load() if (p := claims.check(c))]
        print(f"written; the claims check now finds {len(still)} mismatched: read the paragraphs above")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
