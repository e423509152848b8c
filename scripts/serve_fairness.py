"""Issue 48's fairness cases through a live server, as JSON (noisy single runs: seconds on a shared CPU).

    python scripts/serve_fairness.py [--model tinystories-target] [--tokens 200] [-- extra serve flags]

Starts ``python -m minifer serve`` in a subprocess (whatever ``minifer`` the environment imports: set PYTHONPATH
to a checkout to measure it) and measures:

- ``stop_strings``: another stream's worst and median inter-token gap alone, then beside a request with
  10,000 stop strings and n=8 (the stop check once ran over every stop string per token on the engine thread);
- ``big_n``: time to first token of a request sent 2 s after an n=16 request, with max_num_seqs=16 (the n
  completions once held every slot until they finished);
- ``long_prompts``: another stream's worst gap while eight 1,000-token prompts prefill.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
import urllib.request


def start(model: str, extra: list[str]) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "minifer", "serve", model, "--port", "0", "--served-model-name",
                             "m", "--max-num-seqs", "16", "--max-model-len", "1024", "--disable-uvicorn-access-log",
                             "--uvicorn-log-level", "warning", *extra],
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    line = proc.stdout.readline()
    if not line.startswith("serving http://"):
        proc.kill()
        raise SystemExit(f"the server did not start: {line!r}")
    return proc, line.split()[1].removesuffix("/v1")


def post(url: str, body: dict) -> bytes:
    req = urllib.request.Request(url + "/v1/completions", json.dumps({"model": "m", **body}).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return r.read()


def stream_times(url: str, body: dict) -> list[float]:
    """When each event of a streamed completion arrived (seconds since it was sent)."""
    req = urllib.request.Request(url + "/v1/completions", json.dumps({"model": "m", "stream": True, **body}).encode(),
                                 {"Content-Type": "application/json"})
    t0, times = time.perf_counter(), []
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if line.startswith(b"data: {"):
                times.append(time.perf_counter() - t0)
    return times


def gaps(times: list[float]) -> dict[str, float]:
    d = [b - a for a, b in zip(times, times[1:])]
    return {"worst_gap_s": round(max(d), 4), "median_gap_s": round(statistics.median(d), 4)}


def staggered(first, delay: float, second) -> tuple:
    """``first()`` and ``second()``'s results, ``second`` started ``delay`` seconds after ``first``."""
    out = {}
    t = threading.Thread(target=lambda: out.update(first=first()))
    t.start()
    time.sleep(delay)
    try:
        out["second"] = second()
    finally:
        t.join()
    return out["first"], out["second"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tinystories-target")
    ap.add_argument("--tokens", type=int, default=200, help="tokens of the probing stream")
    args, extra = ap.parse_known_args()
    proc, url = start(args.model, [a for a in extra if a != "--"])
    try:
        probe = {"prompt": "Once upon a time", "max_tokens": args.tokens, "ignore_eos": True}
        post(url, {"prompt": "Tom", "max_tokens": 4})  # warm up
        alone = gaps(stream_times(url, probe))
        stops = {"prompt": "Tom", "n": 8, "max_tokens": 400, "ignore_eos": True,
                 "stop": [f"zq{i}xv" for i in range(10_000)]}
        with_stops = gaps(staggered(lambda: post(url, stops), 0.5, lambda: stream_times(url, probe))[1])
        big = {"prompt": "Lily", "n": 16, "max_tokens": 600, "ignore_eos": True}
        ttft = staggered(lambda: post(url, big), 2.0, lambda: stream_times(url, {**probe, "max_tokens": 4}))[1][0]
        rng = random.Random(0)
        long = {"prompt": [[rng.randrange(3, 2000) for _ in range(1000)] for _ in range(8)], "max_tokens": 1}
        with_long = gaps(staggered(lambda: stream_times(url, probe), 0.5, lambda: post(url, long))[0])
        print(json.dumps({"stop_strings": {"alone": alone, "beside_10000_stops_n8": with_stops},
                          "big_n": {"ttft_s_2s_after_n16": round(ttft, 3)},
                          "long_prompts": {"beside_8x1000_prefill": with_long}}, indent=1))
    finally:
        proc.terminate()
        proc.wait(timeout=60)


if __name__ == "__main__":
    main()
