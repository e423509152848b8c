"""How much of a speculative step is the speculator's own work: the step's time outside the model forwards.

    PYTHONPATH=. python3 scripts/spec_overhead.py --out benchmarks/results/spec_overhead.json

Batch 1, greedy, one thread, the bundled pair, fixed k (the default). Every decode step of ``LLMEngine.step`` is
timed whole, and inside it every ``ModelRunner.forward`` of the target and of the draft model; what is left is the
step's own work: scheduling, proposing around the draft's forwards, verifying, rolling back, appending, reporting.
A plain engine (no speculation) measured the same way is the control: its rest is what any step costs around its
forward. The result is a share of the step, a ratio within one engine's own steps, so a loaded machine scales both
parts alike; the engines run in turns (round ``r`` of each, then ``r + 1``) on the same weights.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from minifer import LLM, SamplingParams
from minifer.bench.provenance import metadata, save_result
from minifer.bench.speculative import story_openings

K = 4
CONFIGS = {
    "plain": None,
    "draft_model": {"method": "draft_model", "model": "tinystories-draft", "num_speculative_tokens": K},
    "ngram": {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3, "prompt_lookup_min": 1},
}


def time_forwards(runner, sink: list[float]) -> None:
    """Record the wall time of every ``runner.forward`` call into ``sink`` (the runner's method, wrapped in place)."""
    inner = runner.forward

    def forward(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            sink.append(time.perf_counter() - t0)

    runner.forward = forward


def one_round(llm: LLM, prompts: list[str], max_tokens: int, forwards: list[float]) -> dict[str, float]:
    """Each prompt alone (batch 1) to ``max_tokens``; the decode steps' total time, the part inside the forwards,
    the tokens they emitted and how many steps they took (a request's first step, its prefill, is left out)."""
    engine, params = llm.engine, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    total = inside = 0.0
    steps = tokens = 0
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
        engine.step()  # the prefill
        while engine.has_unfinished_requests():
            forwards.clear()
            before = sum(len(s.output_token_ids) for s in engine.scheduler.running)
            t0 = time.perf_counter()
            out = engine.step()
            total += time.perf_counter() - t0
            inside += sum(forwards)
            steps += 1
            done = sum(len(o.outputs[0].token_ids) for o in out if o.finished)
            tokens += done + sum(len(s.output_token_ids) for s in engine.scheduler.running) - before
    return {"step_seconds": total, "forward_seconds": inside, "steps": steps, "tokens": tokens}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="result JSON (default: print only)")
    ap.add_argument("--prompts", type=int, default=4, help="held-out story openings per round")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)

    target = LLM("tinystories-target", device="cpu", dtype="float32")
    llms = {name: target if spec is None else
            LLM("tinystories-target", device="cpu", dtype="float32", share_weights_with=target, speculative_config=spec)
            for name, spec in CONFIGS.items()}
    sinks: dict[str, list[float]] = {}
    for name, llm in llms.items():
        sinks[name] = []
        time_forwards(llm.engine.runner, sinks[name])
        proposer = getattr(llm.engine.speculator, "proposer", None)
        if getattr(proposer, "runner", None) is not None:
            time_forwards(proposer.runner, sinks[name])
    prompts = story_openings(args.prompts)
    for llm in llms.values():  # warm-up
        one_round(llm, prompts[:1], 8, [])
    rounds: dict[str, list[dict]] = {name: [] for name in llms}
    for _ in range(args.rounds):
        for name, llm in llms.items():
            rounds[name].append(one_round(llm, prompts, args.max_tokens, sinks[name]))

    summary = {}
    for name, rs in rounds.items():
        shares = [1 - r["forward_seconds"] / r["step_seconds"] for r in rs]
        summary[name] = {
            "own_work_share_median": statistics.median(shares), "own_work_share_min": min(shares),
            "own_work_share_max": max(shares),
            "tokens_per_step": sum(r["tokens"] for r in rs) / sum(r["steps"] for r in rs),
            "ms_per_step_median": statistics.median(1e3 * r["step_seconds"] / r["steps"] for r in rs),
            "own_ms_per_step_median": statistics.median(
                1e3 * (r["step_seconds"] - r["forward_seconds"]) / r["steps"] for r in rs)}
    meta = metadata(argv)
    meta["command"] = "PYTHONPATH=. python3 scripts/spec_overhead.py " + " ".join(sys.argv[1:] if argv is None else argv)
    result = {"metadata": meta, "model": "tinystories-target", "draft": "tinystories-draft", "k": K, "batch": 1,
              "torch_threads": 1, "prompts": args.prompts, "max_tokens": args.max_tokens, "rounds_per_engine": rounds,
              "summary": summary}
    for name, s in summary.items():
        print(f"{name:12s} own work {100 * s['own_work_share_median']:.1f}% of the step "
              f"({100 * s['own_work_share_min']:.1f}-{100 * s['own_work_share_max']:.1f}%), "
              f"{s['own_ms_per_step_median']:.2f} of {s['ms_per_step_median']:.2f} ms, "
              f"{s['tokens_per_step']:.2f} tokens per step")
    if args.out:
        print("wrote", save_result(result, args.out))
    return result


if __name__ == "__main__":
    main()
