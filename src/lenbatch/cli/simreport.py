"""What `lenbatch simulate` and `lenbatch tune` share: their options, the run context
(settings, cost model, mapped trace, model limit) and the tables they print."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from lenbatch.cli.common import (
    adaptive_overrides,
    add_adaptive_options,
    add_batching_options,
    add_cost_option,
    add_trace_options,
    batching_overrides,
    load_cost_model,
    trace_from_args,
)
from lenbatch.config import BatchingConfig, Settings, load_settings
from lenbatch.core.buckets import default_boundaries
from lenbatch.plan.costmodel import CostModel
from lenbatch.plan.oracle import oracle_for
from lenbatch.plan.sim import SimRun, simulate
from lenbatch.plan.sweep import offered_rps
from lenbatch.plan.trace import Trace, map_trace

__all__ = [
    "MINILM_MAX_LENGTH",
    "SimContext",
    "add_sim_options",
    "f",
    "pct",
    "per_bucket",
    "settings_from_args",
    "side_by_side",
    "table",
]

MINILM_MAX_LENGTH = 256  # the bundled default model's limit


def add_sim_options(p: argparse.ArgumentParser) -> None:
    """TRACE and its mapping, --cost, --config, the serve batching flags, --concurrency,
    --truncate, --json: what a command that simulates a trace (`simulate`, `tune`) reads."""
    add_trace_options(p)
    add_cost_option(p, required=True)
    p.add_argument("--config", metavar="FILE", help="config file (.toml, .yaml) as for serve")
    add_batching_options(p)
    add_adaptive_options(p)
    p.add_argument(
        "--concurrency",
        type=int,
        metavar="N",
        help="batches the runner executes at once (batching.max_concurrent_batches)",
    )
    p.add_argument(
        "--truncate",
        action="store_true",
        default=None,
        help="truncate inputs over the model limit instead of rejecting them",
    )
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        metavar="N",
        help="seed of the draws of each batch's time from the cost model's calibrated spread "
        "(`lenbatch calibrate`; a cost model without one gives the same run for every seed; "
        "default 0)",
    )


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Config file, environment and flags merged as `serve` merges them, with the batch layout
    `serve` would pick on this machine where none is given (`Settings.with_cpu_layout`)."""
    from lenbatch.serving.workers import usable_cores

    overrides: dict[str, Any] = {
        "model": {"max_length": args.max_length, "truncate": args.truncate},
        "batching": {
            **batching_overrides(args),
            "max_concurrent_batches": args.concurrency,
        },
        "adaptive": adaptive_overrides(args),
    }
    return load_settings(args.config, os.environ, overrides).with_cpu_layout(usable_cores())


def _run_dtype(settings: Settings) -> str | None:
    """The float type `serve` would run these settings with (for `--cost auto`), or None
    where it cannot say (an unknown dtype is left to the runner to refuse)."""
    from lenbatch.runners.hardware import resolve_precision

    try:
        return resolve_precision(settings.model.dtype, settings.model.device).name
    except ValueError:
        return None


def _run_execution(settings: Settings) -> str | None:
    """The execution `serve` would run (None for `auto`, which depends on the model)."""
    return None if settings.model.execution == "auto" else settings.model.execution


@dataclass
class SimContext:
    """What every simulation report starts from: the trace, its mapping, the model limit, the
    cost model and the merged settings."""

    trace: Trace
    cost: CostModel
    settings: Settings
    max_length: int
    truncate: bool
    cost_path: str
    seed: int = 0  # of the draws from the cost model's batch spread

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> SimContext:
        """Load settings, cost model and the mapped trace the options describe."""
        settings = settings_from_args(args)
        trace = trace_from_args(args)
        if len(trace) == 0:
            raise ValueError("the trace (after mapping) has no requests")
        return cls(
            trace,
            load_cost_model(
                args.cost,
                settings.model.device,
                dtype=_run_dtype(settings),
                execution=_run_execution(settings),
                threads=settings.model.torch_threads,
            ),
            settings,
            settings.model.max_length or MINILM_MAX_LENGTH,
            settings.model.truncate,
            args.cost,
            getattr(args, "seed", 0),
        )

    def simulate(self, batching: BatchingConfig, scale: float = 1.0) -> SimRun:
        """Simulate `batching` on the trace (at `scale` x its rate) with these settings."""
        t = map_trace(self.trace, rate_scale=scale) if scale != 1.0 else self.trace
        return simulate(
            t, self.cost, batching, self.settings.admission, max_length=self.max_length,
            truncate=self.truncate, adaptive=self.settings.adaptive, seed=self.seed,
        )  # fmt: skip

    def header(self) -> str:
        """Trace, mapping, limit, cost model, batching settings and the oracle, one per line."""
        t = self.trace
        b = self.settings.batching
        lines = [
            f"trace: {t.source or '?'}: {len(t)} requests over {t.duration:.1f} s "
            f"({offered_rps(t):.2f} req/s offered)",
            "mapping: " + ("; ".join(t.notes) if t.notes else "none"),
            f"model limit: {self.max_length} tokens; longer inputs are "
            + ("truncated" if self.truncate else "rejected (413)"),
            f"cost model: {self.cost_path} ({self.cost.model or 'unnamed'} on "
            f"{self.cost.device}; fit error {self.cost.fit_error:.1%}"
            f"{_spread_note(self.cost, self.seed)})",
            f"batching: max_batch={b.max_batch} max_wait_ms={b.max_wait_ms:g} "
            f"max_batch_tokens={b.max_batch_tokens} concurrency={b.max_concurrent_batches} "
            f"prefetch={b.prefetch_batches}",
        ]
        if b.boundaries is None:
            lines.append(
                f"boundaries: none given, so the engine's default "
                f"{list(default_boundaries(self.max_length))} (powers of two, not fitted "
                "to this traffic: run `lenbatch fit` or `lenbatch tune`)"
            )
        else:
            lines.append(f"boundaries: {list(b.boundaries)}")
        orc = oracle_for(
            t.input_lengths, self.cost, b, max_length=self.max_length, truncate=self.truncate
        )
        lines.append(
            f"oracle (all lengths known, sorted, no waiting): {orc.throughput_rps:.1f} req/s, "
            f"{orc.real_tokens_per_s:,.0f} real tokens/s; this trace offers "
            f"{offered_rps(t) / orc.throughput_rps:.0%} of it"
            if orc.throughput_rps > 0
            else "oracle: no admissible requests"
        )
        return "\n".join(lines)


