"""Lane resolution: from the user's `BatchingConfig` to the lanes the scheduler runs, once for
the embedding engine, the generation engine and the simulator alike.

A lane is one queue with its own `LanePolicy`: a length bucket, the overlong lane, or the single
queue of the non-bucketed strategies. `resolve_lanes` applies the model's length limit and, when
`bucketed` has no boundaries, the placeholder default (powers of two up to half the limit), and
names each lane as the metrics label it.
"""

from __future__ import annotations

from dataclasses import dataclass

from lenbatch.config import BatchingConfig, SchedulerConfig
from lenbatch.core.buckets import BucketSet, default_boundaries

__all__ = ["Lanes", "lane_labels", "resolve_lanes"]


@dataclass(frozen=True, slots=True)
class Lanes:
    """The resolved lanes of one engine (or simulated run)."""

    cfg: SchedulerConfig  # what `schedule()` runs with
    labels: tuple[str, ...]  # one metrics label per lane, in lane order
    default_boundaries: bool  # bucketed with the placeholder boundaries, not fitted ones


def lane_labels(cfg: SchedulerConfig) -> list[str]:
    """Names of the lanes, as the engines label their metrics (`"all"` for a single queue)."""
    if cfg.strategy.bucketed:
        return BucketSet(cfg.boundaries, cfg.max_length).labels()
    return ["all"]


def resolve_lanes(batching: BatchingConfig, max_length: int) -> Lanes:
    """The lanes `batching` gives a model that accepts `max_length` tokens.

    Raises `ValueError` (with what to change) for a config no batch could ever run with.
    """
    cfg = batching.resolve(max_length, default_boundaries(max_length))
    uses_default = (
        batching.strategy.bucketed and batching.boundaries is None and not batching.auto_boundaries
    )
    return Lanes(cfg, tuple(lane_labels(cfg)), uses_default)
