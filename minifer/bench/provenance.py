"""Where a result came from: the commit, the command, and a fingerprint of the code and weights it measured.

A committed number is only worth as much as our ability to say what produced it. Every result JSON carries
``metadata.git`` (the commit, and whether the tree differed from it) and ``metadata.code``: the sha256 of each
``minifer`` source module the run had imported and of each bundled checkpoint it read, taken when the result is saved.
:func:`stale_sources` compares such a record with the tree as it is now, so a result whose engine code or
weights changed since it was measured is named instead of silently standing (``tests/repo/test_claims.py``
reports them; ``make results`` measures them again).
"""

from __future__ import annotations

import hashlib
import json
import shlex
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "minifer"


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
    """``{path: sha256[:16]}`` of every ``minifer`` module imported so far and every bundled checkpoint it read.

    Taken at save time, the imported modules are the code the run executed (a benchmark imports what it
    measures), and the checkpoints are the bundled folders the loader was asked for
    (:func:`minifer.model_loader.bundled_used`): retraining the EAGLE head leaves a throughput result fresh."""
    files: dict[str, str] = {}
    for module in list(sys.modules.values()):
        f = getattr(module, "__file__", None)
        if not f:
            continue
        path = Path(f).resolve()
        if path.suffix == ".py" and path.is_relative_to(PACKAGE) and path.exists():
            files[path.relative_to(ROOT).as_posix()] = _sha(path)
    loader = sys.modules.get("minifer.model_loader")
    used = loader.bundled_used() if loader is not None else []
    for path in sorted(p for folder in used for p in folder.glob("*")):
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
