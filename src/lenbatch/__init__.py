"""lenbatch: length-bucketed dynamic batching for transformer inference.

The pure core (`lenbatch.core`: buckets, lanes, scheduler, collate, admission) is importable
without torch or a web framework; `lenbatch.embed.Engine` and `lenbatch.generate.GenerationEngine`
run it on an asyncio loop in front of a runner; `lenbatch.embed.create_app` serves it."""

from __future__ import annotations

from lenbatch.config import (
    AdmissionConfig,
    BatchingConfig,
    Settings,
    Strategy,
    load_settings,
)
from lenbatch.core.batch import Batch, Decision
from lenbatch.core.buckets import BucketSet, default_boundaries
from lenbatch.core.clock import Clock, FakeClock, MonotonicClock
from lenbatch.core.collate import Collated, collate
from lenbatch.core.lanes import SchedulerConfig
from lenbatch.core.queues import Queues
from lenbatch.core.request import Request
from lenbatch.core.scheduler import schedule

__version__ = "0.1.0"

__all__ = [
    "AdmissionConfig",
    "Batch",
    "BatchingConfig",
    "BucketSet",
    "Clock",
    "Collated",
    "Decision",
    "FakeClock",
    "MonotonicClock",
    "Queues",
    "Request",
    "SchedulerConfig",
    "Settings",
    "Strategy",
    "__version__",
    "collate",
    "default_boundaries",
    "load_settings",
    "schedule",
]
