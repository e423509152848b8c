"""What a saved piece carries, and the proof that it runs away from its notebook (``workbench.save``'s two halves).

A piece written in a notebook leans on the notebook: a helper defined beside it (``rotate_half``), a constant, an
import made three cells up. Its saved file must hold all of that, or it passes in the notebook and fails in the
capstone. ``carry`` walks the names the piece's source reads (every scope: function bodies, nested functions,
methods, decorators, default values, base classes), looks each up in the notebook's namespace, and carries it in the
form the file can hold: a function or class defined in the notebook as its source (walked in turn), a module or an
imported object as an import line, a plain constant as an assignment. A name it cannot carry (a list, a tensor, an
object built in a cell) is left out, and said why.

``check_in_fresh_process`` then runs the file in a new Python process, as the capstone will after a kernel
restart: the file must run, define the piece, and leave no name its code reads undefined (a function's missing
global raises only when it is called, so the names are checked, not just the import). With ``grade``, the piece is
graded there too. A file that fails is refused with the name it misses.

This module imports nothing heavy: the fresh process runs its ``main`` before anything but the saved file.
"""

from __future__ import annotations

import ast
import builtins
import inspect
import json
import os
import subprocess
import sys
import symtable
import types
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# "0" saves without the check: for a test suite that saves many deliberately wrong pieces (each check imports torch)
CHECK_ENV = "MINIFER_SAVE_CHECK"
CHECK_TIMEOUT_S = 120  # torch's import is most of a check (1-2 s here); a slow laptop gets room
CONSTANT_TYPES = (bool, int, float, complex, str, bytes, type(None))


class PieceRefused(Exception):
    """A piece whose saved file does not run on its own: it is not saved (the message names what it misses)."""


def free_names(source: str) -> set[str]:
    """The global names ``source`` reads, in any of its scopes, that it does not bind at its top level. Annotations
    are not read (the saved files postpone them), so a signature may name a class the file lacks."""
    table = symtable.symtable("from __future__ import annotations\n" + source, "<piece>", "exec")
    names: set[str] = set()

    def walk(t: symtable.SymbolTable) -> None:
        for s in t.get_symbols():
            top = t.get_type() == "module"
            if s.is_referenced() and (not (s.is_assigned() or s.is_imported()) if top else s.is_global()):
                names.add(s.get_name())
        for child in t.get_children():
            walk(child)

    walk(table)
    return names - bound_names(source)


def bound_names(source: str) -> set[str]:
    """The names ``source`` binds at its top level (definitions, imports, assignments)."""
    table = symtable.symtable(source, "<prelude>", "exec")
    return {s.get_name() for s in table.get_symbols() if s.is_assigned() or s.is_imported() or s.is_namespace()}


@dataclass
class Carried:
    """What a piece's file holds besides the piece: imports, constants, the sources of the notebook's helpers (each
    before what uses it), other pieces it builds on (saved as pieces of their own), and the names left out, why."""

    imports: list[str] = field(default_factory=list)
    constants: list[str] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)
    pieces: dict[str, Any] = field(default_factory=dict)
    left_out: dict[str, str] = field(default_factory=dict)
    undefined: list[str] = field(default_factory=list)  # read, but defined nowhere: not even in the notebook

    def text(self) -> str:
        blocks = ["\n".join(dict.fromkeys(self.imports)), "\n".join(self.constants), *self.sources]
        return "\n\n".join(b.rstrip("\n") + "\n" for b in blocks if b)


def carry(obj: Any, source: str, namespace: dict[str, Any], prelude: str, pieces: Collection[str],
          source_of: Callable[[Any], str]) -> Carried:
    """Everything ``obj`` (whose source is ``source``) reads from ``namespace`` (its notebook's), transitively, except
    what ``prelude`` already gives. A function or class of another piece in ``pieces`` is not copied: it is saved as
    that piece, and the file names it as needed."""
    home = namespace.get("__name__")
    given = bound_names(prelude)
    out = Carried()
    seen = {obj.__name__}

    def visit(text: str) -> None:
        for name in sorted(free_names(text) - seen):
            seen.add(name)
            if name not in namespace:
                if not hasattr(builtins, name):
                    out.undefined.append(name)  # the check names it
                continue
            value = namespace[name]
            own = _defined_in(value, home)
            if own is not None and name in pieces:
                out.pieces[name] = value
            elif own is not None:
                try:
                    helper = source_of(own)
                except (OSError, TypeError) as e:
                    out.left_out[name] = f"its source cannot be found ({e})"
                    continue
                visit(helper)  # what the helper reads goes first
                out.sources.append(helper)
            elif name in given:
                continue
            else:
                _as_import_or_constant(name, value, out)

    visit(source)
    return out


