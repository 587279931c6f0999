"""Tune a bucketed config for a trace and a P95 SLO, by simulation.

The objective is the headline number of `lenbatch simulate --sweep`: the highest throughput the
config sustains with P95 within the SLO (see `lenbatch.plan.sweep.judge`), on the condition that the
trace at its own rate meets the SLO too. The search is staged, each stage keeping the best
config so far (the *incumbent*):

1. boundaries: every fit method (`lenbatch.plan.fitting`) for K = 2..6 buckets and `auto`;
2. one max wait for all buckets, from a grid up to half the SLO;
3. per lane (each bucket, then the overlong lane): its own max wait and max batch, one lane at
   a time (coordinate descent, one pass).

A candidate is first run at 2 % above the incumbent's capacity; only if it sustains that load
(and the trace's own rate) is its capacity searched by bisection up to 110 % of the oracle. So
most candidates cost one simulation, and a new incumbent is always measurably better.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lenbatch.config import AdmissionConfig, BatchingConfig, Strategy
from lenbatch.core.buckets import default_boundaries
from lenbatch.plan.costmodel import CostModel
from lenbatch.plan.fitting import FitMethod, fit_boundaries
from lenbatch.plan.oracle import Oracle, oracle_for
from lenbatch.plan.sweep import Probe, SweepPoint
from lenbatch.plan.trace import Trace

__all__ = [
    "DEFAULT_BATCHES",
    "DEFAULT_BUCKETS",
    "DEFAULT_WAITS_MS",
    "Candidate",
    "TuneResult",
    "settings_toml",
    "tune",
]

DEFAULT_BUCKETS = (2, 3, 4, 5, 6)
DEFAULT_WAITS_MS = (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0)
DEFAULT_BATCHES = (4, 8, 16, 32, 64)
IMPROVEMENT = 1.02  # a candidate must sustain 2 % more load than the incumbent
BISECT_STEPS = 6
HEADROOM = 1.1  # search capacity up to 110 % of the oracle


@dataclass
class Candidate:
    """One config tried, with what the search learned about it."""

    label: str
    batching: BatchingConfig
    at_target: SweepPoint | None = None  # the trace at its own rate
    capacity: SweepPoint | None = None  # highest sustainable point found
    beaten: bool = False  # failed the probe above the incumbent; capacity not searched

    @property
    def capacity_rps(self) -> float:
        """Sustainable throughput found (0 if none)."""
        return self.capacity.throughput_rps if self.capacity is not None else 0.0


@dataclass
class TuneResult:
    """The best config found, where the search started, and everything tried."""

    best: Candidate
    start: Candidate
    oracle: Oracle
    base_rps: float
    slo_p95_ms: float
    tried: list[Candidate] = field(default_factory=list)
    stages: list[str] = field(default_factory=list)  # one line per stage, for the report

    @property
    def met_slo(self) -> bool:
        """Whether any config met the SLO at the trace's own rate."""
        return self.best.capacity is not None


Progress = Callable[[Candidate], None]


