"""Latency through the server as concurrency grows: time to first token (TTFT) and inter-token latency (ITL) as
a streaming client sees them, at 1, 2, 4, ... clients in a closed loop (each sends its next request when its
stream ends), against one ``python -m minifer serve``-equivalent server in this process.

The clients run in a separate process, as they would on other machines (on a 2-core machine they still share
its CPUs), and time each event on arrival: TTFT from sending the request to the first ``data:`` event, ITL the
gaps between later events (one token each here: no stop strings, no speculation). This is what a user of the
server waits for, including everything the server adds to the engine: the event loop, the request-side
tokenizer worker, JSON and the socket. ``minifer_course.experiments.server_overhead`` prices the same layer in
throughput.

    python -m minifer.bench.server_sweep --concurrency 1 2 4 8 16 --out benchmarks/results/server_sweep.json --plot
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing
import queue
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import torch

from minifer.bench.machine import default_threads
from minifer.bench.provenance import metadata, save_result
from minifer.bench.serving import default_results_path, describe
from minifer.bench.workloads import Workload, make_workload


def _stream_client(host: str, port: int, model: str, jobs: queue.Queue, ttfts: list[float], itls: list[float],
                   errors: list[str]) -> None:
    """One client: streams the requests ``(prompt ids, max_tokens)`` it takes from ``jobs``, one after another."""
    conn = http.client.HTTPConnection(host, port, timeout=600)
    while True:
        try:
            prompt, max_tokens = jobs.get_nowait()
        except queue.Empty:
            break
        body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                           "ignore_eos": True, "stream": True})
        sent = time.perf_counter()
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            errors.append(f"HTTP {resp.status} {resp.read()[:200]!r}")
            continue
        times = []
        while line := resp.readline():
            if line.startswith(b"data: [DONE]"):
                resp.read()
                break
            if line.startswith(b"data: "):
                times.append(time.perf_counter())
        if len(times) != max_tokens:
            errors.append(f"{len(times)} events for {max_tokens} tokens")
        ttfts.append(times[0] - sent)
        itls.extend(b - a for a, b in zip(times, times[1:]))
    conn.close()


def run_clients(host: str, port: int, model: str, requests: list[tuple[list[int], int]],
                concurrency: int) -> dict[str, Any]:
    """``concurrency`` streaming clients share ``requests``; runs in the clients' own process."""
    ttfts: list[float] = []
    itls: list[float] = []
    errors: list[str] = []
    seconds = run_threads(requests, concurrency, lambda jobs: _stream_client(host, port, model, jobs, ttfts, itls,
                                                                             errors))
    return {"seconds": seconds, "ttft": ttfts, "itl": itls, "errors": errors}


def run_threads(requests: list, concurrency: int, client) -> float:
    """``concurrency`` threads each run ``client(jobs)`` on one shared queue of ``requests``; returns the wall time
    from their start to the last one's end."""
    jobs: queue.Queue = queue.Queue()
    for r in requests:
        jobs.put(r)
    clients = [threading.Thread(target=client, args=(jobs,)) for _ in range(concurrency)]
    start = time.perf_counter()
    for c in clients:
        c.start()
    for c in clients:
        c.join()
    return time.perf_counter() - start


def sweep(llm, workload: Workload, concurrencies: list[int]) -> dict[str, Any]:
    """Each concurrency in turn, after a warm-up, through one server over ``llm``."""
    from minifer.entrypoints.openai.serve import start_server

    requests = [(r.prompt_token_ids, r.max_tokens) for r in workload.requests]
    out_tokens = sum(r.max_tokens for r in workload.requests)
    rows = []
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool, \
            start_server(llm, port=0, model_name="m") as server:
        host, port = server.url.removeprefix("http://").split(":")
        pool.submit(run_clients, host, int(port), "m", requests[: max(concurrencies)], max(concurrencies)).result()
        for c in concurrencies:
            server.loop.peak_in_flight = 0
            res = pool.submit(run_clients, host, int(port), "m", requests, c).result()
            if res["errors"]:
                raise RuntimeError(f"{len(res['errors'])} requests failed at concurrency {c}, e.g. {res['errors'][0]}")
            rows.append({"concurrency": c, "ttft_s": describe(res["ttft"]), "itl_s": describe(res["itl"]),
                         "output_tokens_per_s": out_tokens / res["seconds"], "seconds": res["seconds"],
                         "peak_in_flight": server.loop.peak_in_flight})
    return {"workload": workload.summary(), "concurrency": rows}


