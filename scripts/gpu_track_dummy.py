#!/usr/bin/env python3
"""The GPU track's code path without a GPU: the chapters' course functions on the Qwen3 pair's shapes, dummy weights.

    python3 scripts/gpu_track_dummy.py                 # 2 layers each: what CI runs (tests/repo/test_gpu_track_dummy.py)
    python3 scripts/gpu_track_dummy.py --all-layers    # the full-size models, 28 layers each (manual; minutes, ~10 GB)
    python3 scripts/gpu_track_dummy.py --chapters 04 05 --max-tokens 8

The GPU track (``MINIFER_TRACK=gpu``) runs Qwen3-1.7B with Qwen3-0.6B as draft in 16 bits; nothing ran it short of
a GPU. Here each chapter's GPU-track calls run on the CPU with ``load_format="dummy"`` (random weights) at the real
models' width: their shipped configs (``minifer/assets/configs``), 16 query / 8 KV heads of 128, 2048 and 1024 wide,
a 151,936-token vocabulary, tied embeddings, in float16 (``dtype="auto"`` on a T4, sm_75), with
``num_hidden_layers`` overridden to 2 unless ``--all-layers``. The bundled TinyStories tokenizer stands in for
Qwen's (no download; its ids lie inside Qwen's vocabulary, and ids beyond its own decode to nothing).

What it does not check: anything CUDA does (Triton kernels, CUDA graphs, the KV budget from free GPU memory, which
``tests/repo/test_install_gpu_track.py`` checks by arithmetic), the parity with transformers (it needs the real
weights), and the numbers (random weights make every acceptance rate and quality figure meaningless). What it
does: every chapter's engine configuration at Qwen3's shapes and dtype, end to end through the course's functions.

The chapters share one loaded target where the chapter's own cells would load the same weights again (only the
KV cache differs), so a 2-layer run stays within a couple of minutes on two cores.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
GPU_DTYPE = "float16"  # dtype="auto" on a T4 (sm_75), the GPU the track is planned for
PROMPTS = ["Once upon a time", "The little dog"]


def dummy_checkpoint(name: str, folder: Path, layers: int | None) -> Path:
    """A folder ``LLM(..., load_format="dummy")`` builds ``name`` from: its shipped config.json (``layers`` decoder
    layers, all of them with None) and the bundled tokenizer's files."""
    from minifer.model_loader import BUNDLED_MODELS, SHIPPED_CONFIGS

    cfg = json.loads(SHIPPED_CONFIGS[name].read_text())
    if layers is not None:
        cfg["num_hidden_layers"] = cfg["max_window_layers"] = layers
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    tokenizer = BUNDLED_MODELS["tinystories-target"]
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / f, folder / f)
    return folder


def dummy_pair(folder: Path, layers: int | None, chapter: str | None = None) -> Any:
    """The GPU pair (``common.GPU_PAIR``) as dummy checkpoints, on the CPU; ``load`` adds the GPU track's dtype and
    ``load_format="dummy"``, and shares the first plain target's weights with later plain loads."""
    from minifer_course.common import GPU_PAIR, ModelPair

    @dataclass(frozen=True)
    class DummyPair(ModelPair):
        shared: dict = None  # type: ignore[assignment]

        def load(self, which: str = "target", **kwargs: Any) -> Any:
            kwargs.setdefault("load_format", "dummy")
            kwargs.setdefault("dtype", GPU_DTYPE)
            plain = which == "target" and kwargs.get("quantization") is None
            if plain and "target" in self.shared:
                kwargs.setdefault("share_weights_with", self.shared["target"])
            llm = super().load(which, **kwargs)
            if plain and kwargs.get("speculative_config") is None:
                self.shared.setdefault("target", llm)
            return llm

    target = dummy_checkpoint(GPU_PAIR[0], folder / "target", layers)
    draft = dummy_checkpoint(GPU_PAIR[1], folder / "draft", layers)
    return DummyPair(str(target), str(draft), "cpu", "the GPU track's models, dummy weights", chapter, {})


def _greedy(n: int, **kw: Any) -> Any:
    from minifer import SamplingParams

    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


def _tokens(llm: Any, prompts: list[Any], n: int) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, _greedy(n), use_tqdm=False)]


def chapter_00(pair: Any, n: int) -> dict[str, Any]:
    """The model and generation: the summary, greedy tokens with their logprobs, the next-token logits."""
    from minifer_course.ch00_generation import logprob_table, model_summary, next_token_logits

    llm = pair.load("target")
    out = llm.generate(PROMPTS[:1], _greedy(n, logprobs=3), use_tqdm=False)[0].outputs[0]
    logprob_table(out, steps=n)
    logits = next_token_logits(llm, PROMPTS[0])
    summary = model_summary(llm)
    return {"layers": summary["layers"], "hidden_size": summary["hidden_size"],
            "params_agree": summary["params_counted"] == summary["params_from_config"],
            "tokens": len(out.token_ids), "vocab": int(logits.shape[-1]), "dtype": str(llm.dtype)}


def chapter_01(pair: Any, n: int) -> dict[str, Any]:
    """Prefill vs decode: the decode step against the time its weight reads take."""
    from minifer_course.ch01_diagnose import decode_vs_weight_reads

    llm = pair.load("target")
    run = decode_vs_weight_reads(llm.model, context=16, rounds=1)
    return {"step_seconds": run["step_seconds"] > 0, "floor_seconds": run["floor_seconds"] > 0}


