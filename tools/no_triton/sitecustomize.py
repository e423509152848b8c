"""A Python without Triton, for ``make test``'s no-Triton step: ``PYTHONPATH=tools/no_triton python ...``.

Python imports ``sitecustomize`` at start-up from the first folder on ``sys.path`` that has one, so with this folder
on ``PYTHONPATH`` every process (pytest, each Jupyter kernel it starts, the fresh process that checks a saved piece)
wraps each finder of ``sys.meta_path`` so that none finds ``triton`` (nor ``triton.*``): ``import triton`` raises
``ModuleNotFoundError: No module named 'triton'`` and ``importlib.util.find_spec("triton")`` is None (torch asks
that), exactly as on macOS or Windows, where Triton publishes no wheels. The installed Triton stays on disk.

What this proves: the course on *Linux* without Triton (each detection goes through
``minifer.kernels.triton_available``, which this shim answers). It does not prove macOS or Windows: their torch
builds, paths, multiprocessing start method and missing POSIX tools are not simulated.

A ``sitecustomize`` this one shadows (a distribution's own) is still run, after the finder is installed.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

BLOCKED = "triton"
HERE = os.path.dirname(os.path.abspath(__file__))


def hidden(name: str) -> bool:
    return name == BLOCKED or name.startswith(BLOCKED + ".")


class NoTriton(importlib.abc.MetaPathFinder):
    """One finder of ``sys.meta_path``, blind to Triton: it finds everything else as before."""

    def __init__(self, finder) -> None:
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        if hidden(name) or not hasattr(self.finder, "find_spec"):
            return None
        return self.finder.find_spec(name, path, target)

    def invalidate_caches(self) -> None:
        if hasattr(self.finder, "invalidate_caches"):
            self.finder.invalidate_caches()

    def __getattr__(self, attr):  # anything else a finder offers (an editable install's finder has extras)
        return getattr(self.finder, attr)


def _run_shadowed() -> None:
    """Run the ``sitecustomize`` that this one hides (the next on ``sys.path``), if there is one."""
    for folder in sys.path:
        if not folder or os.path.abspath(folder) == HERE:
            continue
        candidate = os.path.join(folder, "sitecustomize.py")
        if os.path.isfile(candidate):
            spec = importlib.util.spec_from_file_location("_shadowed_sitecustomize", candidate)
            spec.loader.exec_module(importlib.util.module_from_spec(spec))
            return


if not any(isinstance(f, NoTriton) for f in sys.meta_path):
    sys.meta_path[:] = [NoTriton(f) for f in sys.meta_path]
    for loaded in [m for m in sys.modules if hidden(m)]:
        del sys.modules[loaded]  # imported before start-up finished (a .pth file): forget it
_run_shadowed()
