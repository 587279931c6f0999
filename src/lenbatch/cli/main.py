"""The `lenbatch` script: the parser of every subcommand, and the entry point."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

__all__ = ["COMMANDS", "build_parser", "main"]

# Subcommand modules, in the order `--help` lists them.
COMMANDS = (
    "serve",
    "analyze",
    "fit",
    "profile",
    "simulate",
    "gensim",
    "tune",
    "replay",
    "bench",
    "calibrate",
)


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser (all subcommands)."""
    parser = argparse.ArgumentParser(
        prog="lenbatch",
        description="Length-bucketed dynamic batching for transformer models: serve, "
        "analyze traffic, fit buckets, profile, simulate and replay.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        module = importlib.import_module(f"lenbatch.cli.{name}")
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `lenbatch` script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    # The command line, for a command that re-executes the process (serve, to preload its
    # allocator): only when it is this process's own, so a call from other code (a test)
    # never replaces its caller.
    given = list(sys.argv[1:] if argv is None else argv)
    args.argv = given if given == sys.argv[1:] else None
    try:
        status: int = args.run(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"lenbatch {args.command}: error: {exc}", file=sys.stderr)
        return 2
    return status


if __name__ == "__main__":
    sys.exit(main())