def chapter_02(pair: Any, n: int) -> dict[str, Any]:
    """The paged KV cache: a continuous-batching engine with 16-token blocks."""
    llm = pair.load("target", max_num_seqs=4, block_size=16, num_kv_blocks=32)
    tokens = _tokens(llm, PROMPTS, n)
    return {"tokens": sum(map(len, tokens)), "kv_blocks": llm.engine.kv_cache_manager.num_blocks}


def chapter_03(pair: Any, n: int) -> dict[str, Any]:
    """Continuous batching: the 'tight' engine, whose cache is too small for every request at once, preempts."""
    tight = pair.load("target", max_num_seqs=4, num_kv_blocks=3)
    prompts = PROMPTS + ["Tom and Sue went", "One day, a bird"]
    tokens = _tokens(tight, prompts, 16 + n)
    return {"tokens": sum(map(len, tokens)), "preemptions": tight.stats()["num_preemptions"]}


def chapter_04(pair: Any, n: int) -> dict[str, Any]:
    """Speculative decoding: draft model (fixed and adaptive k) and n-gram engines over one copy of the weights.
    The draft is a dummy model handed over as a module (a name would load weights from disk)."""
    from minifer_course.ch04_speculative import speculative_step

    kv = {"max_num_seqs": 4, "num_kv_blocks": 32, "enable_prefix_caching": False}
    llm = pair.load("target", **kv)
    draft = pair.load("draft", batching="static").model
    draft_cfg = {"method": "draft_model", "model": draft, "num_speculative_tokens": 4}
    fixed = pair.load("target", **kv, speculative_config=draft_cfg, share_weights_with=llm)
    step = speculative_step(fixed, PROMPTS[0], k=4)
    adaptive = pair.load("target", **kv, speculative_config={**draft_cfg, "adaptive": True}, share_weights_with=fixed)
    ngram = pair.load("target", **kv, share_weights_with=llm, speculative_config={
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1})
    engines = {"plain": llm, "draft": fixed, "adaptive": adaptive, "ngram": ngram}
    tokens = {name: _tokens(e, PROMPTS[:1], n) for name, e in engines.items()}
    return {"step": len(step["emitted"]) >= 1, "same_tokens": {k: v == tokens["plain"] for k, v in tokens.items()},
            "proposed": fixed.stats().get("spec_num_proposed")}


def chapter_05(pair: Any, n: int) -> dict[str, Any]:
    """Quantization: int8 and int4 weights, an int4 checkpoint saved and reloaded, the KV-cache formats."""
    from minifer import LLM
    from minifer.model_loader.quantized import save_quantized
    from minifer_course.ch05_quantization import kv_cache_runs, roundtrip_errors

    llm = pair.load("target", max_num_seqs=4, num_kv_blocks=32)
    roundtrip_errors(llm.model.model.layers[0].mlp.gate_up_proj.weight, group_sizes=(128,))
    q8 = pair.load("target", quantization="int8", max_num_seqs=4, num_kv_blocks=32)
    q4 = pair.load("target", quantization="int4", max_num_seqs=4, num_kv_blocks=32)
    out = {"int8": _tokens(q8, PROMPTS[:1], n), "int4": _tokens(q4, PROMPTS[:1], n)}
    with tempfile.TemporaryDirectory() as tmp:
        saved = save_quantized(q4, Path(tmp) / "target-int4")
        reloaded = LLM(saved, device=pair.device, dtype=GPU_DTYPE, max_num_seqs=4, num_kv_blocks=32)
        out["int4 reloaded"] = _tokens(reloaded, PROMPTS[:1], n)
    rows = kv_cache_runs(pair, ("auto", "int8", "fp8"), PROMPTS[:1], max_tokens=n, max_num_seqs=4,
                         enable_prefix_caching=False, kv_cache_memory=8 * 2**20)
    return {"reload_same": out["int4 reloaded"] == out["int4"], "kv_formats": [r["kv_cache_dtype"] for r in rows],
            "quantized": q4.quantization_config.summary()}


CHAPTERS = {"00": chapter_00, "01": chapter_01, "02": chapter_02, "03": chapter_03, "04": chapter_04,
            "05": chapter_05}


def run(layers: int | None = 2, chapters: list[str] | None = None, max_tokens: int = 4,
        folder: Path | None = None, report: Any = None) -> dict[str, dict[str, Any]]:
    """Each chapter's GPU-track calls, in turn; returns what each reported and its wall time in seconds."""
    import torch

    torch.manual_seed(0)
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(folder or tmp)
        for ch in chapters or list(CHAPTERS):
            pair = dummy_pair(base / ch, layers, chapter=ch)
            t0 = time.perf_counter()
            results[ch] = {**CHAPTERS[ch](pair, max_tokens), "seconds": round(time.perf_counter() - t0, 1)}
            pair.shared.clear()
            if report is not None:
                report(ch, results[ch])
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--all-layers", action="store_true", help="the full-size models (28 layers each)")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers per model (default 2)")
    parser.add_argument("--chapters", nargs="*", choices=sorted(CHAPTERS), help="default: all")
    parser.add_argument("--max-tokens", type=int, default=4)
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    results = run(None if args.all_layers else args.layers, args.chapters, args.max_tokens,
                  report=lambda ch, r: print(f"chapter {ch}: {json.dumps(r, default=str)}", flush=True))
    print(f"all {len(results)} chapters ran in {time.perf_counter() - t0:.0f} s "
          f"({'all layers' if args.all_layers else f'{args.layers} layers'}, {GPU_DTYPE}, dummy weights, CPU)")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
