"""Lanes: the scheduler's resolved config, built from the user's `BatchingConfig`, once for the
embedding engine, the generation engine and the simulator alike.

A lane is one queue with its own `LanePolicy`: a length bucket, the overlong lane, or the single
queue of the non-bucketed strategies. `resolve_scheduler` turns the user's settings into the
`SchedulerConfig` that the pure scheduler consumes (plain numbers in seconds and tokens, one
`LanePolicy` per queue) for a model's length limit. `resolve_lanes` adds, when `bucketed` has no
boundaries, the placeholder default (powers of two up to the limit), and names each lane as
the metrics label it.
"""

from __future__ import annotations

from dataclasses import dataclass

from lenbatch.config import BatchingConfig, Strategy
from lenbatch.core.buckets import BucketSet, default_boundaries

__all__ = [
    "LanePolicy",
    "Lanes",
    "SchedulerConfig",
    "lane_labels",
    "resolve_lanes",
    "resolve_scheduler",
]


@dataclass(frozen=True, slots=True)
class LanePolicy:
    """The scheduler's rules for one queue (a bucket, the overlong lane, or the single queue)."""

    upper: int  # longest request this lane takes, in tokens
    max_batch: int
    max_wait: float  # seconds
    pad_to: int | None = None  # fixed padded length (static strategy), else pad to batch max
    quota: int | None = None  # most batches of this lane in flight (overlong lane)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """What `schedule()` needs, resolved: one `LanePolicy` per queue, times in seconds."""

    strategy: Strategy
    boundaries: tuple[int, ...]
    lanes: tuple[LanePolicy, ...]
    max_length: int
    max_batch_tokens: int
    slots: int  # batches that may be running or prepared at once
    sorted_window: int = 128


@dataclass(frozen=True, slots=True)
class Lanes:
    """The resolved lanes of one engine (or simulated run)."""

    cfg: SchedulerConfig  # what `schedule()` runs with
    labels: tuple[str, ...]  # one metrics label per lane, in lane order
    default_boundaries: bool  # bucketed with the placeholder boundaries, not fitted ones


def resolve_scheduler(
    batching: BatchingConfig, max_length: int, default_boundaries: tuple[int, ...] = ()
) -> SchedulerConfig:
    """The scheduler's view of `batching` for a model that accepts `max_length` tokens;
    `default_boundaries` serve a bucketed strategy that names none.

    Raises `ValueError` (with what to change) for a config no batch could ever run with.
    """
    b = batching
    if b.strategy is Strategy.STATIC and max_length > b.max_batch_tokens:
        # static pads every row to the model's limit: not even one row fits the budget
        raise ValueError(
            f"strategy static pads every input to the model's limit of {max_length} "
            f"tokens, over max_batch_tokens={b.max_batch_tokens}: no batch could ever "
            f"run. Raise max_batch_tokens to at least {max_length}"
        )
    if not b.strategy.bucketed:
        lane = LanePolicy(
            upper=max_length,
            max_batch=b.max_batch,
            max_wait=b.max_wait_ms / 1000,
            pad_to=max_length if b.strategy is Strategy.STATIC else None,
        )
        return _scheduler_config(b, (), (lane,), max_length)
    if b.auto_boundaries:
        if b.strategy is not Strategy.ADAPTIVE:
            raise ValueError(
                'boundaries = "auto" learns boundaries online: it needs strategy adaptive'
            )
        bounds: tuple[int, ...] = (max_length,)  # one lane until the first re-fit
    else:
        bounds = tuple(b.boundaries or default_boundaries)
    if not bounds:
        raise ValueError("bucketed strategy needs boundaries (none given and no default)")
    if bounds[-1] > max_length:
        raise ValueError(f"last boundary {bounds[-1]} exceeds the model's max length {max_length}")
    batches = b.bucket_max_batch or (b.max_batch,) * len(bounds)
    waits = b.bucket_max_wait_ms or (b.max_wait_ms,) * len(bounds)
    lanes = [
        LanePolicy(upper=u, max_batch=n, max_wait=w / 1000)
        for u, n, w in zip(bounds, batches, waits, strict=True)
    ]
    lanes.append(
        LanePolicy(
            upper=max_length,
            max_batch=b.overlong_max_batch,
            max_wait=b.overlong_max_wait_ms / 1000,
            quota=b.overlong_max_inflight,
        )
    )
    return _scheduler_config(b, bounds, tuple(lanes), max_length)


def _scheduler_config(
    b: BatchingConfig, bounds: tuple[int, ...], lanes: tuple[LanePolicy, ...], max_length: int
) -> SchedulerConfig:
    return SchedulerConfig(
        strategy=b.strategy,
        boundaries=bounds,
        lanes=lanes,
        max_length=max_length,
        max_batch_tokens=b.max_batch_tokens,
        slots=b.max_concurrent_batches + b.prefetch_batches,
        sorted_window=b.sorted_window,
    )


def lane_labels(cfg: SchedulerConfig) -> list[str]:
    """Names of the lanes, as the engines label their metrics (`"all"` for a single queue)."""
    if cfg.strategy.bucketed:
        return BucketSet(cfg.boundaries, cfg.max_length).labels()
    return ["all"]


def resolve_lanes(batching: BatchingConfig, max_length: int) -> Lanes:
    """The lanes `batching` gives a model that accepts `max_length` tokens.

    Raises `ValueError` (with what to change) for a config no batch could ever run with.
    """
    cfg = resolve_scheduler(batching, max_length, default_boundaries(max_length))
    uses_default = (
        batching.strategy.bucketed and batching.boundaries is None and not batching.auto_boundaries
    )
    return Lanes(cfg, tuple(lane_labels(cfg)), uses_default)
