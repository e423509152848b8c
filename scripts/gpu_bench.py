"""The GPU check: a few minutes on one GPU, dummy weights of a real model shape, JSON out.

Measures, for ``--model`` (default Qwen/Qwen3-0.6B from its shipped config, random bf16 weights):

1. batch-1 decode: tokens/s and the memory bandwidth it implies (weight + KV bytes read per token / time),
   against a measured device-to-device copy bandwidth;
2. offline throughput of ``--num-requests`` requests (default 256) with input and output lengths uniform
   in [100, 1024] (nano-vllm's benchmark), output tokens/s.

    python scripts/gpu_bench.py --out runs/gpu_bench.json
    python scripts/gpu_bench.py --model tinystories-target --device cpu --num-requests 4 --max-len 64   # smoke

Dummy weights say nothing about quality; they fix the *cost* of each step, which is what is measured.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import subprocess
import time
from pathlib import Path

import torch

from minifer import LLM, SamplingParams


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
    weight_bytes = sum(p.numel() for p in llm.model.parameters()) * elem
    kv_bytes = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * elem * (prompt_len + new_tokens / 2)
    return {"prompt_len": prompt_len, "new_tokens": new_tokens, "seconds": elapsed,
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
    try:
        meta["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        pass
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        meta.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / 2**30, 1), capability=f"{p.major}.{p.minor}",
                    sms=p.multi_processor_count)
    return meta


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="Qwen/Qwen3-0.6B")
    ap.add_argument("--device", default=None)
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--min-len", type=int, default=100)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--out", type=Path, default=Path("runs/gpu_bench.json"))
    args = ap.parse_args()
    load = "auto" if args.model.startswith("tinystories") else "dummy"
    llm = LLM(args.model, load_format=load, device=args.device, max_num_seqs=256, max_model_len=4096
              if load == "dummy" else None, max_num_batched_tokens=8192)
    report = {"model": args.model, "load_format": load, "dtype": str(llm.dtype), "meta": metadata(llm.device),
              "kv_blocks": llm.stats()["kv_blocks_total"]}
    report["copy_bandwidth"] = copy_bandwidth(llm.device, 2**30 if llm.device.type == "cuda" else 2**26)
    report["decode_batch1"] = decode_batch1(llm, prompt_len=min(128, args.max_len), new_tokens=min(256, args.max_len))
    report["decode_batch1"]["fraction_of_copy_bandwidth"] = (
        report["decode_batch1"]["achieved_bandwidth"] / report["copy_bandwidth"])
    report["offline"] = offline_throughput(llm, args.num_requests, args.min_len, args.max_len, seed=0)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    d, o = report["decode_batch1"], report["offline"]
    print(f"{args.model} on {report['meta'].get('gpu', 'cpu')}: batch-1 decode {d['decode_tokens_per_s']:.0f} tok/s, "
          f"{d['achieved_bandwidth'] / 1e9:.0f} GB/s ({d['fraction_of_copy_bandwidth']:.0%} of copy); "
          f"offline {o['output_tokens_per_s']:.0f} output tok/s over {o['num_requests']} requests")


if __name__ == "__main__":
    main()
