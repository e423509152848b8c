"""Command line: ``python -m minifer doctor`` checks the installation."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m minifer", description="minifer command line")
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("doctor", help="check versions, device, Triton, bundled models and hub access")
    args = ap.parse_args(argv)
    if args.command == "doctor":
        from minifer.doctor import main as doctor

        return doctor()
    return 2


if __name__ == "__main__":
    sys.exit(main())
