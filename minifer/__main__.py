"""Command line: ``python -m minifer doctor`` checks the installation; ``python -m minifer serve MODEL`` serves a
model over an OpenAI-compatible HTTP API (``minifer/serve.py``)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m minifer", description="minifer command line")
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("doctor", help="check versions, device, Triton, bundled models and hub access")
    sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API (serve MODEL --help)",
                   add_help=False)
    args, rest = ap.parse_known_args(argv)
    if args.command == "serve":
        from minifer.serve import main as serve

        return serve(rest)
    if rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "doctor":
        from minifer.doctor import main as doctor

        return doctor()
    return 2


if __name__ == "__main__":
    sys.exit(main())
