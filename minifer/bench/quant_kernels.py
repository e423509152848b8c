"""Fused dequantize-matmul kernels against bf16 ``torch.matmul`` on the GPU (chapter 05).

For each weight shape ``K x N`` (in x out features; "4096x14336" is a Llama-8B up-projection), number of
rows ``M`` and format, it times ``quant_matmul(x, W_q)`` and ``x @ W^T`` in bf16 and reports the time,
the speed-up, and the bandwidth each achieves (bytes of weights and activations read, output written,
over the time) beside the device's measured copy bandwidth.

How it times, and why:

- Each call is captured ``calls`` times in a CUDA graph and the graph is replayed between two CUDA
  events: a decode matmul takes microseconds, less than Python needs to launch it, so timing eager calls
  would measure the launcher (an engine's decode step runs as a CUDA graph too).
- The calls rotate over enough copies of the weights to overflow the L2 cache three times: an int4
  4096x14336 weight is 31 MB, which an H200's 60 MB L2 would otherwise serve from cache.
- The quantized and bf16 graphs are replayed alternately, ``rounds`` times, and the median is kept, so a
  clock or neighbour change hits both alike.
- The first call of every shape autotunes the kernel (``triton.autotune``) before anything is captured.
- First, the target case is timed at every split of K (``split_sweep``, in ``split_sweeps``): the
  launcher's rule (``choose_split``) and the autotuner pick one, and this shows what the others cost.

Targets on an H200 (stated in the result): int4 at M=1 on 4096x14336 at least 3x faster than bf16 (the
bytes bound is 2 / 0.53125 = 3.76x with groups of 128, about 3.9x counting nothing but the codes).

Measured on an H200 (``benchmarks/results/quant_kernels_h200.json``: the full sweep; ``..._decode.json``:
M = 1 and 16 after the gemv loop was software-pipelined). Copy bandwidth 4.2 TB/s; bf16 ``torch.matmul``
reads a 4096x14336 weight at 3.8 TB/s (31 us). Speed-up over bf16, 4096x14336:

    M      int8           int4            fp8
    1      1.33 (splitk)  1.80 (gemv)     1.48 (splitk)     int4 reads 1.7 TB/s: the 3x target is NOT met
    16     1.33 (splitk)  1.04 (splitk)   1.54 (splitk)
    64     0.95 (tiled)   0.63            0.87
    256    0.45           0.26            0.44              tiled dequantize-then-dot loses to cuBLAS

M = 1 and 16 from ``..._decode.json``, the best decode path of each; ``auto`` chose gemv at M = 1 in that run,
which was the better path for int4 only (int8 1.09x, fp8 1.12x with gemv). M = 64 and 256 from the full sweep.
Both files predate the int4 tensor-core kernel and today's ``auto``, and record no command line (results written
since do).

so the weight-only formats pay at decode (M <= 16) and cost at prefill; int4 decode reaches under half
of its bytes bound. Every case matched ``quant_linear_reference`` (relative error 1.6e-3 to 1.7e-3, the
rounding of a bf16 output).

    python -m minifer.bench.quant_kernels --out runs/quant_kernels.json
    python -m minifer.bench.quant_kernels --device cpu --smoke      # tiny shapes under the interpreter
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

SHAPES = ((4096, 4096), (4096, 14336), (14336, 4096))  # (K, N)
MS = (1, 16, 64, 256)
FORMATS = ("int8", "int4", "fp8")
SMOKE = dict(shapes=((256, 96),), ms=(1, 3, 17), group_size=64, rounds=2, calls=1)
SWEEPS = ((4096, 14336, 1, "int4"),)  # split_sweep: the target case
MAX_REL_ERR = 1e-2  # against the float32 reference, bf16 activations and output (the kernel tests' tolerance)
TARGETS = [{"format": "int4", "K": 4096, "N": 14336, "M": 1, "min_speedup": 3.0,
            "why": "decode is bandwidth-bound: int4 (g=128) reads 3.76x fewer weight bytes than bf16"}]


def _graph_timer(fns: Sequence[Callable[[], object]]) -> Callable[[], float]:
    """Capture ``fns`` (one call each) in a CUDA graph; return a function timing one replay, per call, in s."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream, as graph capture requires
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def once() -> float:
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / len(fns)

    once()
    return once


