"""Two bounds the CPU engine is held to beside the CTranslate2 comparison (issue 28; the "bounds" section of
``python -m minifer_course.experiments.cpu_targets``, which runs ``minifer.bench.cpu_peer``).

1. **A real-shape model's batch-1 decode against the copy bandwidth.** A model of a published size (Qwen3-0.6B's
   shape, dummy float32 weights: 2.4 GB) decodes one token by reading every weight once, so its step cannot beat
   ``bytes / bandwidth``. The bandwidth is ``measure_copy_bandwidth`` (a 128 MiB copy, read plus write, the STREAM
   convention), measured in the same rounds as the steps: on a shared machine the bandwidth moves with the load,
   and only a bound taken beside the step is fair to it. ``of_bound`` is that bound over the step's median time.
   Each layout of the weights (``LAYOUTS``) is measured on the same model, re-stored in place between the phases
   (two copies of 2.4 GB would not fit beside the other work of a small machine).
2. **The continuous-batching step overhead on a small model.** On a 2-layer, 128-wide Qwen3-shaped model (a
   forward of about a millisecond) the engine's own per-step work (scheduling, metadata, sampling, output objects)
   is a large share of a step. ``throughput_benchmark`` serves the headline workload with the static server and
   the continuous engine in interleaved rounds; the overhead is the continuous step's milliseconds over the static
   step's, and ``fraction_of_bound`` the continuous/static throughput ratio over the scheduler-step bound (what
   batching alone could gain if both steps cost the same).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from minifer.bench.machine import measure_copy_bandwidth

REAL_SHAPE = "Qwen/Qwen3-0.6B"
# the small model of the issue's step-overhead measurement: Qwen3's layer (per-head q/k norms), 2 layers, 128 wide
SMALL_QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 128,
               "intermediate_size": 384, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
               "head_dim": 32, "vocab_size": 2048, "max_position_embeddings": 1024, "rms_norm_eps": 1e-6,
               "rope_theta": 1000000, "tie_word_embeddings": True, "hidden_act": "silu", "attention_bias": False,
               "bos_token_id": 0, "eos_token_id": 0, "torch_dtype": "float32"}
LAYOUTS: dict[str, dict[str, Any]] = {"row-major (nn.Linear's)": {}, "column_major_weights": {"column_major_weights": True}}


def _decode_bytes(model: torch.nn.Module, context: int) -> int:
    """Bytes one batch-1 decode step must read or write: every distinct linear weight once (a tied lm_head and
    embedding once), the KV cache over ``context`` tokens and the new token's keys and values."""
    weights = {id(m.weight): m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)}
    w = sum(t.numel() * t.element_size() for t in weights.values())
    cfg = model.config
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * model.lm_head.weight.element_size()
    return w + kv * (context + 1)


def _decode_steps(llm, prompt_len: int, steps: int) -> list[float]:
    """Wall seconds of each of ``steps`` batch-1 decode steps of one greedy request (its prefill not counted)."""
    from minifer.bench.serving import greedy_params
    from minifer.core.sched.scheduler import SchedulerConfig
    from minifer.engine.llm_engine import CacheConfig, EngineConfig, LLMEngine

    config = EngineConfig(CacheConfig(num_kv_blocks=16), SchedulerConfig(1, 2048, True),
                          max_model_len=llm.max_model_len)
    engine = LLMEngine(llm.model, None, llm.make_sequence, config)
    engine.add_request("d", {"prompt_token_ids": list(range(1, prompt_len + 1))}, greedy_params(steps + 1))
    engine.step()  # the prefill
    out = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        out.append(time.perf_counter() - t0)
    return out


def real_shape_decode(rounds: int = 5, prompt_len: int = 128, steps: int = 3, name: str = REAL_SHAPE,
                      log: Callable[[str], None] = print) -> dict[str, Any]:
    """Batch-1 decode of ``name``'s shape (dummy float32 weights) against the copy bandwidth measured in the same
    rounds, for each weight layout of ``LAYOUTS``: median step, median bandwidth, the bound and the share of it."""
    from minifer import LLM
    from minifer.compilation.weight_layout import column_major_linears

    torch.set_num_threads(1)
    llm = LLM(name, load_format="dummy", dtype="float32", device="cpu", num_kv_blocks=16)
    moved = _decode_bytes(llm.model, prompt_len + steps // 2)
    out: dict[str, Any] = {"model": f"{name} shape, dummy float32 weights", "prompt_len": prompt_len,
                           "bytes_per_step": moved, "threads": 1, "layouts": {}}
    for layout, config in LAYOUTS.items():
        if config.get("column_major_weights"):
            column_major_linears(llm.model)
        _decode_steps(llm, prompt_len, 1)  # warm: first touches of the cache blocks
        step_s, bw = [], []
        for _ in range(rounds):
            step_s.append(statistics.median(_decode_steps(llm, prompt_len, steps)))
            bw.append(measure_copy_bandwidth("cpu", repeats=3))
        step, bandwidth = statistics.median(step_s), statistics.median(bw)
        out["layouts"][layout] = {"step_ms": 1e3 * step, "step_ms_rounds": [1e3 * s for s in step_s],
                                  "copy_bandwidth_gb_s": bandwidth / 1e9, "bound_ms": 1e3 * moved / bandwidth,
                                  "of_bound": moved / bandwidth / step,
                                  "of_bound_rounds": [moved / b / s for s, b in zip(step_s, bw)]}
        log(f"real shape, {layout}: {1e3 * step:.0f} ms per token, {out['layouts'][layout]['of_bound']:.0%} of the "
            f"copy-bandwidth bound ({bandwidth / 1e9:.1f} GB/s)")
    del llm
    return out


def small_model_dir(root: str | Path) -> Path:
    """A folder holding ``SMALL_QWEN3``'s config: ``LLM(folder, load_format="dummy")`` gives it random weights."""
    folder = Path(root) / "small-qwen3"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(SMALL_QWEN3))
    return folder