def plot(result: dict[str, Any]):
    """TTFT and ITL (p50 with a p90 whisker) against concurrency."""
    import matplotlib.pyplot as plt

    rows = result["concurrency"]
    cs = [r["concurrency"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    for ax, key, title in zip(axes, ("ttft_s", "itl_s"), ("time to first token", "inter-token latency")):
        p50 = [r[key]["p50"] * 1e3 for r in rows]
        p90 = [r[key]["p90"] * 1e3 for r in rows]
        ax.plot(cs, p50, "o-", label="p50")
        ax.plot(cs, p90, "s--", label="p90")
        ax.set(xscale="log", xlabel="concurrent streaming clients", ylabel="ms", title=title)
        ax.set_xticks(cs, [str(c) for c in cs])
        ax.legend()
    fig.tight_layout()
    return fig


def add_workload_args(ap: argparse.ArgumentParser, name: str) -> None:
    """The flags the server benchmarks share (this one and ``minifer_course.experiments.server_overhead``): the
    model, the workload, the device, the output."""
    ap.add_argument("--model", default="tinystories-target")
    ap.add_argument("-n", "--num-requests", type=int, default=64)
    ap.add_argument("--input", default="fixed:16", help="prompt lengths (workload spec)")
    ap.add_argument("--output", default="fixed:64", help="output lengths (workload spec)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", default=str(default_results_path(f"{name}.json")))
    ap.add_argument("--plot", action="store_true", help="also write the figure next to the JSON (.png)")


def setup(args: argparse.Namespace, max_num_seqs: int):
    """The model (on this benchmark's thread count) and the workload the flags ask for."""
    from minifer import LLM

    torch.set_num_threads(default_threads())
    llm = LLM(args.model, device=args.device, max_num_seqs=max_num_seqs)
    workload = make_workload(args.num_requests, args.input, args.output, seed=args.seed,
                             vocab_size=llm.model_config.vocab_size, max_model_len=llm.max_model_len)
    return llm, workload


def write(kind: str, module: str, args: argparse.Namespace, argv: list[str] | None, result: dict[str, Any],
          plot_fn):
    """Save ``result`` with its metadata (taken after the thread count is set; the command as ``python -m
    MODULE``) and, with ``--plot``, its figure."""
    result = {"kind": kind, "metadata": metadata(argv, module), "model": args.model, **result}
    path = save_result(result, args.out)
    if args.plot:
        plot_fn(result).savefig(path.with_suffix(".png"), dpi=110)
    return result, path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m minifer.bench.server_sweep", description=__doc__.split("\n\n")[0])
    add_workload_args(ap, "server_sweep")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    args = ap.parse_args(argv)
    llm, workload = setup(args, max(args.concurrency))
    result, path = write("server_sweep", "minifer.bench.server_sweep", args, argv,
                         sweep(llm, workload, sorted(args.concurrency)), plot)
    for r in result["concurrency"]:
        print(f"{r['concurrency']:3d} clients: TTFT p50 {r['ttft_s']['p50'] * 1e3:7.1f} ms, p90 "
              f"{r['ttft_s']['p90'] * 1e3:7.1f} ms; ITL p50 {r['itl_s']['p50'] * 1e3:6.1f} ms, p90 "
              f"{r['itl_s']['p90'] * 1e3:6.1f} ms; {r['output_tokens_per_s']:7.1f} output tokens/s")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
