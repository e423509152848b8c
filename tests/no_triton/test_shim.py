"""``tools/no_triton``'s shim hides the installed Triton, and the course's one detection hears it.

A Python started with the shim's folder on ``PYTHONPATH`` cannot import ``triton`` (``find_spec`` says None, as torch
asks), ``minifer.kernels.triton_available()`` says unavailable and why, and the course's stand-ins take over: the
grader's ``triton_modules`` hands out a ``@triton.jit`` that defines a kernel, and a launch of it is blocked, not
failed. The same Python without the shim imports Triton, so the shim hides a real install (or this test skips).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHIM = ROOT / "tools" / "no_triton"

PROBE = r"""
import importlib.util, json
out = {"find_spec": importlib.util.find_spec("triton") is None}
try:
    import triton
    out["import"] = "imported"
except ImportError as e:
    out["import"] = type(e).__name__
from minifer.kernels import HAS_TRITON, triton_available
out["available"], out["reason"] = triton_available()
out["HAS_TRITON"] = HAS_TRITON
from minifer_course.grading.base import Blocked
from minifer_course.grading.quant import triton_modules
triton, tl, out["status"] = triton_modules()
kernel = triton.jit(lambda x: x)
try:
    kernel[(1,)](0)
except Blocked as e:
    out["launch"] = "Blocked: " + str(e)
print(json.dumps(out))
"""


def probe(shim: bool) -> dict:
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != SHIM]
    path = [str(SHIM)] * shim + [str(ROOT)] + inherited
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_without_the_shim_triton_is_there_to_hide():
    pytest.importorskip("triton", reason="Triton is not installed here: the shim has nothing to hide")
    assert probe(shim=False)["available"] is True


def test_under_the_shim_triton_does_not_import_and_the_detection_says_why():
    out = probe(shim=True)
    assert out["import"] == "ModuleNotFoundError" and out["find_spec"]
    assert out["available"] is False and out["HAS_TRITON"] is False
    assert out["reason"].startswith("Triton is not installed (No module named 'triton')")
    assert out["status"].startswith("Triton kernel checks skip: Triton is not installed")
    assert out["launch"].startswith("Blocked: Triton is not installed")
