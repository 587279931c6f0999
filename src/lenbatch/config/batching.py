"""How requests are queued and batched: the strategy, its lanes' limits, and the `adaptive`
strategy's own settings. `lenbatch.core.lanes.resolve_scheduler` turns them into the pure
scheduler's config once the model's length limit is known."""

from __future__ import annotations

import itertools
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, Field, field_validator, model_validator

from lenbatch.config.fields import FROZEN

__all__ = ["AdaptiveConfig", "BatchingConfig", "ShedMode", "Strategy"]


class Strategy(StrEnum):
    """How requests are grouped into batches. All run through the same engine and scheduler."""

    STATIC = "static"  # one FIFO queue, every batch padded to the model's max length
    FIFO = "fifo"  # one FIFO queue, padded to the batch's longest (Ray Serve, TorchServe)
    SORTED = "sorted"  # one queue; a window is sorted by length and cut (Infinity)
    BUCKETED = "bucketed"  # one FIFO per length bucket + an overlong lane (this project)
    # bucketed lanes, batches formed by a cost model and deadlines (`core.adaptive`)
    ADAPTIVE = "adaptive"

    @property
    def bucketed(self) -> bool:
        """True for the strategies that queue by length bucket (bucketed, adaptive)."""
        return self in (Strategy.BUCKETED, Strategy.ADAPTIVE)

    @classmethod
    def parse(cls, name: str) -> Strategy:
        """The strategy called `name`, or a ValueError listing the valid names."""
        try:
            return cls(name.strip().lower())
        except ValueError:
            valid = ", ".join(s.value for s in cls)
            raise ValueError(f"unknown strategy {name!r}; choose one of: {valid}") from None


class BatchingConfig(BaseModel):
    """How requests are queued and batched."""

    model_config = FROZEN

    strategy: Strategy = Strategy.BUCKETED
    """Batching strategy: static, fifo, sorted, bucketed or adaptive."""
    boundaries: tuple[int, ...] | None = None
    """Bucket upper bounds in tokens, ascending (bucketed, adaptive). None: the model's default.
    `"auto"` (adaptive only): start with one lane and learn the boundaries from the traffic
    (online re-fit, see `[adaptive]`)."""
    auto_boundaries: bool = False
    """Set by `boundaries = "auto"`: learn the boundaries online (adaptive only)."""
    max_batch: int = Field(32, ge=1)
    """Most requests in one batch."""
    max_wait_ms: float = Field(10.0, ge=0)
    """Longest a queue's oldest request waits for its batch to fill before it is flushed."""
    max_batch_tokens: int = Field(8192, ge=1)
    """Token budget of one batch: batch size x padded length."""
    bucket_max_batch: tuple[int, ...] | None = None
    """Per-bucket max batch (one per boundary); overrides `max_batch`."""
    bucket_max_wait_ms: tuple[float, ...] | None = None
    """Per-bucket max wait (one per boundary); overrides `max_wait_ms`."""
    overlong_max_batch: int = Field(8, ge=1)
    """Most requests in one batch of the overlong lane (above the last boundary)."""
    overlong_max_wait_ms: float = Field(50.0, ge=0)
    """Max wait of the overlong lane."""
    overlong_max_inflight: int = Field(1, ge=1)
    """Overlong batches allowed to be running or prepared at once (the lane's quota)."""
    sorted_window: int = Field(128, ge=1)
    """`sorted`: how many queued requests are sorted together before cutting batches."""
    max_concurrent_batches: int = Field(1, ge=1)
    """Batches the runner executes at the same time. Where neither this nor
    `model.torch_threads` is given, an encoder served alone on a CPU runs one batch per usable
    core (up to 8), each on one torch thread (`serve` says so in its log); with a thread count
    given alone, 1."""
    prefetch_batches: int = Field(1, ge=0)
    """Batches formed and collated ahead while the runner is busy."""
    pin_workers: bool = True
    """Pin each of the `max_concurrent_batches` worker threads to a core of its own and give a
    batch to the first idle one, so that a light load's forward passes keep off the event
    loop's core. Applies where each batch runs one torch thread (`model.torch_threads = 1`)
    and the process may use exactly as many cores as there are workers (`make serve`'s line on
    2 cores); elsewhere, and in Ray replicas, the threads run unpinned."""

    @model_validator(mode="before")
    @classmethod
    def _auto_boundaries(cls, data: Any) -> Any:
        # `boundaries = "auto"` keeps the field's type a tuple: it becomes a flag.
        if isinstance(data, dict):
            b = data.get("boundaries")
            if (isinstance(b, str) and b.strip().lower() == "auto") or (
                isinstance(b, list | tuple) and len(b) == 1 and str(b[0]).lower() == "auto"
            ):
                data = {**data, "boundaries": None, "auto_boundaries": True}
        return data

    @field_validator("boundaries")
    @classmethod
    def _boundaries_increasing(cls, v: tuple[int, ...] | None) -> tuple[int, ...] | None:
        if v is None:
            return v
        if not v:
            raise ValueError("boundaries must not be empty (omit them to use the default)")
        if any(b < 1 for b in v):
            raise ValueError(f"boundaries must be positive, got {list(v)}")
        if any(b >= c for b, c in itertools.pairwise(v)):
            raise ValueError(f"boundaries must be strictly increasing, got {list(v)}")
        return v

    @model_validator(mode="after")
    def _per_bucket_lengths(self) -> BatchingConfig:
        for name in ("bucket_max_batch", "bucket_max_wait_ms"):
            values = getattr(self, name)
            if values is None:
                continue
            if self.boundaries is None or len(values) != len(self.boundaries):
                n = None if self.boundaries is None else len(self.boundaries)
                raise ValueError(
                    f"{name} has {len(values)} values but there are {n} boundaries; "
                    "give one value per boundary"
                )
            if any(x < (1 if name == "bucket_max_batch" else 0) for x in values):
                raise ValueError(f"{name} values must be positive, got {list(values)}")
        return self