def _wall_timer(fns: Sequence[Callable[[], object]]) -> Callable[[], float]:
    """The CPU (interpreter) stand-in for ``_graph_timer``: wall time of the calls, per call."""
    for fn in fns:
        fn()

    def once() -> float:
        t0 = time.perf_counter()
        for fn in fns:
            fn()
        return (time.perf_counter() - t0) / len(fns)

    return once


def _copies(nbytes: int, device: torch.device, calls: int) -> int:
    """Weight copies needed for ``calls`` calls to read three L2 caches' worth of distinct bytes."""
    if device.type != "cuda":
        return 1
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 64 * 2**20)
    return max(1, min(calls, math.ceil(3 * l2 / nbytes)))


def _inputs(k: int, n: int, m: int, fmt: str, device: torch.device, group_size: int, seed: int):
    """A random bf16 weight ``[n, k]`` (unit-scale outputs), its quantized form, activations ``[m, k]`` and an
    output buffer."""
    from minifer.quantization import quantize

    gen = torch.Generator(device=device).manual_seed(seed)
    w = (torch.randn(n, k, device=device, generator=gen) / math.sqrt(k)).to(torch.bfloat16)
    x = torch.randn(m, k, device=device, generator=gen).to(torch.bfloat16)
    return w, quantize(w, fmt, group_size=group_size), x, torch.empty(m, n, device=device, dtype=torch.bfloat16)


def _rotation(w: torch.Tensor, qw, fmt: str, group_size: int, calls: int) -> tuple[list, list, int]:
    """Copies of both weights for ``calls`` calls to rotate through (``_copies``): ``(quantized, bf16, n)``."""
    from minifer.quantization import quantize

    n_copies = _copies(min(qw.nbytes(), w.numel() * 2), w.device, calls)
    return ([qw] + [quantize(w, fmt, group_size=group_size) for _ in range(n_copies - 1)],
            [w] + [w.clone() for _ in range(n_copies - 1)], n_copies)


def _plan(path: str, m: int, n: int, k: int, fmt: str, group_size: int, device: torch.device):
    """``quant_matmul.plan`` of the call ``quant_matmul`` makes on ``path`` here (its tuner and configs)."""
    from minifer.kernels import quant_matmul as qm

    return qm.plan(path, m, n, k, qm._FMT[fmt], group_size if fmt == "int4" else 0, qm._one_dot(device),
                   qm._turing(device))