def _defined_in(value: Any, home: str | None) -> Any:
    """The function or class behind ``value`` when the notebook (module ``home``) defined it, else None: a Triton
    kernel's Python function is its ``fn``, whose source starts at the decorator (a ``StandInKernel``'s too)."""
    fn = getattr(value, "fn", None)
    if inspect.isfunction(fn) and (type(value).__module__.split(".")[0] == "triton"
                                   or getattr(value, "stand_in_for_triton", False)):  # no Triton: grading.quant's
        value = fn
    if (inspect.isfunction(value) or inspect.isclass(value)) and value.__module__ == home:
        return value
    return None


def _as_import_or_constant(name: str, value: Any, out: Carried) -> None:
    if isinstance(value, types.ModuleType):
        module = value.__name__
        out.imports.append(f"import {module}" if module == name else f"import {module} as {name}")
        return
    if _is_constant(value):
        out.constants.append(f"{name} = {value!r}")
        return
    if type(value).__module__ == "torch" and type(value).__name__ == "dtype":  # torch.float32
        out.imports.append("import torch")
        out.constants.append(f"{name} = {value}")
        return
    module, own = getattr(value, "__module__", None), getattr(value, "__name__", None)
    if isinstance(module, str) and isinstance(own, str) and getattr(sys.modules.get(module), own, None) is value:
        out.imports.append(f"from {module} import {own}" + (f" as {name}" if name != own else ""))
        return
    out.left_out[name] = (f"{name} is a {type(value).__name__} built in the notebook: a saved piece carries the "
                          f"functions, classes, imports and plain constants it uses, not objects; build it inside "
                          f"the function, or make it a constant")


def _is_constant(value: Any) -> bool:
    """A value its ``repr`` rebuilds: numbers, strings, bytes, and tuples or frozensets of them."""
    if isinstance(value, (tuple, frozenset)):
        return all(_is_constant(v) for v in value)
    if not isinstance(value, CONSTANT_TYPES):
        return False
    try:
        return ast.literal_eval(repr(value)) == value
    except (ValueError, SyntaxError):
        return False  # nan, inf


# --- the check in a fresh process ---------------------------------------------------------------------------


def check_in_fresh_process(name: str, file: Path, needs: list[Path], grade: bool) -> str | None:
    """Run ``file`` (after the saved pieces it ``needs``) in a new Python process; the reason it does not run on its
    own (``NameError: name 'rotate_half' is not defined``), or with ``grade`` the reason it fails its checks there,
    or None. One process per saved piece, importing what the file imports (and the graders, with ``grade``): about
    2 s of CPU, most of it torch's import."""
    if os.environ.get(CHECK_ENV) == "0":
        return None
    paths = [os.path.abspath(p) for p in sys.path if p] + [os.getcwd()]
    args = [name, str(file), json.dumps([str(n) for n in needs]), "1" if grade else "0"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}
    try:
        proc = subprocess.run([sys.executable, "-c", "from minifer_course.workbench_save import main; main()", *args],
                              capture_output=True, text=True, timeout=CHECK_TIMEOUT_S, env=env)
    except subprocess.TimeoutExpired:
        return None  # not proven either way: the capstone reports what does not run
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return f"the check of the saved file crashed ({tail})"
    return json.loads(lines[-1])["problem"]


def main() -> None:
    """The fresh process: run the saved file as ``workbench.load_saved`` does, then say (as a JSON line) what it
    misses."""
    name, file, needs, grade = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4] == "1"
    print(json.dumps({"problem": _problem(name, file, [Path(n) for n in needs], grade)}))


def _problem(name: str, file: Path, needs: list[Path], grade: bool) -> str | None:
    found: dict[str, Any] = {}
    for path in [*needs, file]:
        module = types.ModuleType(f"my_engine.{path.stem}")
        module.__dict__.update(found)
        sys.modules[module.__name__] = module
        text = path.read_text()
        try:
            exec(compile(text, str(path), "exec", dont_inherit=True), module.__dict__)
        except ModuleNotFoundError as e:
            if _missing_here_too(e):
                return None  # this machine lacks the module (Triton on macOS): not the piece's fault
            return f"{type(e).__name__}: {e}"
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        missing = sorted(n for n in free_names(text) if n not in module.__dict__ and not hasattr(builtins, n))
        if missing:
            return f"NameError: name {missing[0]!r} is not defined" + (
                f" (nor {', '.join(map(repr, missing[1:]))})" if missing[1:] else "")
        found[path.stem] = module.__dict__.get(path.stem)
    if found.get(name) is None:
        return f"the saved file does not define {name}"
    return _graded(name, found[name]) if grade else None


def _missing_here_too(error: ModuleNotFoundError) -> bool:
    import importlib.util

    top = (error.name or "").split(".")[0]
    return bool(top) and importlib.util.find_spec(top) is None


def _graded(name: str, piece: Any) -> str | None:
    from minifer_course.grading.base import Blocked
    from minifer_course.grading.engine import grade_quietly

    try:
        problem = grade_quietly(name, piece)
    except Blocked:
        return None  # blocked here as in the notebook (no Triton): not a failure
    return None if problem is None else f"it passes its checks in the notebook, not from its file:\n{problem}"
