"""The pure core: requests, clock, buckets, lanes, queues, scheduler (and its `adaptive`
strategy), admission, recovery, collation and errors. No asyncio, torch or web framework: the
engines and the simulator drive it with their own clocks, so what runs live is what the
simulator predicts."""

from __future__ import annotations

from lenbatch.core.adaptive import AdaptiveState, build_state
from lenbatch.core.admission import Admission
from lenbatch.core.batch import Batch, Decision
from lenbatch.core.buckets import BucketSet, default_boundaries
from lenbatch.core.clock import Clock, FakeClock, MonotonicClock
from lenbatch.core.collate import Collated, collate
from lenbatch.core.errors import LenbatchError
from lenbatch.core.lanes import (
    LanePolicy,
    Lanes,
    SchedulerConfig,
    lane_labels,
    resolve_lanes,
    resolve_scheduler,
)
from lenbatch.core.queues import Queues
from lenbatch.core.recovery import BatchCaps
from lenbatch.core.request import Request, RequestStatus
from lenbatch.core.scheduler import schedule

__all__ = [
    "AdaptiveState",
    "Admission",
    "Batch",
    "BatchCaps",
    "BucketSet",
    "Clock",
    "Collated",
    "Decision",
    "FakeClock",
    "LanePolicy",
    "Lanes",
    "LenbatchError",
    "MonotonicClock",
    "Queues",
    "Request",
    "RequestStatus",
    "SchedulerConfig",
    "build_state",
    "collate",
    "default_boundaries",
    "lane_labels",
    "resolve_lanes",
    "resolve_scheduler",
    "schedule",
]
