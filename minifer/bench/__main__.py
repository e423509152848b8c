"""``python -m minifer.bench``: serving benchmarks from the command line.

    python -m minifer.bench throughput --num-requests 512 --modes static continuous hf
    python -m minifer.bench serve --rate 1 2 4 8 --num-requests 128
    python -m minifer.bench bound --output exp:64:4:256 uniform:4:256 fixed:64
    python -m minifer.bench profile --num-requests 128
    python -m minifer.bench plot runs/throughput.json runs/serve.json
    python -m minifer.bench cpu_peer --num-requests 512   # against CTranslate2 (an optional peer)

Every command writes a JSON (``--out``, default ``runs/<command>.json``, git-ignored) with the hardware,
versions, git commit, command line and workload parameters; ``plot`` draws PNGs from such files.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch


def _add_workload_args(p: argparse.ArgumentParser, num_requests: int) -> None:
    g = p.add_argument_group("workload (seeded; see minifer.bench.workloads)")
    g.add_argument("--num-requests", "-n", type=int, default=num_requests)
    g.add_argument("--input", default="uniform:8:32",
                   help="prompt lengths incl. BOS: fixed:N | uniform:LO:HI | exp:MEAN:LO:HI | "
                        "lognormal:MEAN:SIGMA:LO:HI | sharegpt (default %(default)s)")
    g.add_argument("--output", default="exp:64:4:256", help="output lengths, same syntax (default %(default)s)")
    g.add_argument("--seed", type=int, default=0)


def _add_engine_args(p: argparse.ArgumentParser, modes: list[str]) -> None:
    g = p.add_argument_group("engines")
    g.add_argument("--model", default="tinystories-target", help="bundled name, local folder or hub id")
    g.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    g.add_argument("--dtype", default="auto")
    g.add_argument("--modes", nargs="+", default=modes, choices=["static", "continuous", "hf"])
    g.add_argument("--max-num-seqs", type=int, default=16, help="batch slots of minifer's engines")
    g.add_argument("--hf-batch-size", type=int, default=16, help="padded batch size of transformers' generate")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--no-chunked-prefill", action="store_true")
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--repeats", type=int, default=3, help="rounds; engines alternate within each round")
    g.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: see roofline.default_threads)")
    g.add_argument("--no-warmup", action="store_true")
    g.add_argument("--no-progress", action="store_true", help="no tqdm bars")
    g.add_argument("--out", default=None, help="JSON path (default runs/<command>.json)")
    g.add_argument("--plot", action="store_true", help="also draw the PNG next to the JSON")


def _setup(args):
    from minifer import LLM
    from minifer.bench.machine import default_threads

    torch.set_num_threads(args.threads or default_threads())
    llm = LLM(args.model, device=args.device, dtype=args.dtype, max_num_seqs=args.max_num_seqs)
    return llm


def _workload(args, llm, rate: float = math.inf):
    from minifer.bench.workloads import make_workload

    bos = llm.tokenizer.bos_token_id if llm.tokenizer is not None else None
    return make_workload(args.num_requests, args.input, args.output, seed=args.seed,
                         vocab_size=llm.model_config.vocab_size, max_model_len=llm.max_model_len,
                         bos_token_id=bos, rate=rate)


def _config(args, llm) -> dict:
    return {"model": str(llm.model_path), "dtype": str(llm.dtype).replace("torch.", ""), "device": str(llm.device),
            "modes": args.modes, "max_num_seqs": args.max_num_seqs, "hf_batch_size": args.hf_batch_size,
            "max_num_batched_tokens": args.max_num_batched_tokens, "chunked_prefill": not args.no_chunked_prefill,
            "prefix_caching": not args.no_prefix_caching, "repeats": args.repeats,
            "torch_threads": torch.get_num_threads()}


def _engine_kw(args) -> dict:
    return {"max_num_batched_tokens": args.max_num_batched_tokens,
            "enable_chunked_prefill": not args.no_chunked_prefill,
            "enable_prefix_caching": not args.no_prefix_caching}


def _finish(args, result: dict, name: str) -> Path:
    from minifer.bench.serving import default_results_path, plot_file, save_result

    path = save_result(result, args.out or default_results_path(name))
    print(f"wrote {path}")
    if getattr(args, "plot", False):
        print(f"wrote {plot_file(path)}")
    return path


def cmd_throughput(args) -> int:
    from minifer.bench.serving import metadata, throughput_benchmark

    llm = _setup(args)
    meta = metadata(args.argv)  # the commit and time at the start of the run, after _setup set the threads
    w = _workload(args, llm)
    res = throughput_benchmark(llm, w, modes=args.modes, repeats=args.repeats, max_num_seqs=args.max_num_seqs,
                               hf_batch_size=args.hf_batch_size, warmup=not args.no_warmup,
                               progress=not args.no_progress, engine_kw=_engine_kw(args))
    result = {"kind": "throughput", "metadata": meta, "config": _config(args, llm), **res}
    b = res["step_bound"]
    print(f"step bound ({b['slots']} slots): static {b['static_steps']} / continuous {b['continuous_steps']} "
          f"= {b['ratio']:.3f}x")
    for m, s in res["summary"]["per_mode"].items():
        print(f"{m:>10}: {s['output_throughput']:8.1f} output tok/s (median; min {s['output_throughput_min']:.1f}, "
              f"max {s['output_throughput_max']:.1f}), {s['request_throughput']:.2f} req/s, {s['steps']:.0f} steps, "
              f"{s['ms_per_step']:.2f} ms/step")
    for k, r in res["summary"]["ratios"].items():
        extra = ""
        if "bound" in r:
            extra = (f" = {r['fraction_of_bound']:.0%} of the bound {r['bound']:.2f}x "
                     f"(steps {r['measured_step_ratio']:.2f}x, time/step {r['step_time_ratio']:.2f}x)")
        print(f"{k}: {r['median_of_round_ratios']:.2f}x (median of rounds; ratio of medians "
              f"{r['ratio_of_medians']:.2f}x){extra}")
    _finish(args, result, "throughput.json")
    return 0


def cmd_serve(args) -> int:
    from minifer.bench.serving import metadata, serve_benchmark

    llm = _setup(args)
    meta = metadata(args.argv)  # after _setup: the metadata records the thread count the run used
    res = serve_benchmark(llm, lambda rate: _workload(args, llm, rate), args.rate, modes=args.modes,
                          repeats=args.repeats, max_num_seqs=args.max_num_seqs, hf_batch_size=args.hf_batch_size,
                          warmup=not args.no_warmup, progress=not args.no_progress, engine_kw=_engine_kw(args))
    result = {"kind": "serve", "metadata": meta, "config": _config(args, llm), **res}
    _finish(args, result, "serve.json")
    return 0


def cmd_bound(args) -> int:
    from minifer.bench.serving import bound_curve, metadata

    curves = {spec: bound_curve(args.num_requests, spec, args.slots, seeds=range(args.seeds)) for spec in args.output}
    for spec, rows in curves.items():
        print(spec + ": " + ", ".join(f"n={r['num_requests']} {r['ratio_mean']:.2f}x" for r in rows))
    result = {"kind": "bound", "metadata": metadata(args.argv), "slots": args.slots, "seeds": args.seeds,
              "curves": curves}
    _finish(args, result, "bound.json")
    return 0


def cmd_profile(args) -> int:
    from minifer.bench.serving import metadata, profile_modes

    llm = _setup(args)
    meta = metadata(args.argv)  # after _setup: the metadata records the thread count the run used
    w = _workload(args, llm)
    res = profile_modes(llm, w, modes=args.modes, max_num_seqs=args.max_num_seqs, engine_kw=_engine_kw(args),
                        top=args.top)
    result = {**res, "metadata": meta, "config": _config(args, llm), "workload": w.summary()}
    _finish(args, result, "profile.json")
    return 0


def cmd_cpu_peer(args) -> int:
    from minifer.bench import cpu_peer
    from minifer.bench.serving import metadata

    torch.set_num_threads(1)
    meta = metadata(args.argv)
    _finish(args, {"metadata": meta, **cpu_peer.run_args(args)}, "cpu_peer.json")
    return 0


def cmd_plot(args) -> int:
    from minifer.bench.serving import plot_file

    for f in args.files:
        out = Path(args.out_dir) / (Path(f).stem + ".png") if args.out_dir else None
        print(f"wrote {plot_file(f, out)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minifer.bench", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("throughput", help="offline throughput: every request at t=0")
    _add_workload_args(p, 512)
    _add_engine_args(p, ["static", "continuous"])
    p.set_defaults(func=cmd_throughput)

    p = sub.add_parser("serve", help="Poisson arrivals at each --rate: TTFT, TPOT, ITL, E2E, throughput")
    p.add_argument("--rate", type=float, nargs="+", required=True, help="requests per second (several: a sweep)")
    _add_workload_args(p, 128)
    _add_engine_args(p, ["static", "continuous"])
    p.set_defaults(func=cmd_serve, repeats=2)  # two rounds at least, the engines' order alternating

    p = sub.add_parser("bound", help="the scheduler-step bound against the number of requests")
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--num-requests", "-n", type=int, nargs="+", default=[16, 32, 64, 128, 256, 512, 1024, 2048])
    p.add_argument("--output", nargs="+",
                   default=["fixed:64", "uniform:4:124", "exp:64:4:256", "lognormal:64:1.5:4:1000"])
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--out", default=None)
    p.add_argument("--plot", action="store_true")
    p.set_defaults(func=cmd_bound)

    p = sub.add_parser("profile", help="cProfile one run of each engine; time by component")
    _add_workload_args(p, 128)
    _add_engine_args(p, ["static", "continuous"])
    p.add_argument("--top", type=int, default=25)
    p.set_defaults(func=cmd_profile)

    from minifer.bench import cpu_peer

    p = sub.add_parser("cpu_peer", help="minifer vs CTranslate2 on the CPU (optional peer: pip install ctranslate2)")
    cpu_peer.add_arguments(p)
    p.set_defaults(func=cmd_cpu_peer)

    p = sub.add_parser("plot", help="draw PNGs from result JSON files")
    p.add_argument("files", nargs="+")
    p.add_argument("--out-dir", default=None, help="default: next to each JSON")
    p.set_defaults(func=cmd_plot)

    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
