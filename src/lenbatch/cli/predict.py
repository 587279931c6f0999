"""`bench --cost FILE`: the simulator's prediction of each strategy's run, beside the live one.

The prediction replays the very plan the bench sends (same offsets, the bodies' real token
lengths) through `lenbatch.plan.sim.simulate` with the batching settings each `lenbatch serve`
process gets (parsed by `serve`'s own option parser, so they cannot drift apart).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence
from typing import Any

from lenbatch.cli.common import load_cost_model
from lenbatch.cli.traffic import Traffic
from lenbatch.config import BatchingConfig, Settings
from lenbatch.plan.trace import Trace

__all__ = ["batching_for", "make_predictor", "serve_settings"]

SimulateFn = Callable[..., Any]  # lenbatch.plan.sim.simulate(trace, cost, batching, ...) -> SimRun


def batching_for(
    strategy: str, max_batch: int, max_wait_ms: float, serve_args: Sequence[str]
) -> BatchingConfig:
    """The `BatchingConfig` that `lenbatch serve --strategy S ... SERVE_ARGS` runs with."""
    return serve_settings(
        ["--strategy", strategy, "--max-batch", str(max_batch),
         "--max-wait-ms", f"{max_wait_ms:g}", *serve_args]
    ).batching  # fmt: skip


def serve_settings(serve_argv: Sequence[str]) -> Settings:
    """The settings `lenbatch serve SERVE_ARGV` runs with an encoder alone on this machine
    (the arguments after `serve`, as a bench run record stores them)."""
    from lenbatch.cli import serve
    from lenbatch.serving.workers import usable_cores

    parser = argparse.ArgumentParser()
    serve.register(parser.add_subparsers())
    args = parser.parse_args(["serve", *serve_argv])
    # The environment is part of what `serve` reads; the bench's servers inherit it.
    return serve.settings_from_args(args).with_cpu_layout(usable_cores())


def make_predictor(
    args: argparse.Namespace,
    traffic: Traffic,
    serve_args: Sequence[str],
    simulate: SimulateFn | None = None,
    threads: int | None = None,
) -> tuple[Callable[[str, float], dict[str, Any] | None], str]:
    """(predictor, note for the report). `simulate` defaults to `lenbatch.plan.sim.simulate`;
    `threads` is the torch thread count the servers run with, which the cost file's processor
    is checked against (default this process's)."""
    if simulate is None:
        try:
            from lenbatch.plan.sim import simulate as sim_simulate
        except ImportError:
            raise ValueError(
                "--cost needs the simulator (lenbatch.plan.sim), which this build does not have"
            ) from None
        simulate = sim_simulate
    cost = load_cost_model(args.cost, threads=threads)
    from lenbatch.replay.bodies import model_max_length

    limit = model_max_length(args.model) or 512
    plan = traffic.plan

    def predict(strategy: str, rate: float) -> dict[str, Any] | None:
        trace = Trace(
            input_lengths=plan.lengths,
            arrivals=plan.scheduled / rate,
            source="bench plan",
        )
        batching = batching_for(strategy, args.max_batch, args.max_wait_ms, serve_args)
        summary: dict[str, Any] = simulate(trace, cost, batching, max_length=limit).summary()
        return summary

    note = (
        f"Predictions: `lenbatch.plan.sim` with cost model {os.path.basename(args.cost)} "
        f"({cost.model or 'model not named'}, fit error {cost.fit_error:.1%}), on the same "
        "request offsets and real token lengths as the live runs."
    )
    return predict, note