class _Search:
    """The incumbent and the probing rules shared by the stages."""

    def __init__(self, probe: Probe, oracle: Oracle, progress: Progress | None, steps: int) -> None:
        self.probe = probe
        self.top = HEADROOM * oracle.throughput_rps / probe.base_rps  # highest scale tried
        self.progress = progress
        self.steps = steps
        self.tried: list[Candidate] = []
        self.best: Candidate | None = None

    def _bar(self) -> float:
        if self.best is None or self.best.capacity is None:
            return 1.0  # first, the trace at its own rate
        return self.best.capacity.rate_scale * IMPROVEMENT

    def consider(self, label: str, batching: BatchingConfig) -> Candidate:
        """Evaluate `batching`; it becomes the incumbent if it sustains more load."""
        for c in self.tried:
            if c.batching == batching:
                return c
        cand = Candidate(label, batching)
        self.tried.append(cand)
        bar = self._bar()
        first = self.probe(batching, bar)
        if bar == 1.0:
            cand.at_target = first
        if not first.sustainable:
            cand.beaten = self.best is not None and self.best.capacity is not None
        else:
            if cand.at_target is None:
                cand.at_target = self.probe(batching, 1.0)
            if cand.at_target.sustainable:
                cand.capacity = self._capacity(batching, first)
        if (
            self.best is None
            or cand.capacity_rps > self.best.capacity_rps
            # nothing meets the SLO yet: keep the lowest P95 at the trace's rate
            or (
                self.best.capacity is None
                and cand.capacity is None
                and _p95(cand.at_target) < _p95(self.best.at_target)
            )
        ):
            self.best = cand
        if self.progress is not None:
            self.progress(cand)
        return cand

    def _capacity(self, batching: BatchingConfig, lo: SweepPoint) -> SweepPoint:
        """Bisect (in log rate) between a sustainable point and the top of the range."""
        hi_scale = self.top
        if hi_scale <= lo.rate_scale:
            return lo
        best = lo
        top = self.probe(batching, hi_scale)
        if top.sustainable:
            return top
        lo_scale = lo.rate_scale
        for _ in range(self.steps):
            mid = math.sqrt(lo_scale * hi_scale)
            p = self.probe(batching, mid)
            if p.sustainable:
                lo_scale, best = mid, p
            else:
                hi_scale = mid
        return best


def _p95(p: SweepPoint | None) -> float:
    if p is None or p.summary["p95_ms"] is None:
        return math.inf
    return float(p.summary["p95_ms"])


def _fits(
    lengths: np.ndarray[Any, Any],
    base: BatchingConfig,
    cost: CostModel,
    rate: float,
    max_length: int,
    methods: Sequence[FitMethod],
    buckets: Sequence[int],
) -> list[tuple[str, tuple[int, ...]]]:
    """(label, boundaries) from every fit method and K, deduplicated, in order."""
    out: list[tuple[str, tuple[int, ...]]] = []
    seen: set[tuple[int, ...]] = set()
    for method in methods:
        for k in (*buckets, "auto"):
            res = fit_boundaries(
                lengths,
                method,
                k,  # type: ignore[arg-type]
                max_length,
                rate=rate,
                max_wait_s=base.max_wait_ms / 1000,
                max_batch=base.max_batch,
                cost=cost,
                overlong_max_batch=base.overlong_max_batch,
                overlong_max_wait_s=base.overlong_max_wait_ms / 1000,
            )
            if res.boundaries and res.boundaries not in seen:
                seen.add(res.boundaries)
                out.append((f"{method.value} K={k}", res.boundaries))
    return out


def tune(
    trace: Trace,
    cost: CostModel,
    base: BatchingConfig,
    admission: AdmissionConfig | None = None,
    *,
    slo_p95_ms: float,
    max_length: int = 256,
    truncate: bool = False,
    methods: Sequence[FitMethod] = tuple(FitMethod),
    buckets: Sequence[int] = DEFAULT_BUCKETS,
    waits_ms: Sequence[float] = DEFAULT_WAITS_MS,
    batches: Sequence[int] = DEFAULT_BATCHES,
    bisect_steps: int = BISECT_STEPS,
    progress: Progress | None = None,
    seed: int = 0,
) -> TuneResult:
    """Search boundaries, max wait and max batch per bucket for the bucketed strategy (see the
    module docstring); `base` supplies everything not searched (token budget, concurrency,
    prefetch, overlong quota) and is the starting point. `seed`: of the draws from the cost
    model's batch spread (`plan.sim.simulate`)."""
    if slo_p95_ms <= 0:
        raise ValueError(f"the SLO must be positive, got {slo_p95_ms} ms")
    probe = Probe(trace, cost, admission, slo_p95_ms, max_length, truncate, seed)
    # Spell out the engine's default boundaries so every candidate has explicit ones.
    bounds0 = base.boundaries or default_boundaries(max_length)
    base = base.model_copy(update={"strategy": Strategy.BUCKETED, "boundaries": bounds0})
    orc = oracle_for(trace.input_lengths, cost, base, max_length=max_length, truncate=truncate)
    search = _Search(probe, orc, progress, bisect_steps)
    stages: list[str] = []
    start = search.consider(
        f"start (boundaries {list(bounds0)}, max wait {base.max_wait_ms:g} ms)", base
    )

    # 1. boundaries
    lengths = np.minimum(trace.input_lengths, max_length) if truncate else trace.input_lengths
    fits = _fits(lengths, base, cost, probe.base_rps, max_length, methods, buckets)
    for label, bounds in fits:
        search.consider(label, _with_bounds(_incumbent(search), bounds))
    stages.append(f"boundaries: {len(fits)} fitted sets tried; best {_describe(search)}")

    # 2. one max wait for every bucket
    waits = sorted({w for w in waits_ms if w <= slo_p95_ms / 2} | {base.max_wait_ms})
    for w in waits:
        cfg = _incumbent(search).model_copy(update={"max_wait_ms": w, "bucket_max_wait_ms": None})
        search.consider(f"max_wait {w:g} ms", cfg)
    stages.append(f"max wait: {len(waits)} values tried; best {_describe(search)}")

    # 3. per lane, one pass
    n_lanes = len(_incumbent(search).boundaries or ()) + 1
    for lane in range(n_lanes):
        for w in waits:
            search.consider(
                f"lane {lane} max_wait {w:g} ms", _lane(_incumbent(search), lane, w, None)
            )
        for b in batches:
            search.consider(f"lane {lane} max_batch {b}", _lane(_incumbent(search), lane, None, b))
    stages.append(f"per lane: {n_lanes} lanes tried; best {_describe(search)}")

    assert search.best is not None
    return TuneResult(search.best, start, orc, probe.base_rps, slo_p95_ms, search.tried, stages)


