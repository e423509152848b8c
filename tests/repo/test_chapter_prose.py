"""The chapters teach the subject, not the project's history: no lab-book phrase in their prose (targets met or
missed, replicates, this machine's load, commits, how a result was re-measured: that lives in
``benchmarks/results/README.md``), and every glossary term is linked to the glossary where a chapter first uses it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHAPTERS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
EXERCISES = sorted((ROOT / "exercises" / "source").glob("*.py"))
GLOSSARY = ROOT / "docs" / "glossary.md"

# The lab book's vocabulary: a sentence with one of these speaks of the project, not of inference engineering.
LAB_BOOK = [r"missed by", r"\bmet in\b", r"(?:target|targets) (?:was|were|is|are) (?:met|missed|not met)",
            r"\bnot met\b", r"\breplicate\b", r"this project", r"this (?:project's )?shared (?:2-core )?machine",
            r"development machine", r"this (?:busy|loaded) machine", r"\bissue \d+",
            r"\bat (?:a )?(?:clean )?commit\b", r"(?:was|were) re-measured", r"\bre-ran\b"]


def _markdown(path: Path) -> list[str]:
    if path.suffix == ".py":  # an exercise's single source: its markdown is the comment blocks of [markdown] cells
        cells = re.split(r"^# %%", path.read_text(), flags=re.M)
        return ["\n".join(line[2:] for line in c.splitlines()[1:] if line.startswith("# "))
                for c in cells if c.startswith(" [markdown]")]
    return ["".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "markdown"]


def lab_book_phrases(text: str) -> list[str]:
    return [m.group(0) for p in LAB_BOOK for m in re.finditer(p, text, re.I)]


def test_the_phrase_list_catches_what_it_is_for():
    assert lab_book_phrases("the target was missed by 0.21 in the replicate, on this shared machine")
    assert lab_book_phrases("At commit 4af44fb the speedup was re-measured (issue 28).")
    assert lab_book_phrases("make results measures everything again at a clean commit")
    assert not lab_book_phrases("quality has to be re-measured on your own workload; a replica is a copy")


@pytest.mark.parametrize("path", CHAPTERS + [ROOT / "README.md"] + EXERCISES, ids=lambda p: p.name)
def test_no_lab_book_phrase(path):
    text = path.read_text() if path.suffix == ".md" else "\n".join(_markdown(path))
    assert not lab_book_phrases(text), f"{path.name} speaks of the project's history: {lab_book_phrases(text)}"


def glossary_terms() -> dict[str, str]:
    """Each glossary heading's terms (``### ptxas, lop3`` names two) and the heading's anchor."""
    terms = {}
    for heading in re.findall(r"^### (.+)$", GLOSSARY.read_text(), re.M):
        anchor = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        for term in re.split(r",\s*", heading):
            terms[term.strip()] = anchor
    return terms


def unlinked_first_uses(cells: list[str], terms: dict[str, str]) -> list[tuple[str, str]]:
    """(term, context) for each term whose first use in ``cells`` is in a cell that does not link it."""
    missing = []
    for term, anchor in terms.items():
        exact = term.isupper() or any(ch.isupper() for ch in term[1:])  # acronyms and names keep their case
        pattern = re.compile(r"(?<![\w`/#-])" + re.escape(term) + r"(?![\w`-])", 0 if exact else re.I)
        for cell in cells:
            body = re.sub(r"^#.*$", "", cell, flags=re.M)  # a heading names its section; the prose defines
            # a link to this term is a use; another term's link text ("[chunked prefill]") is not a use of this one
            body = re.sub(r"\[([^\]]*)\]\(([^)]*)\)", lambda k: k.group(1) if k.group(2).endswith("#" + anchor)
                          else " " * len(k.group(0)), body)
            m = pattern.search(body)
            if m:
                if f"glossary.md#{anchor}" not in cell:
                    missing.append((term, body[max(0, m.start() - 40):m.end() + 20].replace("\n", " ")))
                break
    return missing


def test_first_use_finder():
    terms = {"KV cache": "kv-cache", "QPS": "qps"}
    assert unlinked_first_uses(["No cache here.", "The KV cache grows.", "[KV cache](glossary.md#kv-cache)"],
                               terms) == [("KV cache", "The KV cache grows.")]
    assert unlinked_first_uses(["At high [QPS](../docs/glossary.md#qps)."], terms) == []


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_glossary_terms_linked_at_first_use(path):
    missing = unlinked_first_uses(_markdown(path), glossary_terms())
    assert not missing, f"{path.name} uses glossary terms before linking them: {missing}"
