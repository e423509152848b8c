#!/usr/bin/env python3
"""Which notebooks use Triton, found by reading them (not listed by hand): what ``make test``'s no-Triton step runs.

    python3 tools/no_triton/scan.py      # the plan: notebooks run whole, notebooks whose first code cell runs

A code cell **uses Triton** when it imports ``triton``, imports a module of this repository that imports ``triton``
(anywhere in it: ``minifer.kernels.quant_matmul_jit``, ``minifer_course.grading.quant``), names anything whose name
says Triton (``triton.jit``, ``kvm.enable_triton_interpreter``, ``triton_ok``), names a function it imported from such a
module whose own body says Triton, or names what an earlier statement of the notebook made from Triton (a function
defined with Triton in it, the result of a Triton call: ``tri = kvm.triton_vs_reference(...)``). A notebook with such a
cell runs whole under the shim; an exercise notebook runs through its solved twin (its untouched stubs fail by
design: ``tests/course/test_exercise_stubs.py``). Every other notebook runs its first code cell (its imports and
model loading: the smoke test that it starts without Triton), once per distinct cell (an exercise's is its twin's).

A cell that uses Triton and *acts* on it (one of its top-level statements that use Triton is not a definition, an
import or an assignment: a call, a ``print``, an ``if triton_ok``) must print why Triton did not run (``REASONS``);
one whose Triton statements only define (a ``@triton.jit`` kernel, under the stand-in) or assign (``triton_ok,
triton_msg = kvm.enable_triton_interpreter()``) need not: were they to run Triton, the run would fail on the error. Strings and comments are not read:
``f"Triton {env['triton']}"`` prints a version from a JSON file and uses nothing.
"""

from __future__ import annotations

import ast
import functools
import json
from dataclasses import dataclass, field
from pathlib import Path

from minifer_course.hosted import SETUP_ID  # the hosted setup cell stamped above every notebook's own

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("notebooks", "exercises", "solutions")
PACKAGES = ("minifer", "minifer_course")
DETECTOR = "minifer.kernels"  # its guarded import is the detection itself, not a use
REASONS = ("Triton is not installed", "blocked", "no CUDA GPU")  # a skipped Triton cell prints one of these


def says_triton(name: str | None) -> bool:
    return bool(name) and "triton" in name.lower()


def parse(source: str) -> ast.Module | None:
    """A code cell's AST, IPython's ``%magic`` and ``!shell`` lines blanked; None if it is not Python."""
    lines = ["" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines()]
    try:
        return ast.parse("\n".join(lines))
    except SyntaxError:
        return None


def names_in(tree: ast.AST) -> set[str]:
    """Every identifier ``tree`` reads, binds or imports (not strings, not comments)."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            out.add(node.id)
        elif isinstance(node, ast.Attribute):
            out.add(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.alias):
            out.update(filter(None, (node.name, node.asname)))
        elif isinstance(node, ast.ImportFrom):
            out.add(node.module or "")
        elif isinstance(node, ast.keyword):
            out.add(node.arg or "")
    return out


def imported_modules(tree: ast.AST) -> dict[str, str]:
    """``{local name: module}`` for ``import M`` and ``from P import M`` (M possibly a module), and each
    ``from M import f`` as ``{f: M}``."""
    out: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update({a.asname or a.name: a.name for a in node.names})
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.update({a.asname or a.name: node.module for a in node.names})
            out.update({f"{a.asname or a.name} (module)": f"{node.module}.{a.name}" for a in node.names})
    return out


@functools.lru_cache(maxsize=None)
def module_tree(module: str) -> ast.Module | None:
    """The AST of one of this repository's modules, None for any other."""
    if module.split(".")[0] not in PACKAGES:
        return None
    base = ROOT.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return ast.parse(path.read_text())
    return None


def module_uses_triton(module: str) -> bool:
    """A repository module that imports ``triton`` anywhere in it (a lazy import inside a function too)."""
    tree = module_tree(module)
    if tree is None or module == DETECTOR:
        return False
    return any(isinstance(n, ast.Import) and any(a.name.split(".")[0] == "triton" for a in n.names)
               or isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == "triton"
               for n in ast.walk(tree))


def function_says_triton(module: str, name: str) -> bool:
    """Whether ``module``'s top-level function or class ``name`` names Triton in its body."""
    tree = module_tree(module)
    for node in tree.body if tree else []:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name:
            return any(says_triton(n) for n in names_in(node))
    return False


