"""The pure core: requests, clock, buckets, lanes, queues, scheduler, admission, recovery,
collation and errors. No asyncio, torch or web framework: the engines and the simulator drive it
with their own clocks, so what runs live is what the simulator predicts."""

from __future__ import annotations

from lenbatch.core.admission import Admission
from lenbatch.core.buckets import BucketSet, default_boundaries
from lenbatch.core.clock import Clock, FakeClock, MonotonicClock
from lenbatch.core.collate import Collated, collate
from lenbatch.core.errors import LenbatchError
from lenbatch.core.lanes import Lanes, lane_labels, resolve_lanes
from lenbatch.core.queues import Queues
from lenbatch.core.recovery import BatchCaps
from lenbatch.core.request import Request, RequestStatus
from lenbatch.core.scheduler import Batch, Decision, schedule

__all__ = [
    "Admission",
    "Batch",
    "BatchCaps",
    "BucketSet",
    "Clock",
    "Collated",
    "Decision",
    "FakeClock",
    "Lanes",
    "LenbatchError",
    "MonotonicClock",
    "Queues",
    "Request",
    "RequestStatus",
    "collate",
    "default_boundaries",
    "lane_labels",
    "resolve_lanes",
    "schedule",
]
