"""The machine a measurement runs on: its description (``environment``, stored beside every result), the threads
and paths the benchmarks use, the timing primitives, and its memory's copy bandwidth. Shared by the benchmarks
(``minifer.bench``) and the chapters' experiments (``minifer_course``), which import it from here.
"""

from __future__ import annotations

import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _times(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    _sync(device)
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        out.append(time.perf_counter() - t0)
    return out


def _device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def measure_copy_bandwidth(device: str | torch.device | None = None, mib: int | None = None,
                           repeats: int = 9) -> float:
    """Bytes/s of a large tensor copy (``dst.copy_(src)``), counting the read and the write: the STREAM
    "copy" convention, and the way literature.md's 4.3 TB/s on an H200 was measured. The tensor is far
    larger than the caches (128 MiB on a CPU, 2 GiB on a GPU) so the number is main memory's."""
    dev = _device(device)
    mib = mib or (2048 if dev.type == "cuda" else 128)
    n = mib * 2**20 // 4
    src = torch.ones(n, dtype=torch.float32, device=dev)
    dst = torch.empty_like(src)
    best = min(_times(lambda: dst.copy_(src), dev, repeats, warmup=2))
    return 2 * n * 4 / best


def cpuinfo_field(key: str, cpuinfo: str | None = None) -> str | None:
    """The first ``key`` line of ``/proc/cpuinfo`` (or of ``cpuinfo``); None where there is none (not Linux)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    return next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith(key)), None)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name = cpuinfo_field("model name") or platform.processor() or platform.machine()
    n = torch.get_num_threads()
    return f"{name} ({n} thread{'s' if n != 1 else ''})"


def default_threads() -> int:
    """Threads for CPU measurements: ``MINIFER_THREADS`` if set, else 1 on a machine of 2 cores or fewer,
    else torch's default.

    PyTorch's CPU ops split work over OpenMP threads that wait for each other at the end of every op. When
    another process holds one of the cores (a second notebook under ``pytest -n 2``, a browser), every op
    waits for the descheduled thread: on a shared 2-core machine we measured steps 5-10x slower with 2
    threads than with 1. One thread per process degrades gracefully instead."""
    env = os.environ.get("MINIFER_THREADS")
    if env:
        return max(1, int(env))
    return 1 if (os.cpu_count() or 1) <= 2 else torch.get_num_threads()


def environment() -> dict[str, Any]:
    """Hardware and software versions, stored beside every result so numbers can be compared later."""
    import minifer

    env: dict[str, Any] = {"python": sys.version.split()[0], "torch": torch.__version__, "minifer": minifer.__version__,
                           "platform": platform.platform(), "machine": platform.machine(),
                           "cpu": device_name(torch.device("cpu")), "cpu_count": os.cpu_count(),
                           "torch_threads": torch.get_num_threads(), "cuda": torch.cuda.is_available()}
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:  # pragma: no cover
        pass
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        env["cuda_version"] = torch.version.cuda
    return env


def default_results_path(name: str = "roofline.json") -> Path:
    """``runs/NAME`` at the repository root when minifer runs from a checkout (``runs/`` is git-ignored),
    else under the current directory."""
    root = Path(__file__).resolve().parents[2]
    base = root if (root / "pyproject.toml").is_file() else Path.cwd()
    return base / "runs" / name


def enable_triton_interpreter() -> tuple[bool, str]:
    """Switch Triton to its CPU interpreter when there is no CUDA GPU, then report whether Triton imports.

    ``TRITON_INTERPRET=1`` must be set before a kernel is defined (``minifer.kernels.triton_attention`` is
    imported), so call this first. Returns ``(available, message)``; on macOS (no Triton wheels) the
    message says why the kernel cells skip."""
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from minifer.kernels import HAS_TRITON, TRITON_ERROR

    if not HAS_TRITON:
        return False, f"skipped: {TRITON_ERROR}"
    mode = "native, on the GPU" if torch.cuda.is_available() else "Triton's CPU interpreter (TRITON_INTERPRET=1)"
    return True, f"Triton kernels run in {mode}"