def bench_case(k: int, n: int, m: int, fmt: str, device: torch.device, *, group_size: int = 128,
               rounds: int = 15, calls: int = 20, path: str = "auto", seed: int = 0) -> dict[str, Any]:
    """One (shape, M, format): correctness against the reference, then interleaved timings."""
    from minifer.kernels import quant_matmul as qm
    from minifer.quantization import quant_linear_reference

    w, qw, x, out = _inputs(k, n, m, fmt, device, group_size, seed)
    y = qm.quant_matmul(x, qw, path=path, out=out).float()  # autotunes here, before any capture
    ref = quant_linear_reference(x.float(), qw)
    rel_err = float((y - ref).norm() / ref.norm())

    chosen = qm.auto_path(m, qw) if path == "auto" else path
    launch = _plan(chosen, m, n, k, fmt, group_size, device)
    config, tuning = _best_config(launch), _config_timings(launch)
    qws, ws, n_copies = _rotation(w, qw, fmt, group_size, calls)
    outs = [torch.empty_like(out) for _ in range(2)]
    timer = _graph_timer if device.type == "cuda" else _wall_timer
    t_quant = timer([lambda i=i: qm.quant_matmul(x, qws[i % n_copies], path=path, out=outs[0]) for i in range(calls)])
    t_bf16 = timer([lambda i=i: torch.matmul(x, ws[i % n_copies].T, out=outs[1]) for i in range(calls)])
    tq, tb = [], []
    for _ in range(rounds):
        tq.append(t_quant())
        tb.append(t_bf16())
    tq_med, tb_med = statistics.median(tq), statistics.median(tb)
    act_bytes = (m * k + m * n) * 2
    return {"K": k, "N": n, "M": m, "format": fmt, "group_size": group_size if fmt == "int4" else None,
            "path": chosen, "config": config,
            "autotune_ms": tuning, "rel_err": rel_err, "us_quant": tq_med * 1e6, "us_bf16": tb_med * 1e6,
            "speedup": tb_med / tq_med, "bytes_bound": (w.numel() * 2 + act_bytes) / (qw.nbytes() + act_bytes),
            "GBps_quant": (qw.nbytes() + act_bytes) / tq_med / 1e9,
            "GBps_bf16": (w.numel() * 2 + act_bytes) / tb_med / 1e9,
            "us_quant_rounds": [t * 1e6 for t in tq], "us_bf16_rounds": [t * 1e6 for t in tb],
            "weight_copies": n_copies, "calls_per_graph": calls}


def split_sweep(k: int, n: int, m: int, fmt: str, device: torch.device, *, group_size: int = 128,
                rounds: int = 15, calls: int = 20, path: str = "auto", seed: int = 0) -> dict[str, Any]:
    """Every split of K for one case, timed in interleaved rounds against bf16 with the autotuned config:
    the measurement behind ``choose_split``. ``chosen`` is the split the launcher uses with that config."""
    from minifer.kernels import quant_matmul as qm

    w, qw, x, out = _inputs(k, n, m, fmt, device, group_size, seed)
    qm.quant_matmul(x, qw, path=path, out=out)  # autotunes with the default split rule
    chosen_path = qm.auto_path(m, qw) if path == "auto" else path
    launch = _plan(chosen_path, m, n, k, fmt, group_size, device)
    best = getattr(launch.kernel, "best_config", None) or launch.configs[0]
    meta = best.kwargs
    tiles = launch.tiles
    sms, per_sm = qm._num_sms(device), int(meta["SPLIT_PER_SM"])
    steps = launch.k_steps(meta)
    splits = list(range(1, min(qm.MAX_SPLIT, steps) + 1))
    qws, ws, n_copies = _rotation(w, qw, fmt, group_size, calls)
    timer = _graph_timer if device.type == "cuda" else _wall_timer
    timers = {s: timer([lambda i=i, s=s: qm.quant_matmul(x, qws[i % n_copies], path=chosen_path, split_k=s, out=out)
                        for i in range(calls)]) for s in splits}
    timers["bf16"] = timer([lambda i=i: torch.matmul(x, ws[i % n_copies].T, out=out) for i in range(calls)])
    times: dict[Any, list[float]] = {key: [] for key in timers}
    for _ in range(rounds):
        for key, t in timers.items():
            times[key].append(t())
    bf16 = statistics.median(times.pop("bf16"))
    return {"K": k, "N": n, "M": m, "format": fmt, "path": chosen_path, "config": str(best), "sms": sms,
            "tiles": tiles(meta), "k_steps": steps, "chosen": qm.choose_split(tiles(meta), steps, sms, per_sm),
            "us_bf16": bf16 * 1e6,
            "rows": [{"split": s, "us": statistics.median(times[s]) * 1e6,
                      "speedup": bf16 / statistics.median(times[s])} for s in splits]}


def _best_config(launch) -> str | None:
    """The config the autotuner picked for the call just made with ``launch`` (a ``quant_matmul.Plan``)."""
    best = getattr(launch.kernel, "best_config", None)
    return None if best is None else str(best)


