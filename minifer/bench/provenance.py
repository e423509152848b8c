"""Where a result came from: the commit, the command, and a fingerprint of the code and weights it measured.

A committed number is only worth as much as our ability to say what produced it. Every result JSON carries
``metadata.git`` (the commit, and whether the tree differed from it) and ``metadata.code``: the sha256 of each
source module of ``minifer`` and ``minifer_course`` the run had imported and of each bundled checkpoint it read,
taken when the result is saved. :func:`stale_sources` compares such a record with the tree as it is now, so a result
whose code or weights changed since it was measured is named instead of silently standing
(``tests/repo/test_claims.py`` reports them; ``make results`` measures them again).

Everything here watches the run from outside: the modules it imported are in ``sys.modules``, and the checkpoint
folders it read are seen by an audit hook (:func:`sys.addaudithook`) on the process's file opens and directory
listings, installed when ``minifer.bench`` is first imported, before any benchmark loads a model. The engine keeps
no record for it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = (ROOT / "minifer", ROOT / "minifer_course")
BUNDLED = ROOT / "minifer" / "assets" / "models"
_BUNDLED_PREFIX = str(BUNDLED) + os.sep
_READS = frozenset({"open", "os.scandir", "os.listdir"})
_bundled_read: set[Path] = set()  # the bundled checkpoint folders this process has read


def _note_read(event: str, args: tuple) -> None:
    """The audit hook: a file opened or a directory listed under ``BUNDLED`` marks its checkpoint folder as read."""
    if event not in _READS or not args or not isinstance(args[0], (str, os.PathLike)):
        return
    path = os.path.abspath(args[0])
    if path.startswith(_BUNDLED_PREFIX):
        _bundled_read.add(BUNDLED / Path(path[len(_BUNDLED_PREFIX):]).parts[0])


sys.addaudithook(_note_read)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def git_commit() -> dict[str, Any]:
    """The commit a result was measured at, and whether the working tree differed from it (any tracked or new
    file outside ``benchmarks/results`` and ``runs``). If it did, ``diff_sha256`` fingerprints ``git diff HEAD``:
    the commit alone would not say what was measured, the fingerprint at least tells two such runs apart."""
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        status = subprocess.run(["git", "status", "--porcelain", "--", ".", ":!benchmarks/results", ":!runs"],
                                cwd=ROOT, capture_output=True, text=True, timeout=10)
        if sha.returncode == 0:
            info: dict[str, Any] = {"commit": sha.stdout.strip(), "dirty": bool(status.stdout.strip())}
            if info["dirty"]:
                diff = subprocess.run(["git", "diff", "HEAD", "--", ".", ":!benchmarks/results", ":!runs"],
                                      cwd=ROOT, capture_output=True, timeout=30)
                info["diff_sha256"] = hashlib.sha256(diff.stdout).hexdigest()
            return info
    except (OSError, subprocess.SubprocessError):
        pass
    return {"commit": None, "dirty": None}


def code_fingerprint() -> dict[str, str]:
    """``{path: sha256[:16]}`` of every ``minifer`` and ``minifer_course`` module imported so far and of every
    bundled checkpoint read so far.

    Taken at save time, the imported modules are the code the run executed (a benchmark imports what it measures),
    and the checkpoints are the bundled folders the process opened a file of (``_note_read``): retraining the EAGLE
    head leaves a throughput result fresh."""
    files: dict[str, str] = {}
    for module in list(sys.modules.values()):
        f = getattr(module, "__file__", None)
        if not f:
            continue
        path = Path(f).resolve()
        if path.suffix == ".py" and any(path.is_relative_to(p) for p in PACKAGES) and path.exists():
            files[path.relative_to(ROOT).as_posix()] = _sha(path)
    for path in sorted(p for folder in sorted(_bundled_read) for p in folder.glob("*")):
        if path.suffix in (".safetensors", ".json") and path.name != "training.json":
            files[path.relative_to(ROOT).as_posix()] = _sha(path)
    return dict(sorted(files.items()))


def stale_sources(recorded: dict[str, str]) -> list[str]:
    """The recorded files whose content differs now, or that no longer exist (moved or deleted)."""
    changed = []
    for rel, sha in recorded.items():
        path = ROOT / rel
        if not path.exists() or _sha(path) != sha:
            changed.append(rel)
    return changed


def metadata(argv: Sequence[str] | None = None, module: str = "minifer.bench") -> dict[str, Any]:
    """Hardware, versions, git commit, command line (``python -m MODULE ARGS``) and time of a run (stored in
    every result; :func:`save_result` adds the code fingerprint when it writes the file)."""
    from minifer.bench.machine import environment

    cmd = ["python", "-m", module, *(sys.argv[1:] if argv is None else argv)]
    return {**environment(), "git": git_commit(), "command": shlex.join(cmd),
            "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def _json_default(x):
    if isinstance(x, (set, tuple)):
        return list(x)
    return str(x)


def save_result(result: dict[str, Any], path: str | Path, indent: int = 1,
                sources: dict[str, str] | None = None) -> Path:
    """Write a result JSON, stamping ``metadata.code`` with the fingerprint of what the run executed and of
    ``sources`` (``{path: sha256[:16]}``: the files a result derived from others read, so it goes stale with them)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(result.get("metadata"), dict):
        result["metadata"]["code"] = {**code_fingerprint(), **(sources or {})}
    path.write_text(json.dumps(result, indent=indent, default=_json_default, allow_nan=True))
    return path