class ShedMode(StrEnum):
    """What `adaptive` does with a request predicted to miss its deadline."""

    REJECT_429 = "429"  # answer at once: 429 with Retry-After
    REJECT_503 = "503"  # answer at once: 503 with Retry-After
    LATE = "late"  # keep it and serve it late (Triton's DELAY)


class AdaptiveConfig(BaseModel):
    """The `adaptive` strategy: SLO-aware waiting, cost-based merges, deadline-aware shedding,
    priorities and online re-fit of the boundaries. Every mechanism has its switch."""

    model_config = FROZEN

    slo_ms: float | None = Field(None, gt=0)
    """Service-level objective: arrival to answer, ms. None: derived from the cost model (four
    times the predicted time of the longest input alone, at least 100 ms). The
    `X-Request-Timeout` header overrides it per call."""
    itl_slo_ms: float = Field(150.0, gt=0)
    """Causal LMs: mean inter-token latency objective, ms (`slo_ms` is then the objective on
    the time to first token, default 1000 ms). Running rows and prefill chunks fit it."""
    min_wait_ms: float = Field(0.0, ge=0)
    """Shortest wait a lane may choose to fill its batch."""
    max_wait_ms: float = Field(100.0, ge=0)
    """Longest wait a lane may choose to fill its batch (the SLO bounds it too)."""
    late_binding: bool = True
    """Wait to fill only while it pays (work per model-second) and no deadline is at risk;
    off: a lane runs as soon as a runner slot is free."""
    fill_gain: float = Field(0.1, ge=0)
    """Waiting for one more request must raise real tokens per model-second by this share."""
    fill_above_load: float = Field(0.7, ge=0)
    """Wait to fill only once the runner's batch slots (`max_concurrent_batches`) would be busy
    this share of the time running every request alone (below it there is model time to
    spare; 0: whenever filling pays)."""
    fill_ramp: float = Field(0.3, ge=0)
    """The fill window grows from nothing at `fill_above_load` to its full length at
    `fill_above_load + fill_ramp` (0: in one step at `fill_above_load`)."""
    rate_window_s: float = Field(1.0, gt=0)
    """Time constant of the per-lane arrival-rate estimate."""
    merge: bool = True
    """Top up a short-of-full batch with requests of the next shorter lanes when it is cheaper
    than running them later in their own batch."""
    shed: ShedMode = ShedMode.REJECT_429
    """A request predicted to miss its deadline: 429 or 503 at once (with Retry-After), or
    `late` (kept and served late)."""
    priority_levels: int = Field(1, ge=1, le=16)
    """Strict priority levels 0..N-1 (higher runs first; FIFO within a level)."""
    priority_slo_ms: tuple[float, ...] | None = None
    """SLO of each level, lowest first (default: `slo_ms` for every level)."""
    aging_ms: float = Field(1000.0, gt=0)
    """A request that waited this long runs as if it had the top level (bounds starvation,
    the overlong lane's too)."""
    cost_window: int = Field(256, ge=8)
    """Batch timings the online cost model is fitted on (a sliding window)."""
    refit: bool = False
    """Re-fit the boundaries online when the length distribution drifts (on with
    `boundaries = "auto"`)."""
    refit_sample: int = Field(2000, ge=50)
    """Recent lengths kept for the re-fit and the drift test."""
    refit_min_requests: int = Field(300, ge=20)
    """Lengths seen (since the last fit) before a re-fit is considered."""
    refit_min_interval_s: float = Field(10.0, ge=0)
    """Shortest time between two re-fits (hysteresis)."""
    refit_min_saving: float = Field(0.05, ge=0, le=1)
    """A re-fit must cut the predicted cost per request by this share (hysteresis)."""
    refit_buckets: int = Field(6, ge=1, le=16)
    """Most buckets a re-fit may use."""

    @model_validator(mode="after")
    def _levels(self) -> AdaptiveConfig:
        if self.priority_slo_ms is not None:
            if len(self.priority_slo_ms) != self.priority_levels:
                raise ValueError(
                    f"priority_slo_ms has {len(self.priority_slo_ms)} values for "
                    f"priority_levels={self.priority_levels}; give one per level"
                )
            if any(v <= 0 for v in self.priority_slo_ms):
                raise ValueError(f"priority_slo_ms must be positive, got {self.priority_slo_ms}")
        if self.min_wait_ms > self.max_wait_ms:
            raise ValueError(
                f"min_wait_ms={self.min_wait_ms} is above max_wait_ms={self.max_wait_ms}"
            )
        return self