def triton_statements(tree: ast.Module, bound: set[str]) -> list[ast.stmt]:
    """The cell's top-level statements that use Triton (the cell's imports decide what its names stand for). A name
    an assignment binds from Triton (``tri = kvm.triton_vs_reference(...)``) uses Triton after it: added to
    ``bound``, which the notebook's later cells share."""
    imports = imported_modules(tree)
    bound |= {local for local, module in imports.items() if not local.endswith(" (module)")
              and (module.split(".")[0] == "triton" or module_uses_triton(module) and function_says_triton(module, local))}
    bound |= {local.removesuffix(" (module)") for local, module in imports.items()
              if local.endswith(" (module)") and module_uses_triton(module)}
    uses = []
    for stmt in tree.body:
        if not any(says_triton(n) or n in bound for n in names_in(stmt)):
            continue
        uses.append(stmt)
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(stmt.name)  # a kernel, or a wrapper that launches one
        elif isinstance(stmt, (ast.Assign, ast.AnnAssign)) and stmt.value is not None and from_triton(stmt.value, bound):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            bound |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return uses


def from_triton(value: ast.expr, bound: set[str]) -> bool:
    """Whether an assigned value comes from Triton: a call of something Triton's (``kvm.triton_vs_reference(...)``),
    or no call at all and a Triton name in it. A call of anything else is not, whatever its arguments:
    ``pick_int4_matmul(int4_matmul, int4_matmul_torch)`` hands back what runs on this machine."""
    if isinstance(value, ast.Call):
        return any(says_triton(n) or n in bound for n in names_in(value.func))
    return any(says_triton(n) or n in bound for n in names_in(value))


QUIET = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Import, ast.ImportFrom, ast.Assign, ast.AnnAssign)


@dataclass
class Notebook:
    path: Path
    triton_cells: list[int] = field(default_factory=list)  # indices in the notebook's cells
    acting: list[int] = field(default_factory=list)  # of those, the cells that must print a reason

    @property
    def rel(self) -> str:
        return self.path.relative_to(ROOT).as_posix()


def scan(path: Path) -> Notebook:
    nb, bound = Notebook(path), set()
    for i, cell in enumerate(json.loads(path.read_text())["cells"]):
        if cell["cell_type"] != "code":
            continue
        tree = parse("".join(cell["source"]))
        uses = triton_statements(tree, bound) if tree is not None else []
        if uses:
            nb.triton_cells.append(i)
            if not all(isinstance(stmt, QUIET) for stmt in uses):  # it runs something of Triton's: say why not
                nb.acting.append(i)
    return nb


def first_code_cell(path: Path) -> str:
    """The notebook's own first code cell (after the hosted setup cell, which is the same everywhere)."""
    return next("".join(c["source"]) for c in json.loads(path.read_text())["cells"]
                if c["cell_type"] == "code" and c.get("id") != SETUP_ID)


def plan() -> tuple[list[Notebook], list[Path]]:
    """The notebooks to run whole (Triton users; an exercise's solved twin in its place) and those whose first code
    cell runs (all the others, but one whose first code cell is one already run: an exercise and its solved twin
    share theirs, and every notebook sits one folder below the root, so the cell runs the same)."""
    found = {p: scan(p) for folder in FOLDERS for p in sorted((ROOT / folder).glob("*.ipynb"))}
    whole: dict[Path, Notebook] = {}
    for path, nb in found.items():
        if nb.triton_cells:
            twin = ROOT / "solutions" / path.name if path.parent.name == "exercises" else path
            whole[twin] = found[twin]
    seen, first = {first_code_cell(p) for p in whole}, []
    for path in (p for p in found if p not in whole):
        if first_code_cell(path) not in seen:
            seen.add(first_code_cell(path))
            first.append(path)
    return list(whole.values()), first


def main() -> None:
    whole, first = plan()
    print("run whole under the shim (they use Triton):")
    for nb in whole:
        print(f"  {nb.rel}: Triton cells {nb.triton_cells}, of which print a reason {nb.acting}")
    print("first code cell only:")
    for path in first:
        print(f"  {path.relative_to(ROOT).as_posix()}")


if __name__ == "__main__":
    main()
