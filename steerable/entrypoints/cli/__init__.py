"""The ``steerable`` command. Each verb lives in its own module with ``register(subparsers)``,
which adds its parser and sets ``func``; arguments are checked before any model is loaded."""

from __future__ import annotations

import argparse
import sys

import steerable
from steerable.entrypoints.cli import capture, dashboards, demo, generate, serve, vectors

VERBS = [generate, serve, vectors, capture, dashboards, demo]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="steerable", description="An LLM inference engine where activation "
                                     "steering and capture are first-class.")
    parser.add_argument("--version", action="version", version=f"steerable {steerable.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                help="what to do; 'steerable COMMAND --help' lists its options")
    for verb in VERBS:
        verb.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