def step_overhead(num_requests: int = 256, slots: int = 16, repeats: int = 3, log: Callable[[str], None] = print,
                  **llm_kw: Any) -> dict[str, Any]:
    """Static vs continuous batching on the small model (every request at t = 0, 1 thread), in interleaved rounds:
    each engine's ms per step, the continuous step's overhead over the static one, and the continuous/static
    throughput ratio against its bound; the continuous engine as it is and with each of ``STEP_CUTS`` turned off
    alone (its gain: ``levers_ms_saved``)."""
    from minifer import LLM
    from minifer.bench.serving import run_static, step_bound
    from minifer.bench.workloads import make_workload

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as root:
        llm = LLM(str(small_model_dir(root)), load_format="dummy", dtype="float32", device="cpu",
                  max_num_seqs=slots, **llm_kw)
    workload = make_workload(num_requests, "uniform:8:32", "exp:64:4:256", seed=0, vocab_size=SMALL_QWEN3["vocab_size"],
                             max_model_len=llm.max_model_len, bos_token_id=0)
    runs = {"static": lambda: run_static(llm, workload, max_num_seqs=slots, progress=False),
            "continuous": lambda: _continuous(llm, workload, slots, {}),
            **{f"continuous-without-{cut}": (lambda cut=cut: _continuous(llm, workload, slots, {cut: False}))
               for cut in STEP_CUTS}}
    for run in runs.values():  # warm-up
        run()
    per: dict[str, list] = {name: [] for name in runs}
    for k in range(repeats):
        for name in (list(runs) if k % 2 == 0 else list(runs)[::-1]):
            res = runs[name]()
            per[name].append((res.duration, res.steps))
            log(f"round {k + 1}/{repeats} small model, {name}: {1e3 * res.seconds_per_step:.2f} ms/step, "
                f"{res.steps} steps")
    bound = step_bound(workload.output_lens, slots)["ratio"]
    ms = {name: [1e3 * d / n for d, n in rs] for name, rs in per.items()}
    out = {"model": {k: SMALL_QWEN3[k] for k in ("hidden_size", "num_hidden_layers", "intermediate_size")},
           "llm_kw": {k: str(v) for k, v in llm_kw.items()}, "num_requests": num_requests, "slots": slots,
           "threads": 1, "rounds": repeats, "step_bound": bound,
           "static_ms_per_step": statistics.median(ms["static"])}
    for name in ("continuous", *(f"continuous-without-{cut}" for cut in STEP_CUTS)):
        speed = [ds / dc for (dc, _), (ds, _) in zip(per[name], per["static"])]  # same tokens: time ratio
        over = [c - st for c, st in zip(ms[name], ms["static"])]
        out[name] = {"ms_per_step": statistics.median(ms[name]), "overhead_ms": statistics.median(over),
                     "overhead_ms_rounds": over, "over_static": statistics.median(speed),
                     "fraction_of_bound": statistics.median(speed) / bound}
    out["levers_ms_saved"] = {cut: statistics.median([g - f for g, f in zip(ms[f"continuous-without-{cut}"],
                                                                          ms["continuous"])]) for cut in STEP_CUTS}
    return out


# the engine's step-overhead cuts, each a ``ModelRunner`` switch (on by default) that the benchmark turns off alone
STEP_CUTS = ("fast_greedy",)


def _continuous(llm, workload, slots: int, switches: dict[str, bool]):
    from minifer.bench.serving import run_continuous
    from minifer.worker.model_runner import ModelRunner

    saved = {name: getattr(ModelRunner, name) for name in switches}
    for name, value in switches.items():
        setattr(ModelRunner, name, value)
    try:
        return run_continuous(llm, workload, max_num_seqs=slots, progress=False)
    finally:
        for name, value in saved.items():
            setattr(ModelRunner, name, value)
