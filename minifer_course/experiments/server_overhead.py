"""What the HTTP layer costs (chapter 00, section 6): one closed-loop workload run three ways on one engine,
in interleaved rounds, compared by output-token throughput.

- ``direct``: the engine driven in-process, the way ``LLM.generate`` drives it;
- ``http``: through ``minifer.entrypoints.openai.serve`` with plain JSON answers (one persistent connection per client);
- ``http-stream``: the same with ``"stream": true``, one server-sent event per token.

Beside the wall-clock throughput, each run records the CPU seconds of the server's process (the engine and,
through HTTP, the server around it): on a machine shared with other jobs, the wall-clock ratios move with what
else runs (a server's extra threads can even take CPU back from other jobs, and stream faster than the engine
alone), while the CPU the server adds for the same tokens does not depend on the neighbours.

``concurrency`` clients each send their next request as soon as the previous answer is complete (a closed loop,
like a batch job with that many workers), so the engine holds up to ``concurrency`` requests in every mode and
the modes differ only in what surrounds it: the handler threads, JSON, sockets, and the Python interpreter lock
they share with the engine thread. The clients run in a separate process, as they would on other machines, so
their own work does not hold the server's interpreter lock (on a 2-core machine they still take some CPU). The
answers must be the same text (greedy, ``ignore_eos``), which the run checks.

vLLM measured its own HTTP server at 33% of the execution time for Llama-3-8B on an H100, and moved it into a
separate process (vLLM blog, "vLLM v0.6.0: 2.7x Throughput Improvement and 5x Latency Reduction", 2024-09-05);
this benchmark asks the same question of minifer, whose server shares the engine's process.

    python -m minifer_course.experiments.server_overhead --rounds 5 --out benchmarks/results/server_overhead.json --plot
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing
import queue
import random
import statistics
import sys
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from minifer.bench.server_sweep import add_workload_args, run_threads, setup, write
from minifer.bench.workloads import Workload
from minifer.entrypoints.openai.protocol import sse_events

MODES = ("direct", "http", "http-stream")


def run_direct(llm, workload: Workload, concurrency: int) -> dict[str, Any]:
    """The engine in-process: keep ``concurrency`` requests in it, add the next when one finishes."""
    from minifer import SamplingParams

    engine = llm.engine
    pending = deque(workload.requests)
    texts: dict[str, str] = {}
    start = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        while pending and len(engine.requests) < concurrency:
            r = pending.popleft()
            engine.add_request(r.request_id, {"prompt_token_ids": r.prompt_token_ids},
                               SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True))
        for o in engine.step():
            if o.finished:
                texts[o.request_id] = o.outputs[0].text
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "texts": texts}


def _client(host: str, port: int, model: str, jobs: queue.Queue, stream: bool, texts: dict[str, str],
            errors: list[str]) -> None:
    """One client: takes requests ``(id, prompt ids, max_tokens)`` from ``jobs`` until it is empty, each after
    the previous answer."""
    conn = None
    while True:
        try:
            rid, prompt, max_tokens = jobs.get_nowait()
        except queue.Empty:
            break
        body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                           "temperature": 0, "ignore_eos": True, "stream": stream})
        if conn is None:
            conn = http.client.HTTPConnection(host, port, timeout=600)
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read().decode()
        if resp.status != 200:
            errors.append(f"{rid}: HTTP {resp.status} {data[:200]}")
            continue
        if stream:  # the server closes a stream's connection: the next request opens a new one
            texts[rid] = "".join(e["choices"][0]["text"] for e in sse_events(data))
            conn.close()
            conn = None
        else:
            texts[rid] = json.loads(data)["choices"][0]["text"]
    if conn is not None:
        conn.close()


def run_clients(host: str, port: int, model: str, requests: list[tuple[str, list[int], int]], concurrency: int,
                stream: bool) -> tuple[float, dict[str, str], list[str]]:
    """``concurrency`` client threads share ``requests``; returns the wall time from the first request to the last
    answer, each request's text, and the errors. Runs in the clients' own process."""
    texts: dict[str, str] = {}
    errors: list[str] = []
    seconds = run_threads(requests, concurrency, lambda jobs: _client(host, port, model, jobs, stream, texts, errors))
    return seconds, texts, errors


def run_http(llm, workload: Workload, concurrency: int, stream: bool, pool: ProcessPoolExecutor) -> dict[str, Any]:
    """The same closed loop through a server on a free local port, the clients in ``pool``'s process."""
    from minifer.entrypoints.openai.serve import start_server

    requests = [(r.request_id, r.prompt_token_ids, r.max_tokens) for r in workload.requests]
    with start_server(llm, port=0, model_name="m") as server:
        host, port = server.url.removeprefix("http://").split(":")
        seconds, texts, errors = pool.submit(run_clients, host, int(port), "m", requests, concurrency,
                                             stream).result()
        peak = server.loop.peak_in_flight
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, e.g. {errors[0]}")
    return {"seconds": seconds, "texts": texts, "peak_in_flight": peak}