def _incumbent(search: _Search) -> BatchingConfig:
    assert search.best is not None
    return search.best.batching


def _describe(search: _Search) -> str:
    assert search.best is not None
    b = search.best
    if b.capacity is None:
        return f"{b.label} (SLO not met at the trace's rate)"
    return f"{b.label}: {b.capacity_rps:.2f} req/s sustained"


def _with_bounds(cfg: BatchingConfig, bounds: tuple[int, ...]) -> BatchingConfig:
    """`cfg` with new boundaries (per-bucket settings reset: they belonged to the old ones)."""
    return cfg.model_copy(
        update={"boundaries": bounds, "bucket_max_batch": None, "bucket_max_wait_ms": None}
    )


def _lane(
    cfg: BatchingConfig, lane: int, wait_ms: float | None, batch: int | None
) -> BatchingConfig:
    """`cfg` with one lane's max wait or max batch changed (the last lane is overlong)."""
    bounds = cfg.boundaries or ()
    if lane == len(bounds):
        update: dict[str, Any] = {}
        if wait_ms is not None:
            update["overlong_max_wait_ms"] = wait_ms
        if batch is not None:
            update["overlong_max_batch"] = batch
        return cfg.model_copy(update=update)
    waits = list(cfg.bucket_max_wait_ms or (cfg.max_wait_ms,) * len(bounds))
    sizes = list(cfg.bucket_max_batch or (cfg.max_batch,) * len(bounds))
    if wait_ms is not None:
        waits[lane] = wait_ms
    if batch is not None:
        sizes[lane] = batch
    return cfg.model_copy(
        update={"bucket_max_wait_ms": tuple(waits), "bucket_max_batch": tuple(sizes)}
    )


def settings_toml(batching: BatchingConfig, admission: AdmissionConfig | None = None) -> str:
    """A config file for `lenbatch serve --config`: the whole `[batching]` section, and the
    `[admission]` settings that differ from the defaults (they shaped the simulation)."""
    lines = ["[batching]"]
    lines += _toml_items(batching.model_dump(mode="json"))
    if admission is not None:
        changed = admission.model_dump(mode="json", exclude_defaults=True)
        if changed:
            lines += ["", "[admission]", *_toml_items(changed)]
    return "\n".join(lines) + "\n"


def _toml_items(values: dict[str, Any]) -> list[str]:
    return [f"{k} = {_toml_value(v)}" for k, v in values.items() if v is not None]


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, float):
        return repr(value)  # round-trips exactly; TOML reads 10.0 and 1e-05 alike
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return str(value)
