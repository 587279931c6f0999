#!/usr/bin/env python3
"""Every benchmark of lenbatch that is re-run, behind one command.

    bench/run.py list                                    # the recipes, one line each
    bench/run.py headline                                # the README's headline, as committed
    bench/run.py headline --peers none --sweep 16,32 --out /tmp/headline-1
    bench/run.py --dry-run llm-decode-peers              # print the commands, run nothing
    bench/run.py --rev 427fde8 runners-live --targets before   # the lenbatch of another commit
    bench/run.py soak -- --minutes 30 --out /tmp/soak.md       # a script, other arguments
    bench/run.py table ray-scaleout bench/results/ray-scaleout # a result's table again

The recipes are in `bench/recipes.py` (one function each, defaults from the committed result it
made), their steps in `bench/steps.py`, the tables they print in `bench/tables.py`. The runner
holds an exclusive lock on /tmp/lenbatch-bench.lock while a recipe runs, so two benchmarks never
share the CPU: do not wrap it in `flock` (or pass `--no-lock` when the caller holds the lock).
`lenbatch bench` takes the same lock by itself; the recipe's steps see
`LENBATCH_BENCH_LOCK_HELD=1` and do not take it again.
Every command runs from the repository root, offline (no model hub), with the lenbatch of this
tree (`PYTHONPATH=src`) or of `--src DIR` / `--rev REV`. bench/README.md lists the recipes with
what they measure, how long they take and what they need.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its modules, when imported

import tables
from lenbatch.replay.cpulock import LOCK, exclusive_cpu
from recipes import COST, RECIPES
from steps import ROOT, Action, Step

__all__ = ["LOCK", "build_parser", "main", "plan"]

# Every command runs offline and without Ray's usage report.
BASE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0"}


def table_text(kind: str, paths: Sequence[str], slo_ms: float, cost: str) -> str:
    """The table `kind` (one of `tables.TABLES`) of result files already written."""
    files = [Path(p) for p in paths]
    if kind == "llm-decode":
        return tables.llm_decode_table(files)
    if kind == "ray-scaleout":
        return tables.ray_scaleout_table(files, slo_ms)
    if kind == "runners-live":
        return "\n\n".join(tables.runners_live_table(p) for p in files)
    if kind == "before-after":
        return "\n\n".join(tables.before_after_table(p) for p in files)
    runs = [tables.AdaptiveRun.parse(p) for p in paths]
    return tables.adaptive_live_table(runs, Path(cost), slo_ms)


@contextlib.contextmanager
def source_tree(args: argparse.Namespace) -> Iterator[tuple[str, list[Step]]]:
    """The `src` folder the commands import lenbatch from, and the steps that make it: this
    tree's, `--src DIR`, or `--rev REV` unpacked from git into a temporary folder."""
    if args.src:
        yield str(Path(args.src).resolve()), []
    elif not args.rev:
        yield str(ROOT / "src"), []
    else:
        with tempfile.TemporaryDirectory(prefix="lenbatch-rev-") as tmp:
            unpack = f"git archive {shlex.quote(args.rev)} src | tar -x -C {tmp}"

            def work(env: dict[str, str]) -> None:
                subprocess.run(unpack, shell=True, cwd=ROOT, check=True)

            yield f"{tmp}/src", [Action(unpack, work)]


def build_parser() -> argparse.ArgumentParser:
    """`bench/run.py [--dry-run] [--no-lock] [--src DIR | --rev REV] RECIPE [flags]`."""
    common = argparse.ArgumentParser(add_help=False)
    for flag, help in (
        ("--dry-run", "print the commands, run nothing"),
        ("--no-lock", f"do not take {LOCK} (the caller holds it)"),
    ):
        common.add_argument(flag, action="store_true", default=argparse.SUPPRESS, help=help)
    tree = common.add_mutually_exclusive_group()
    for flag, metavar, help in (
        ("--src", "DIR", "run the lenbatch of this src folder instead of this tree's"),
        ("--rev", "REV", "run the lenbatch of this git revision (unpacked to a temp folder)"),
    ):
        tree.add_argument(flag, metavar=metavar, default=argparse.SUPPRESS, help=help)
    p = argparse.ArgumentParser(
        prog="bench/run.py",
        description=(__doc__ or "").split("\n\n")[0],
        parents=[common],
        epilog="See bench/README.md.",
    )
    sub = p.add_subparsers(dest="recipe", required=True, metavar="RECIPE")
    sub.add_parser("list", help="the recipes, one line each")
    t = sub.add_parser("table", help="a recipe's table again, from its result files")
    t.add_argument("kind", choices=tables.TABLES)
    t.add_argument("paths", nargs="+", help="result files or folders (see bench/tables.py)")
    t.add_argument("--slo-ms", type=float, default=1000.0, help="latency bound (default 1000)")
    t.add_argument("--cost", default=COST, help=f"adaptive-live: cost model (default {COST})")
    for r in RECIPES.values():
        rp = sub.add_parser(r.name, help=r.summary, description=r.summary, parents=[common])
        for add in r.options:
            add(rp)
        if r.script is not None:
            rp.add_argument(
                "script_args",
                nargs=argparse.REMAINDER,
                help=f"after `--`: arguments for bench/{r.script} instead of "
                f"{shlex.join(r.defaults) or 'none'}",
            )
    return p


def plan(argv: Sequence[str]) -> tuple[argparse.Namespace, list[Step]]:
    """The parsed arguments and the recipe's steps, nothing run (none for `list`, `table`)."""
    args = build_parser().parse_args(argv)
    # The shared flags may stand before or after the recipe; their defaults are set here, as a
    # parser default would be copied into every recipe's parser and undo the flag given first.
    for name, default in (("dry_run", False), ("no_lock", False), ("src", None), ("rev", None)):
        if not hasattr(args, name):
            setattr(args, name, default)
    if args.recipe in ("list", "table"):
        return args, []
    if getattr(args, "script_args", None) and args.script_args[0] == "--":
        args.script_args = args.script_args[1:]
    return args, RECIPES[args.recipe].build(args)


def main(argv: Sequence[str] | None = None) -> int:
    """Run a recipe (print its steps with --dry-run), list them, or print a table."""
    args, steps = plan(sys.argv[1:] if argv is None else argv)
    if args.recipe == "list":
        for r in RECIPES.values():
            print(f"{r.name:18s} {r.summary}")
        return 0
    if args.recipe == "table":
        print(table_text(args.kind, args.paths, args.slo_ms, args.cost))
        return 0
    with source_tree(args) as (src, prepare):
        env = {**BASE_ENV, "PYTHONPATH": src}
        if args.dry_run:
            print(f"# from {ROOT}, with " + " ".join(f"{k}={v}" for k, v in env.items()))
            for step in [*prepare, *steps]:
                print(step.describe())
            return 0
        with exclusive_cpu(not args.no_lock, "bench/run.py"):
            for step in [*prepare, *steps]:
                print(f"bench/run.py: {step.describe()}", file=sys.stderr, flush=True)
                step.run({**os.environ, **env})
    return 0


if __name__ == "__main__":
    sys.exit(main())