def run_mode(llm, mode: str, workload: Workload, concurrency: int, pool: ProcessPoolExecutor) -> dict[str, Any]:
    """One run of ``mode``, with the CPU seconds this process spent on it (the clients run in another)."""
    cpu = time.process_time()
    if mode == "direct":
        res = run_direct(llm, workload, concurrency)
    else:
        res = run_http(llm, workload, concurrency, stream=mode == "http-stream", pool=pool)
    return {**res, "cpu_seconds": time.process_time() - cpu}


def measure(llm, workload: Workload, *, concurrency: int = 16, rounds: int = 3, seed: int = 0) -> dict[str, Any]:
    """Each round runs every mode once, in a shuffled order; the ratios to ``direct`` are taken per round (runs
    close in time on a shared machine), then their median. A warm-up run of each mode comes first."""
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return _measure(llm, workload, concurrency, rounds, seed, pool)


def _measure(llm, workload: Workload, concurrency: int, rounds: int, seed: int,
             pool: ProcessPoolExecutor) -> dict[str, Any]:
    small = Workload(workload.name, workload.requests[: max(2, concurrency)])
    for mode in MODES:
        run_mode(llm, mode, small, concurrency, pool)
    out_tokens = sum(r.max_tokens for r in workload.requests)
    rng = random.Random(seed)
    per_round, reference = [], None
    for _ in range(rounds):
        order = list(MODES)
        rng.shuffle(order)
        row: dict[str, Any] = {"order": order}
        for mode in order:
            res = run_mode(llm, mode, workload, concurrency, pool)
            if reference is None and mode == "direct":
                reference = res["texts"]
            row[mode] = {"seconds": res["seconds"], "tokens_per_s": out_tokens / res["seconds"],
                         "cpu_seconds": res["cpu_seconds"], "peak_in_flight": res.get("peak_in_flight"),
                         "texts": res["texts"]}
        per_round.append(row)
    reference = reference or per_round[0]["direct"]["texts"]
    same = {m: all(r[m]["texts"] == reference for r in per_round) for m in MODES}
    for r in per_round:
        for m in MODES:
            del r[m]["texts"]
    ratios = {m: [r[m]["tokens_per_s"] / r["direct"]["tokens_per_s"] for r in per_round] for m in MODES[1:]}
    cpu = {m: [r["direct"]["cpu_seconds"] / r[m]["cpu_seconds"] for r in per_round] for m in MODES[1:]}
    return {
        "workload": workload.summary(), "concurrency": concurrency, "rounds": per_round, "same_text": same,
        "tokens_per_s": {m: statistics.median(r[m]["tokens_per_s"] for r in per_round) for m in MODES},
        "throughput_vs_direct": {m: statistics.median(v) for m, v in ratios.items()},
        "throughput_vs_direct_rounds": ratios,
        # the server process's CPU seconds for the same work, direct's over each mode's (1: the server adds none)
        "cpu_vs_direct": {m: statistics.median(v) for m, v in cpu.items()}, "cpu_vs_direct_rounds": cpu,
    }


def plot(result: dict[str, Any]):
    """Output tokens/s of each mode (median bar, one dot per round)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.2))
    for i, m in enumerate(MODES):
        vals = [r[m]["tokens_per_s"] for r in result["rounds"]]
        ax.bar(i, result["tokens_per_s"][m], color=("tab:blue", "tab:orange", "tab:red")[i], alpha=0.7)
        ax.plot([i] * len(vals), vals, "k.", ms=5)
        if m != "direct":
            ax.text(i, result["tokens_per_s"][m], f"{result['throughput_vs_direct'][m]:.2f}x", ha="center",
                    va="bottom", fontsize=8)
    ax.set_xticks(range(len(MODES)), MODES)
    ax.set(ylabel="output tokens / s", title=f"the same engine, {result['concurrency']} clients in a closed loop")
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m minifer_course.experiments.server_overhead",
                                 description=__doc__.split("\n\n")[0])
    add_workload_args(ap, "server_overhead")
    ap.add_argument("--concurrency", type=int, default=16, help="clients, and the engine's max_num_seqs")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    llm, workload = setup(args, args.concurrency)
    result = measure(llm, workload, concurrency=args.concurrency, rounds=args.rounds, seed=args.seed)
    result, path = write("server_overhead", "minifer_course.experiments.server_overhead", args, argv, result, plot)
    for m in MODES:
        extra = f" ({result['throughput_vs_direct'][m]:.3f}x direct)" if m != "direct" else ""
        cpu = f"; CPU {result['cpu_vs_direct'][m]:.3f}x direct's" if m != "direct" else ""
        print(f"{m:12s} {result['tokens_per_s'][m]:8.1f} output tokens/s{extra}{cpu}; same text: "
              f"{result['same_text'][m]}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