def _config_timings(launch) -> dict[str, float] | None:
    """The autotuner's time (ms) of every config it tried for the call just made, if it tuned."""
    timings = getattr(launch.kernel, "configs_timings", None)
    if not timings:
        return None
    return {str(c): float(t[0] if isinstance(t, (list, tuple)) else t) for c, t in timings.items()}


def device_info(device: torch.device) -> dict[str, Any]:
    from minifer.bench.machine import environment
    from minifer.bench.serving import git_commit

    info: dict[str, Any] = {**environment(), "git": git_commit(), "device": str(device)}
    try:
        import triton

        from minifer.kernels import quant_matmul as qm

        info["triton"] = triton.__version__
        info["int4_mma_one_dot"] = qm._one_dot(device)  # which form of the int4 tensor-core kernel runs here
    except ImportError:  # pragma: no cover
        info["triton"] = None
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info.update(gpu=torch.cuda.get_device_name(device), capability=list(torch.cuda.get_device_capability(device)),
                    sms=p.multi_processor_count, gpu_memory_bytes=p.total_memory,
                    l2_bytes=getattr(p, "L2_cache_size", None))
    else:
        info["triton_interpreter"] = os.environ.get("TRITON_INTERPRET") == "1"
    return info


def run(device: str = "cuda", shapes: Sequence[tuple[int, int]] = SHAPES, ms: Sequence[int] = MS,
        formats: Sequence[str] = FORMATS, *, group_size: int = 128, rounds: int = 15, calls: int = 20,
        extra_paths: bool = True, progress: bool = False,
        sweeps: Sequence[tuple[int, int, int, str]] = SWEEPS,
        checkpoint: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Every (shape, M, format) case, the targets' cases first; returns a JSON-able dict (see the module
    docstring). ``checkpoint`` is called with the result so far after every case, so that a run stopped
    part-way (a time limit on a lent GPU) still leaves what it measured.

    ``extra_paths``: also time the decode kernel that ``auto`` does not pick for M <= 16 (gemv vs
    splitk), the measurement behind ``GEMV_MAX_M``. ``sweeps``: ``(K, N, M, format)`` cases whose every
    split of K is timed (``split_sweep``), run first (those among ``shapes``, ``ms`` and ``formats``)."""
    from minifer.bench.machine import measure_copy_bandwidth

    dev = torch.device(device)
    if dev.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("the kernels run on the CPU only under TRITON_INTERPRET=1, set before triton is imported")
    copy_bw = measure_copy_bandwidth(dev, mib=2048 if dev.type == "cuda" else 16, repeats=5)
    sweep_rows: list[dict[str, Any]] = []
    rows: list[dict[str, Any]] = []
    env = device_info(dev)

    def result() -> dict[str, Any]:
        return {"benchmark": "quant_kernels", "environment": env, "copy_bandwidth_Bps": copy_bw,
                "settings": {"group_size": group_size, "rounds": rounds, "calls_per_graph": calls,
                             "timer": "CUDA graph replay, CUDA events" if dev.type == "cuda" else "wall clock"},
                "rows": rows, "targets": check_targets(rows), "split_sweeps": sweep_rows}

    for k, n, m, fmt in [c for c in sweeps if (c[0], c[1]) in shapes and c[2] in ms and c[3] in formats]:
        t0 = time.perf_counter()
        sweep = split_sweep(k, n, m, fmt, dev, group_size=group_size, rounds=rounds, calls=calls)
        sweep_rows.append(sweep)
        if checkpoint:
            checkpoint(result())
        if progress:
            best = max(sweep["rows"], key=lambda r: r["speedup"])
            curve = " ".join(f"{r['split']}:x{r['speedup']:.2f}" for r in sweep["rows"])
            print(f"split sweep K={k} N={n} M={m} {fmt}: chosen {sweep['chosen']} ({sweep['config']}), "
                  f"fastest {best['split']} at x{best['speedup']:.2f}; {curve} [{time.perf_counter() - t0:.0f}s]",
                  flush=True)
    targets = {(t["K"], t["N"], t["M"], t["format"]) for t in TARGETS}
    cases = [(k, n, m, fmt) for k, n in shapes for fmt in formats for m in ms]
    for k, n, m, fmt in sorted(cases, key=lambda c: c not in targets):  # a stable sort: targets first
        paths = ["auto"]
        while paths:
            path = paths.pop(0)
            t0 = time.perf_counter()
            row = bench_case(k, n, m, fmt, dev, group_size=group_size, rounds=rounds, calls=calls, path=path)
            row["of_copy_bw_quant"] = row["GBps_quant"] * 1e9 / copy_bw
            row["of_copy_bw_bf16"] = row["GBps_bf16"] * 1e9 / copy_bw
            row["auto"] = path == "auto"
            rows.append(row)
            if checkpoint:
                checkpoint(result())
            if path == "auto" and extra_paths and m <= 16 and row["path"] in ("gemv", "splitk"):
                paths.append("splitk" if row["path"] == "gemv" else "gemv")  # the other decode kernel
            if progress:
                print(f"K={k:>5} N={n:>5} M={m:>3} {fmt:<4} {row['path']:<6} quant {row['us_quant']:8.1f} us  "
                      f"bf16 {row['us_bf16']:8.1f} us  x{row['speedup']:.2f} (bound x{row['bytes_bound']:.2f})  "
                      f"{row['GBps_quant']:7.0f} GB/s  err {row['rel_err']:.1e}  [{time.perf_counter() - t0:.0f}s]",
                      flush=True)
    return result()


def check_targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each target against its row: met when the speed-up reaches it *and* the kernel's output matched the
    reference (``rel_err`` below ``MAX_REL_ERR``): a fast wrong answer meets nothing."""
    out = []
    for t in TARGETS:
        hit = [r for r in rows if r["auto"] and all(r[key] == t[key] for key in ("format", "K", "N", "M"))]
        speedup, err = (hit[0]["speedup"], hit[0]["rel_err"]) if hit else (None, None)
        met = None if speedup is None else speedup >= t["min_speedup"] and err < MAX_REL_ERR
        out.append({**t, "measured_speedup": speedup, "rel_err": err, "met": met})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m minifer.bench.quant_kernels", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("runs/quant_kernels.json"))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, 2 rounds: checks the pipeline end to end")
    ap.add_argument("--formats", nargs="+", default=list(FORMATS))
    ap.add_argument("--ms", nargs="+", type=int, default=list(MS))
    ap.add_argument("--no-extra-paths", action="store_true")
    ap.add_argument("--no-split-sweep", action="store_true", help="skip timing every split of the target case")
    args = ap.parse_args(argv)
    if args.device == "cpu":
        from minifer.bench.machine import enable_triton_interpreter

        ok, msg = enable_triton_interpreter()
        if not ok:
            raise SystemExit(msg)
    torch.set_num_threads(max(1, min(torch.get_num_threads(), 4)))
    kw = dict(SMOKE, sweeps=((256, 96, 1, "int4"),)) if args.smoke else dict(ms=args.ms)
    if args.no_split_sweep:
        kw["sweeps"] = ()
    args.out.parent.mkdir(parents=True, exist_ok=True)

    command = shlex.join(["python", "-m", "minifer.bench.quant_kernels", *(sys.argv[1:] if argv is None else argv)])
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")

    def save(partial: dict[str, Any]) -> None:  # every result says how it was made and when
        args.out.write_text(json.dumps({"command": command, "timestamp": started, **partial}, indent=2))

    result = run(args.device, formats=args.formats, extra_paths=not args.no_extra_paths, progress=True,
                 checkpoint=save, **kw)
    save(result)
    for t in result["targets"]:
        print(f"target {t['format']} M={t['M']} {t['K']}x{t['N']}: >= {t['min_speedup']}x, measured "
              f"{t['measured_speedup']}, met: {t['met']}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
