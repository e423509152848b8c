"""Command line: ``python -m minifer serve MODEL`` serves a model over an OpenAI-compatible HTTP API
(``minifer/entrypoints/openai/serve.py``). Whether an installation is ready for the course is the course's question:
``python -m minifer_course.doctor``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m minifer", description="minifer command line")
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API (serve MODEL --help)",
                   add_help=False)
    args, rest = ap.parse_known_args(argv)
    if args.command == "serve":
        from minifer.entrypoints.openai.serve import main as serve

        return serve(rest)
    return 2


if __name__ == "__main__":
    sys.exit(main())
