"""Whether a measured result still describes the code: the same statements, read past docstrings, comments and moves.

A result records ``{path: sha256[:16]}`` of every module its run imported (``minifer.bench.provenance``). A file
whose hash differs now may still run exactly what ran then:

- its docstrings or comments changed, and nothing else (:func:`code_only` is the same);
- it moved to another path (git sees a rename since the result's commit) and the modules that import it now name
  its new path (``import new.path`` or ``from new import path``, or in a string: ``prog="python -m new.path"``),
  and nothing else changed: the program is the same up to a renaming of modules.

Both checks read the file back from the result's commit, and the file there must hash to what the run recorded (a
run at a modified tree, or a clone without the commit, has nothing to compare with: its changed files stay changed).
The renaming is strict: an import, or a module's dotted name in a string (the whole name, not part of a longer
one), may change only from a renamed module's old name to its new one, so an import re-pointed to a different module
of the same name still counts as a change.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def module_name(rel: str) -> str:
    """``minifer/engine/llm.py`` -> ``minifer.engine.llm`` (a package's ``__init__.py`` names the package)."""
    parts = rel.removesuffix(".py").split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _renamed(name: str, renames: dict[str, str]) -> str:
    for old, new in sorted(renames.items(), key=lambda kv: -len(kv[0])):  # the longest (most specific) first
        if name == old or name.startswith(old + "."):
            return new + name[len(old):]
    return name


def _renamed_in_text(text: str, renames: dict[str, str]) -> str:
    """``text`` with every renamed module's dotted name in it (as a whole name: ``pkg.old`` in ``python -m pkg.old``
    or ``pkg.old.f``, not in ``pkg.older`` or ``x.pkg.old``) named by its new name, the longest old name first."""
    names = "|".join(re.escape(old) for old in sorted(renames, key=len, reverse=True))
    return re.sub(rf"(?<![\w.])({names})(?!\w)", lambda m: renames[m.group(1)], text)


def code_only(source: str, renames: dict[str, str] | None = None) -> str:
    """A module's code with its docstrings and comments left out, and the renamed modules (``{old: new}`` dotted
    names) named by their new names in its imports and strings: two sources with the same
    ``code_only`` run the same statements, so a result measured on one holds for the other. (Pass ``renames``
    for the old source only: a new name that starts with an old one would be renamed twice.)"""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                node.body = body[1:] or [ast.Pass()]
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # ``from a import b as c`` binds ``c`` to ``a.b``, module or not: compared as that full name, so that
            # ``from pkg import mod`` of a moved ``mod`` may name its new package.
            for alias in node.names:
                alias.asname = alias.asname or alias.name
                alias.name = _renamed(f"{node.module}.{alias.name}", renames or {})
            node.module = ""
        if not renames:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                alias.name = _renamed(alias.name, renames)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            # a module named in a string: a lazy import's table, ``python -m`` in a command or a parser's prog
            node.value = _renamed_in_text(node.value, renames)
    return ast.dump(tree, annotate_fields=False, include_attributes=False)


def renames_since(commit: str) -> dict[str, str]:
    """``{old path: new path}`` of the Python files git sees renamed between ``commit`` and the working tree."""
    return _renames(ROOT, commit)


@functools.cache
def _renames(root: Path, commit: str) -> dict[str, str]:
    out = subprocess.run(["git", "diff", "-M", "--name-status", commit, "--", "*.py"], cwd=root,
                         capture_output=True, text=True, timeout=60)
    moves = {}
    for line in out.stdout.splitlines() if out.returncode == 0 else []:
        status, *paths = line.split("\t")
        if status.startswith("R") and len(paths) == 2:
            moves[paths[0]] = paths[1]
    return moves


def same_code(rel: str, recorded_sha: str, commit: str | None) -> bool:
    """Whether the recorded file ``rel`` runs now as it ran at ``commit``, at its path or at the path it moved to,
    its docstrings, comments and renamed imports aside (module docstring: the two rules)."""
    if commit is None or not rel.endswith(".py"):
        return False
    old = subprocess.run(["git", "show", f"{commit}:{rel}"], cwd=ROOT, capture_output=True, timeout=30)
    if old.returncode != 0 or hashlib.sha256(old.stdout).hexdigest()[:16] != recorded_sha:
        return False
    moves = renames_since(commit)
    now = ROOT / moves.get(rel, rel)
    if not now.exists():
        return False
    renames = {module_name(a): module_name(b) for a, b in moves.items()}
    try:
        return code_only(old.stdout.decode(), renames) == code_only(now.read_text())
    except (SyntaxError, UnicodeDecodeError):
        return False
