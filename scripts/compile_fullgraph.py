"""Does one batch-1 decode forward of the bundled target compile as one graph, and what does compiling it do on the CPU?

A one-off experiment (issue 45, item 7), not engine code. It runs the engine a few steps with ``LlamaModel.forward``
wrapped by a recorder, keeps the arguments of one real decode step (token ids, positions, the ``PagedKVCache``
passed as the attention backend) together with the ``PagedAttentionMetadata`` the runner had set
on ``cache.meta`` for that call, and then:

1. ``torch._dynamo.explain`` over ``LlamaModel.forward`` with the paged attention traced *inside* (unlike
   ``features.compiled_decoder``, which keeps attention behind an opaque custom op): graph count and every break
   reason with the frame it points at (and the same for the prompt's forward, which the engine runs first); then ``torch.compile(fullgraph=True)``, which either compiles or raises at
   the first break.
2. Batch-1 decode forwards, eager vs compiled (``fullgraph=True`` if it held, else ``fullgraph=False``), timed
   interleaved on one thread on the same inputs; the per-round ratio is what is reported (the machine is shared).
3. Whole-engine batch-1 greedy generation, eager vs the compiled forward swapped in. The runner sets a fresh
   ``cache.meta`` before every step; the compiled function receives the cache as its ``attn`` argument and reads
   ``meta`` from it, so the metadata is an input of the graph (dynamo guards on it, and may recompile as the
   context grows).

    PYTHONPATH=. python3 scripts/compile_fullgraph.py --out benchmarks/results/compile_fullgraph.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback

import torch

from minifer import LLM, SamplingParams
from minifer.bench.provenance import metadata, save_result

PROMPT = "Once upon a time, there was a little girl named Lily. She"


def capture_steps(llm: LLM, steps: int = 8) -> tuple[tuple, object, tuple, object]:
    """Generate a few tokens with ``LlamaModel.forward`` recorded; return the last decode call's arguments
    (``input_ids`` ``[1]``, ``positions`` ``[1]``, the cache) and the ``cache.meta`` it ran with, then the
    same for the prompt's (prefill) call."""
    decoder = llm.model.model
    calls, prefills = [], []
    eager = decoder.forward

    def record(input_ids, positions, attn):
        (calls if input_ids.numel() == 1 else prefills).append(((input_ids.clone(), positions.clone(), attn), attn.meta))
        return eager(input_ids, positions, attn)

    decoder.forward = record  # nn.Module.__call__ looks forward up on the instance first
    try:
        llm.generate([PROMPT], SamplingParams(max_tokens=steps, temperature=0.0), use_tqdm=False)
    finally:
        del decoder.forward
    if not calls or not prefills:
        raise RuntimeError("no batch-1 decode step (or no prefill) was recorded")
    return (*calls[-1], *prefills[0])


def decode_fn(decoder: torch.nn.Module):
    """``LlamaModel.forward`` bound to ``decoder`` through its class, so the function still reaches the eager
    forward once the compiled one is set on the instance (the whole-engine run below)."""
    forward = type(decoder).forward

    def decode_forward(input_ids, positions, attn):
        return forward(decoder, input_ids, positions, attn)
    return decode_forward


def explain(fn, args) -> dict:
    torch._dynamo.reset()
    out = torch._dynamo.explain(fn)(*args)
    breaks = []
    for b in out.break_reasons:
        frames = [f"{fs.filename.split('/minifer/')[-1] if '/minifer/' in fs.filename else fs.filename}:{fs.lineno}"
                  f" ({fs.name})" for fs in b.user_stack]
        breaks.append({"reason": str(b.reason), "at": frames[-1] if frames else None, "stack": frames})
    return {"graph_count": out.graph_count, "graph_break_count": out.graph_break_count, "op_count": out.op_count,
            "break_reasons": breaks}


def try_fullgraph(fn, args) -> dict:
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True)
    t0 = time.perf_counter()
    try:
        compiled(*args)
    except Exception as e:  # noqa: BLE001 - the failure is the finding
        return {"compiles": False, "error_type": type(e).__name__,
                "error": str(e).split("\n\nfrom user code")[0][:2000],
                "traceback_tail": traceback.format_exc().splitlines()[-3:]}
    return {"compiles": True, "compile_s": round(time.perf_counter() - t0, 1)}


