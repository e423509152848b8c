"""The quantized KV cache measured: bytes per token, sequences that fit in the same memory, and how
often greedy decoding still picks the same tokens (chapter 05).

    python -m minifer_course.kv_quant --out benchmarks/results/kv_quant.json

"Sequences that fit" counts, for ShareGPT-like prompt + output lengths (chapter 02's workload), how many
requests' blocks a fixed KV budget holds, for each cache format — the paged allocator stores nothing else.
Agreement: greedy tokens with the 8-bit cache vs the full-precision cache, on held-out story openings.
Each 8-bit format twice: with a scale per (token, head) (``kv_cache_scales="token"``, 2 bytes per head_dim
codes) and with static per-(layer, head) scales calibrated at start-up (``"head"``, exactly one byte per number).
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path
from typing import Any

import torch

from minifer.quantization.kv_cache import KV_CACHE_DTYPES

# (kv_cache_dtype, kv_cache_scales) measured, the model's own dtype first
FORMATS = [("auto", "token")] + [(kv, scales) for scales in ("token", "head") for kv in KV_CACHE_DTYPES[1:]]
from minifer.attention.backends.paged import PagedKVCache
from minifer.bench.provenance import save_result
from minifer.sampling_params import SamplingParams

BUDGET = 2**30  # bytes


def sequences_that_fit(bytes_per_block: int, block_size: int, lengths: list[int], budget: int = BUDGET) -> int:
    """How many of ``lengths`` (tokens each, in order) fit in ``budget`` bytes of blocks."""
    blocks, n = budget // bytes_per_block, 0
    for length in lengths:
        need = -(-length // block_size)
        if need > blocks:
            break
        blocks -= need
        n += 1
    return n


def memory_table(cfg, lengths: list[int], block_size: int = 16, budget: int = BUDGET) -> list[dict[str, Any]]:
    rows = []
    for model_dtype in (torch.bfloat16, torch.float32):
        base = None
        for kv, scales in FORMATS:
            per_block = PagedKVCache.bytes_per_block(cfg.num_hidden_layers, block_size, cfg.num_key_value_heads,
                                                     cfg.head_dim, model_dtype, kv, scales)
            fit = sequences_that_fit(per_block, block_size, lengths, budget)
            base = base or fit
            rows.append({"model_dtype": str(model_dtype).replace("torch.", ""), "kv_cache_dtype": kv,
                         "kv_cache_scales": scales if kv != "auto" else None,
                         "bytes_per_token": per_block / block_size, "sequences_that_fit": fit,
                         "vs_model_dtype": fit / base})
    return rows


def agreement(model: str, prompts: list[str], max_tokens: int = 48, device: str | None = None) -> list[dict]:
    from minifer import LLM

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in LLM(model, device=device).generate(prompts, params, use_tqdm=False)]
    rows = []
    for kv, scales in FORMATS[1:]:
        got = [o.outputs[0].token_ids for o in LLM(model, device=device, kv_cache_dtype=kv,
                                                   kv_cache_scales=scales).generate(prompts, params, use_tqdm=False)]
        first = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(y)) for x, y in zip(got, ref)]
        rows.append({"kv_cache_dtype": kv, "kv_cache_scales": scales, "identical_sequences": sum(x == y for x, y in zip(got, ref)),
                     "sequences": len(ref), "tokens_before_first_difference": sum(first) / len(first),
                     "token_agreement": sum(a == b for x, y in zip(got, ref) for a, b in zip(x, y)) / sum(map(len, ref))})
    return rows


def run(model: str = "tinystories-target", num_prompts: int = 32, config_of: str = "Qwen/Qwen3-0.6B") -> dict:
    from minifer.bench.serving import metadata
    from minifer.bench.speculative import story_openings
    from minifer.bench.workloads import sharegpt_specs
    from minifer.model_loader import load_config, resolve_model

    prompt_spec, output_spec = sharegpt_specs(4096)
    rng = random.Random(0)
    lengths = [prompt_spec.sample(rng) + output_spec.sample(rng) for _ in range(4096)]
    return {"kind": "kv_quant", "metadata": metadata(module="minifer_course.kv_quant"), "budget_bytes": {model: BUDGET, config_of: 16 * BUDGET},
            "memory": {name: memory_table(load_config(resolve_model(name, need_weights=False)), lengths,
                                          budget=budget)
                       for name, budget in ((model, BUDGET), (config_of, 16 * BUDGET))},
            "agreement": agreement(model, story_openings(num_prompts))}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tinystories-target")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--out", type=Path, default=Path("runs/kv_quant.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    result = run(args.model, args.num_prompts)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save_result(result, args.out)
    for name, rows in result["memory"].items():
        for r in rows:
            print(f"{name:22s} {r['model_dtype']:>8} KV {r['kv_cache_dtype']:>4} {r['kv_cache_scales'] or '':>5}: "
                  f"{r['bytes_per_token']:8.0f} B/token, "
                  f"{r['sequences_that_fit']:5d} sequences fit ({r['vs_model_dtype']:.2f}x)")
    for r in result["agreement"]:
        print(f"greedy with KV {r['kv_cache_dtype']} (scales per {r['kv_cache_scales']}): {r['token_agreement']:.1%} of tokens agree, "
              f"{r['identical_sequences']}/{r['sequences']} sequences identical")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
