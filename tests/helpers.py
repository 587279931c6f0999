"""Small builders shared by tests (requests, configs, queues)."""

from __future__ import annotations

from collections.abc import Sequence

from lenbatch.config import BatchingConfig, Strategy
from lenbatch.core.lanes import SchedulerConfig, resolve_scheduler
from lenbatch.core.queues import Queues
from lenbatch.core.request import Request


def sched_cfg(
    strategy: str = "bucketed",
    boundaries: Sequence[int] | None = (16, 32, 64),
    max_length: int = 128,
    **kw: object,
) -> SchedulerConfig:
    """A resolved scheduler config for tests."""
    cfg = BatchingConfig(
        strategy=Strategy(strategy),
        boundaries=tuple(boundaries) if boundaries and strategy == "bucketed" else None,
        **kw,  # type: ignore[arg-type]
    )
    return resolve_scheduler(cfg, max_length, tuple(boundaries or ()))


def push(q: Queues, length: int, arrival: float, **kw: object) -> Request:
    """Queue one request and return it."""
    r = Request(length=length, arrival=arrival, token_ids=[1] * length, **kw)  # type: ignore[arg-type]
    q.push(r)
    return r