def timed(fn, args, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn(*args)
    return time.perf_counter() - t0


def interleaved(eager, compiled, args, n: int, rounds: int) -> dict:
    ratios, e_times, c_times = [], [], []
    for _ in range(rounds):
        te, tc = timed(eager, args, n), timed(compiled, args, n)
        e_times.append(te / n)
        c_times.append(tc / n)
        ratios.append(te / tc)
    return {"n_per_round": n, "rounds": rounds, "eager_over_compiled": {
        "median": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "per_round": ratios},
        "eager_ms_median": 1e3 * statistics.median(e_times), "compiled_ms_median": 1e3 * statistics.median(c_times)}


def generate_time(llm: LLM, max_tokens: int) -> tuple[float, list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    out = llm.generate([PROMPT], params, use_tqdm=False)
    return time.perf_counter() - t0, list(out[0].outputs[0].token_ids)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="result JSON (default: print only)")
    ap.add_argument("--n", type=int, default=64, help="decode forwards per round per variant")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--gen-tokens", type=int, default=16)
    ap.add_argument("--gen-rounds", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)

    llm = LLM("tinystories-target", device="cpu", dtype="float32")
    decoder = llm.model.model
    step_args, meta, prefill_args, prefill_meta = capture_steps(llm)
    cache = step_args[2]
    cache.meta = meta  # the step's metadata, as the runner sets it before the call
    result_meta = {"position": int(step_args[1].item()), "context_len": int(meta.context_lens[0]),
                   "kv_cache_shape": list(cache.k.shape), "kv_cache_mib_k_plus_v": 2 * cache.k.numel() * 4 / 2**20}
    fn = decode_fn(decoder)
    meta_info = metadata(argv)
    meta_info["command"] = "PYTHONPATH=. python3 scripts/compile_fullgraph.py " + " ".join(
        sys.argv[1:] if argv is None else argv)
    result: dict = {"metadata": meta_info, "model": "tinystories-target",
                    "dtype": "float32", "device": "cpu", "torch_threads": 1,
                    "decode_step": result_meta, "prefill_tokens": int(prefill_args[0].numel())}

    with torch.inference_mode():
        cache.meta = prefill_meta  # the prompt's forward, which the whole-engine run below goes through too
        result["explain_prefill"] = explain(fn, prefill_args)
        print("explain prefill:", result["explain_prefill"]["graph_count"], "graphs", flush=True)
        for b in result["explain_prefill"]["break_reasons"]:
            print("  break:", b["reason"].splitlines()[0][:200], "@", b["at"], flush=True)
        cache.meta = meta
        result["explain"] = explain(fn, step_args)
        print("explain:", {k: v for k, v in result["explain"].items() if k != "break_reasons"}, flush=True)
        for b in result["explain"]["break_reasons"]:
            print("  break:", b["reason"].splitlines()[0][:200], "@", b["at"], flush=True)
        result["fullgraph"] = try_fullgraph(fn, step_args)
        print("fullgraph=True:", {k: v for k, v in result["fullgraph"].items() if k != "traceback_tail"}, flush=True)

        torch._dynamo.reset()
        fullgraph = result["fullgraph"]["compiles"]
        compiled = torch.compile(fn, fullgraph=fullgraph)
        reference = fn(*step_args).clone()
        t0 = time.perf_counter()
        out = compiled(*step_args)
        result["timed_variant"] = {"fullgraph": fullgraph, "first_call_s": round(time.perf_counter() - t0, 1)}
        logits_e = llm.model.compute_logits(reference)
        logits_c = llm.model.compute_logits(out)
        result["max_abs_diff"] = {"hidden": float((out - reference).abs().max()),
                                  "logits": float((logits_c - logits_e).abs().max()),
                                  "same_argmax": bool(logits_c.argmax(-1).eq(logits_e.argmax(-1)).all())}
        for _ in range(3):
            compiled(*step_args)
        result["forward"] = interleaved(fn, compiled, step_args, args.n, args.rounds)
        print("forward:", {k: v for k, v in result["forward"].items()}, "diff", result["max_abs_diff"], flush=True)
    cache.meta = None

    # whole engine: the compiled function in place of LlamaModel.forward (the runner passes the cache, meta set)
    torch._dynamo.reset()
    compiled_gen = torch.compile(fn, fullgraph=False)
    counters_before = dict(torch._dynamo.utils.counters["stats"])
    _, eager_tokens = generate_time(llm, args.gen_tokens)  # warm
    decoder.forward = compiled_gen
    t0 = time.perf_counter()
    _, comp_tokens = generate_time(llm, args.gen_tokens)  # compiles (prefill graph, decode graph, recompiles)
    first = time.perf_counter() - t0
    del decoder.forward
    ratios, e_s, c_s = [], [], []
    for _ in range(args.gen_rounds):
        te, _ = generate_time(llm, args.gen_tokens)
        decoder.forward = compiled_gen
        tc, toks = generate_time(llm, args.gen_tokens)
        del decoder.forward
        e_s.append(te)
        c_s.append(tc)
        ratios.append(te / tc)
    stats = torch._dynamo.utils.counters["stats"]
    result["generate"] = {
        "prompt": PROMPT, "max_tokens": args.gen_tokens, "rounds": args.gen_rounds, "fullgraph": False,
        "how": "decoder.forward (LlamaModel, instance attribute) = torch.compile(fn(input_ids, positions, attn)); "
               "the runner passes the PagedKVCache as attn with cache.meta set for the step, so meta is a graph input",
        "first_generate_s": round(first, 1), "same_tokens": comp_tokens == eager_tokens and toks == eager_tokens,
        "eager_over_compiled": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
                                "per_round": ratios},
        "eager_s_median": statistics.median(e_s), "compiled_s_median": statistics.median(c_s),
        "dynamo_frames_compiled": stats.get("unique_graphs", 0) - counters_before.get("unique_graphs", 0),
        "recompile_limit": torch._dynamo.config.recompile_limit}
    print("generate:", result["generate"], flush=True)
    result["versions"] = {"torch": torch.__version__, "python": sys.version.split()[0]}
    if args.out:
        print("wrote", save_result(result, args.out))
    return result


if __name__ == "__main__":
    main()
