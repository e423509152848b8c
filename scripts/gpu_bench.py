"""The GPU check: one prepared run of a few minutes on one GPU, each part a section writing its own JSON.

    bash scripts/gpu_check.sh OUT_DIR            # every section, each in its own process with a time limit
    python scripts/gpu_bench.py engine --out runs/engine.json
    python scripts/gpu_bench.py engine --model tinystories-target --device cpu --num-requests 4 --max-len 64  # smoke

Sections (dummy weights of a real shape say nothing about quality; they fix the *cost* of each step, which
is what is measured):

- ``engine`` (issue 3): Qwen3-0.6B, bf16. Batch-1 decode tokens/s eager and with CUDA graphs (same tokens),
  the memory bandwidth that implies (weights + KV bytes per token / time) against a measured copy; then the
  offline throughput of ``--num-requests`` requests (default 256) with input and output lengths uniform in
  [100, 1024] (nano-vllm's benchmark).
- ``parity``: the bundled target on the GPU (Triton decode kernels, CUDA graphs) gives the CPU's greedy
  tokens in float32, and how often bf16 agrees; and the same for beam search's beams (copy-on-write between
  CUDA-graph replays).
- ``spec`` (issue 4): the target's verify-forward time for k+1 tokens per sequence vs one, at several batch
  sizes (Qwen3-0.6B); and the bundled pair's speculative speedup vs batch size, fixed and adaptive k.
- ``quant_e2e`` (issue 5): Llama-3.1-8B batch-1 decode tokens/s in bf16 and with int8 / int4 / fp8 weights.
  (The per-kernel benchmark is ``python -m minifer.bench.quant_kernels``, which gpu_check.sh also runs.)
- ``quant_graphs`` (issue 5): the bundled target with int4 / int8 / fp8 weights, or an int8 / fp8 KV cache, 13
  requests at once: greedy tokens with CUDA graphs (and the decode kernel reading the 8-bit cache) identical
  to eager (the PyTorch path), also after the split-K counters' buffer has grown.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from pathlib import Path

import torch

from minifer import LLM, SamplingParams
from minifer.bench.serving import git_commit


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes moved (read + write) per second by a large tensor copy, median of 5."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(6):
        _sync(device)
        t = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        times.append(time.perf_counter() - t)
    return 2 * nbytes / sorted(times[1:])[len(times[1:]) // 2]


def decode_batch1(llm: LLM, prompt_len: int, new_tokens: int) -> dict:
    cfg = llm.model_config
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    prompt = {"prompt_token_ids": [1] * prompt_len}
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
    _sync(llm.device)
    t = time.perf_counter()
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    _sync(llm.device)
    elapsed = time.perf_counter() - t
    m = out.metrics
    decode_s = (m.token_times[-1] - m.token_times[0]) / max(1, len(m.token_times) - 1)
    elem = torch.empty((), dtype=llm.dtype).element_size()
    # every weight is read once per token (quantized codes and scales are buffers; the RoPE tables are not weights)
    weight_bytes = sum(t.numel() * t.element_size() for t in llm.model.parameters())
    weight_bytes += sum(t.numel() * t.element_size() for n, t in llm.model.named_buffers() if "rotary" not in n)
    kv_bytes = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * elem * (prompt_len + new_tokens / 2)
    return {"prompt_len": prompt_len, "new_tokens": new_tokens, "seconds": elapsed, "token_ids": out.outputs[0].token_ids,
            "decode_tokens_per_s": 1 / decode_s, "ttft_s": m.first_token_time - m.arrival_time,
            "bytes_per_token": weight_bytes + kv_bytes, "achieved_bandwidth": (weight_bytes + kv_bytes) / decode_s}


def offline_throughput(llm: LLM, n: int, lo: int, hi: int, seed: int) -> dict:
    rng = random.Random(seed)
    vocab = llm.model_config.vocab_size
    prompts, params = [], []
    for _ in range(n):
        prompts.append({"prompt_token_ids": [rng.randrange(vocab) for _ in range(rng.randint(lo, hi))]})
        params.append(SamplingParams(temperature=0, max_tokens=rng.randint(lo, hi), ignore_eos=True))
    _sync(llm.device)
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    _sync(llm.device)
    elapsed = time.perf_counter() - t
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"num_requests": n, "lengths": [lo, hi], "seconds": elapsed, "output_tokens": tokens,
            "output_tokens_per_s": tokens / elapsed, "requests_per_s": n / elapsed, "stats": llm.stats()}


def metadata(device: torch.device) -> dict:
    meta = {"python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    meta["git"] = git_commit()  # the commit, whether the tree differed from it, and a fingerprint of the diff
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        meta.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / 2**30, 1), capability=f"{p.major}.{p.minor}",
                    sms=p.multi_processor_count)
    return meta


def _free(llm) -> None:
    del llm
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def section_engine(args) -> dict:
    load = "auto" if args.model.startswith("tinystories") else "dummy"
    kw = dict(load_format=load, device=args.device, max_model_len=4096 if load == "dummy" else None)
    report: dict = {"model": args.model, "load_format": load}
    eager = LLM(args.model, enforce_eager=True, max_num_seqs=1, num_kv_blocks=256, **kw)
    report["meta"], report["dtype"] = metadata(eager.device), str(eager.dtype)
    report["copy_bandwidth"] = copy_bandwidth(eager.device, 2**30 if eager.device.type == "cuda" else 2**26)
    new = min(256, args.max_len)
    report["decode_batch1_eager"] = decode_batch1(eager, prompt_len=min(128, args.max_len), new_tokens=new)
    eager_tokens = report["decode_batch1_eager"].pop("token_ids")
    _free(eager)
    llm = LLM(args.model, max_num_seqs=args.num_requests, gpu_memory_utilization=0.6,
              max_num_batched_tokens=8192, **kw)
    report["kv_blocks"] = llm.stats()["kv_blocks_total"]
    report["cuda_graphs"] = llm.engine.runner.graphs is not None
    report["decode_batch1"] = decode_batch1(llm, prompt_len=min(128, args.max_len), new_tokens=new)
    report["decode_batch1"]["same_tokens_as_eager"] = report["decode_batch1"].pop("token_ids") == eager_tokens
    for key in ("decode_batch1_eager", "decode_batch1"):
        report[key]["fraction_of_copy_bandwidth"] = report[key]["achieved_bandwidth"] / report["copy_bandwidth"]
    report["offline"] = offline_throughput(llm, args.num_requests, args.min_len, args.max_len, seed=0)
    d, o = report["decode_batch1"], report["offline"]
    print(f"{args.model}: batch-1 decode {report['decode_batch1_eager']['decode_tokens_per_s']:.0f} tok/s eager, "
          f"{d['decode_tokens_per_s']:.0f} with CUDA graphs ({d['fraction_of_copy_bandwidth']:.0%} of copy bandwidth); "
          f"offline {o['output_tokens_per_s']:.0f} output tok/s over {o['num_requests']} requests")
    return report


def section_parity(args) -> dict:
    from minifer import BeamSearchParams
    from minifer.bench.speculative import story_openings

    prompts = story_openings(16)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    beam_params = BeamSearchParams(beam_width=4, max_tokens=32, ignore_eos=True)
    cpu_llm = LLM("tinystories-target", device="cpu", block_size=4)
    cpu = [o.outputs[0].token_ids for o in cpu_llm.generate(prompts, params, use_tqdm=False)]
    cpu_beams = [[s.tokens for s in o.sequences] for o in cpu_llm.beam_search(prompts[:4], beam_params)]
    report = {"meta": metadata(torch.device(args.device or "cuda"))}
    for dtype in ("float32", "bfloat16"):
        # 4-token blocks: the beams fork inside blocks, so copy-on-write copies run between CUDA-graph replays
        llm = LLM("tinystories-target", device=args.device, dtype=dtype, block_size=4)
        beams = [[s.tokens for s in o.sequences] for o in llm.beam_search(prompts[:4], beam_params)]
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        same = sum(a == b for x, y in zip(got, cpu) for a, b in zip(x, y))
        first_diff = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(got, cpu)]
        report[dtype] = {"identical_sequences": sum(x == y for x, y in zip(got, cpu)), "sequences": len(cpu),
                         "token_agreement": same / sum(len(x) for x in cpu), "mean_first_divergence": sum(first_diff) / len(first_diff),
                         "cuda_graphs": llm.engine.runner.graphs is not None,
                         "beam_search_beams": sum(map(len, cpu_beams)),
                         "beam_search_identical_beams": sum(x == y for g, c in zip(beams, cpu_beams)
                                                            for x, y in zip(g, c))}
        _free(llm)
        print(f"parity {dtype}: {report[dtype]}")
    return report


def section_spec(args) -> dict:
    from minifer.bench.speculative import DRAFT, speedup_vs_batch, story_openings, verify_cost

    load = "auto" if args.model.startswith("tinystories") else "dummy"
    llm = LLM(args.model, load_format=load, device=args.device, max_num_seqs=256, gpu_memory_utilization=0.3,
              max_model_len=4096 if load == "dummy" else None, max_num_batched_tokens=8192)
    sizes, context = ([1, 4], 32) if args.smoke else ([1, 4, 16, 64, 256], 512)
    report = {"meta": metadata(llm.device), "model": args.model,
              "verify_cost": verify_cost(llm, sizes, [1, 2, 4, 8], context=context)}
    for r in report["verify_cost"]:
        print("verify cost", {k: round(v, 5) if isinstance(v, float) else v for k, v in r.items()})
    _free(llm)
    if args.verify_only:
        return report
    report["pair_speedup"] = speedup_vs_batch("tinystories-target", {"method": "draft_model", "model": DRAFT},
                                              story_openings(64), [1, 2] if args.smoke else [1, 2, 4, 8, 16, 32, 64],
                                              8 if args.smoke else 64, repeats=1 if args.smoke else 2,
                                              device=args.device)
    for r in report["pair_speedup"]["rows"]:
        print(f"pair batch {r['batch']}: fixed {r['speedup_fixed']:.2f}x adaptive {r['speedup_adaptive']:.2f}x "
              f"identical {r['identical_tokens']}")
    return report


def _save(args, report: dict) -> Path:
    out = args.out or Path(f"runs/gpu_{args.section}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str))
    return out


def _save_partial(args, report: dict) -> None:
    """Write what a section has so far: a run cut short by its time limit still leaves its finished rows."""
    _save(args, {**report, "partial": True})


def section_quant_e2e(args) -> dict:
    model = "tinystories-target" if args.smoke else "meta-llama/Llama-3.1-8B"
    report: dict = {"model": model, "rows": []}
    for quant in (None, "int8", "int4", "fp8"):
        llm = LLM(model, load_format="auto" if args.smoke else "dummy", device=args.device, quantization=quant,
                  max_num_seqs=1, num_kv_blocks=256, max_model_len=2048 if not args.smoke else None)
        report.setdefault("meta", metadata(llm.device))
        row = decode_batch1(llm, prompt_len=16 if args.smoke else 128, new_tokens=16 if args.smoke else 128)
        row.pop("token_ids")
        row["quantization"] = quant or "bf16"
        report["rows"].append(row)
        print(f"{row['quantization']}: {row['decode_tokens_per_s']:.0f} tok/s")
        _save_partial(args, report)
        _free(llm)
    base = report["rows"][0]["decode_tokens_per_s"]
    for row in report["rows"]:
        row["speedup_vs_bf16"] = row["decode_tokens_per_s"] / base
    measured = report["rows"][2]["speedup_vs_bf16"]
    # Speed only: dummy weights have no reference tokens; the kernels' outputs are checked by the kernel
    # benchmark (rel_err per case) and tests/kernels/test_quant_kernels.py on the same GPU.
    report["target"] = {"int4_min_speedup": 1.8, "measured": measured, "met": measured >= 1.8}
    return report


def section_quant_graphs(args) -> dict:
    """Batched decode of the bundled target with quantized weights or an 8-bit KV cache, CUDA graphs against
    eager, token for token (one process, so both share the autotuner's choices: any difference is the
    graphs'). With an 8-bit KV cache the eager run takes the PyTorch path (``use_triton = False``: gather,
    then dequantize), in float32, so the decode kernel's on-the-fly dequantization is checked too. Then the
    split-K counters' buffer is grown, as a launch with more tiles than it holds would grow it, and memory of
    its old size is filled with ones: the graphs replay with the old buffer's address, which must still be
    theirs."""
    from minifer.bench.speculative import story_openings
    from minifer.kernels import quant_matmul as qm

    few, long = (3, 100) if getattr(args, "smoke", False) else (12, 900)
    prompts = story_openings(few) + [{"prompt_token_ids": [5 + i % 200 for i in range(long)]}]
    params = SamplingParams(temperature=0, max_tokens=8 if few == 3 else 24, ignore_eos=True)
    report: dict = {"meta": metadata(torch.device(args.device or "cuda")), "rows": []}
    variants = {"int4": dict(quantization="int4"), "int8": dict(quantization="int8"), "fp8": dict(quantization="fp8"),
                "kv int8": dict(kv_cache_dtype="int8", dtype="float32"),
                "kv fp8": dict(kv_cache_dtype="fp8", dtype="float32"),
                "kv int8 static": dict(kv_cache_dtype="int8", kv_cache_scales="head", dtype="float32")}
    for name, kw in variants.items():
        row: dict = {"variant": name}
        for eager in (True, False):
            llm = LLM("tinystories-target", device=args.device, enforce_eager=eager, max_num_seqs=16, **kw)
            if eager and "kv_cache_dtype" in kw:
                llm.engine.kv_cache.use_triton = False
            row["eager" if eager else "graphs"] = [o.outputs[0].token_ids
                                                   for o in llm.generate(prompts, params, use_tqdm=False)]
            if not eager:
                row["cuda_graphs"] = llm.engine.runner.graphs is not None
                junk = []
                for device, buf in list(qm._locks.items()):
                    qm._lock_buffer(device, 4 * buf.numel())
                    junk += [torch.ones_like(buf) for _ in range(4)]  # takes the old memory if it was freed
                again = [o.outputs[0].token_ids for o in llm.generate(prompts[:few], params, use_tqdm=False)]
                row["identical_after_growth"] = again == row["eager"][:few]
                del junk
            _free(llm)
        eager_ids, graph_ids = row.pop("eager"), row.pop("graphs")
        row["identical"] = eager_ids == graph_ids
        row["token_agreement"] = (sum(a == b for x, y in zip(eager_ids, graph_ids) for a, b in zip(x, y))
                                  / sum(map(len, eager_ids)))
        report["rows"].append(row)
        print(f"quant graphs {name}: {row}")
        _save_partial(args, report)
    return report


SECTIONS = {"engine": section_engine, "parity": section_parity, "spec": section_spec, "quant_e2e": section_quant_e2e,
            "quant_graphs": section_quant_graphs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("section", choices=list(SECTIONS))
    ap.add_argument("--model", default="Qwen/Qwen3-0.6B")
    ap.add_argument("--device", default=None)
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--min-len", type=int, default=100)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--smoke", action="store_true",
                    help="tiny sizes (spec, quant_e2e, quant_graphs): checks a section on a CPU")
    ap.add_argument("--verify-only", action="store_true", help="spec: the verify-cost table only")
    args = ap.parse_args()
    t = time.perf_counter()
    report = SECTIONS[args.section](args)
    report["section_seconds"] = time.perf_counter() - t
    print(f"wrote {_save(args, report)}")


if __name__ == "__main__":
    main()
