"""Small builders shared by tests (requests, configs, queues) and the C++ ops' skip marker."""

from __future__ import annotations

import shutil
from collections.abc import Sequence

import pytest

from lenbatch.config import BatchingConfig, Strategy
from lenbatch.core.lanes import SchedulerConfig, resolve_scheduler
from lenbatch.core.queues import Queues
from lenbatch.core.request import Request
from lenbatch.runners.hardware import cpu_flags

# Whether lenbatch's C++ ops (runners/decode_attention.cpp) can be built here: they need a CPU
# with AVX-512 and a C++ compiler; their tests skip elsewhere, saying so.
AVX512 = "avx512f" in cpu_flags() and shutil.which("c++") is not None
needs_op = pytest.mark.skipif(not AVX512, reason="the op is built only on a CPU with AVX-512")


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