def f(x: float | None, fmt: str = ".1f") -> str:
    """`x` formatted, or `-` for None."""
    return "-" if x is None else format(x, fmt)


def pct(x: float | None) -> str:
    """A fraction as a percentage, or `-`."""
    return "-" if x is None else f"{x:.1%}"


def _mean(values: Any) -> float | None:
    v = values[~np.isnan(values)]
    return float(v.mean()) if v.size else None


def side_by_side(runs: list[SimRun], names: list[str] | None = None) -> str:
    """The main figures of several runs, one column each (headed by strategy or `names`)."""
    sums = [r.summary() for r in runs]
    rows: list[tuple[str, list[str]]] = [
        ("strategy" if names is None else "config", names or [r.strategy.value for r in runs]),
        ("requests", [str(s["requests"]) for s in sums]),
        ("completed", [str(s["completed"]) for s in sums]),
        ("rejected", [str(s["rejected"]) for s in sums]),
        ("errors (expired)", [str(s["errors"]) for s in sums]),
        ("throughput req/s", [f(s["throughput_rps"], ".2f") for s in sums]),
        ("real tokens/s", [f(s["real_tokens_per_s"], ",.0f") for s in sums]),
        ("P50 ms", [f(s["p50_ms"]) for s in sums]),
        ("P95 ms", [f(s["p95_ms"]) for s in sums]),
        ("P99 ms", [f(s["p99_ms"]) for s in sums]),
        ("queue wait mean ms", [f(_ms(_mean(r.waits))) for r in runs]),
        ("queue wait P95 ms", [f(s["queue_wait_p95_ms"]) for s in sums]),
        ("execution mean ms", [f(_ms(_mean(r.execs))) for r in runs]),
        ("mean batch size", [f(s["mean_batch_size"]) for s in sums]),
        ("padding waste", [pct(s["padding_waste"]) for s in sums]),
        ("peak memory MB", [f(s["peak_memory_mb"]) for s in sums]),
    ]
    if any(r.refit is not None for r in runs):  # the online re-fit ran in some column
        rows.append(("re-fits", ["-" if r.refit is None else str(r.refit["refits"]) for r in runs]))
        rows.append(
            (
                "boundaries at the end",
                ["-" if r.refit is None else ",".join(map(str, r.cfg.boundaries)) for r in runs],
            )
        )
    reasons = [", ".join(f"{k} {v}" for k, v in sorted(r.rejections.items())) for r in runs]
    if any(reasons):
        rows.append(("rejected because", [x or "-" for x in reasons]))
    return table(rows)


def _ms(x: float | None) -> float | None:
    return None if x is None else 1000 * x


def table(rows: list[tuple[str, list[str]]]) -> str:
    """Rows of (name, one value per column), right-aligned."""
    w0 = max(len(name) for name, _ in rows)
    widths = [max(len(vals[i]) for _, vals in rows) for i in range(len(rows[0][1]))]
    return "\n".join(
        name.ljust(w0) + "  " + "  ".join(v.rjust(w) for v, w in zip(vals, widths, strict=True))
        for name, vals in rows
    )


def per_bucket(run: SimRun, title: str | None = None) -> str:
    """Per-bucket table of one run."""
    s = run.summary()
    head = [
        "bucket", "requests", "done", "rejected", "P50", "P95", "P99",
        "wait mean", "exec mean", "batches", "mean batch", "waste",
    ]  # fmt: skip
    body = [
        [
            b["bucket"],
            str(b["requests"]),
            str(b["completed"]),
            str(b["rejected"]),
            f(b["p50_ms"]),
            f(b["p95_ms"]),
            f(b["p99_ms"]),
            f(b["queue_wait_mean_ms"]),
            f(b["exec_mean_ms"]),
            str(b["batches"]),
            f(b["mean_batch_size"]),
            pct(b["padding_waste"]),
        ]
        for b in s["per_bucket"]
    ]
    cols = list(zip(head, *body, strict=True))
    widths = [max(len(c) for c in col) for col in cols]
    lines = [f"{title or run.strategy.value}, per bucket (latencies in ms):"]
    for row in [head, *body]:
        lines.append("  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)))
    return "\n".join(lines)


def _spread_note(cost: CostModel, seed: int) -> str:
    """How the simulated batch times vary, for the report's cost-model line."""
    if not cost.batch_spread:
        return "; every batch takes its predicted time (no calibrated spread)"
    return (
        f"; each batch's time drawn from x{cost.spread_factor(0.1):.2f}-"
        f"x{cost.spread_factor(0.9):.2f} its prediction (P10-P90), seed {seed}"
    )
