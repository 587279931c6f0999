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

# Whether lenbatch's C++ ops (runners/decode_attention.cpp) can be built here: they need an x86
# CPU with AVX-512, or AVX2 with FMA, and a C++ compiler (`OPS`); the bfloat16 products and the
# packed attention are built only with AVX-512 (`AVX512`). Their tests skip elsewhere, saying so.
_FLAGS = cpu_flags()
_CXX = shutil.which("c++") is not None
AVX512 = "avx512f" in _FLAGS and _CXX
OPS = AVX512 or ("avx2" in _FLAGS and "fma" in _FLAGS and _CXX)
needs_op = pytest.mark.skipif(
    not OPS, reason="the ops are built only on a CPU with AVX-512 or AVX2"
)
needs_avx512 = pytest.mark.skipif(
    not AVX512, reason="the bfloat16 ops are built only on a CPU with AVX-512"
)


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
