"""Property: under any mix of poison inputs, out-of-memory batches, deadlines and callers that
go away, every call ends exactly once — with the right vectors, or an error it earned — and the
engine keeps nothing afterwards."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lenbatch.config import BatchingConfig, RecoveryConfig
from lenbatch.core.errors import DeadlineExceeded, LenbatchError, ModelFailed, OutOfMemory
from lenbatch.embed.engine import Engine
from lenbatch.runners.fake import FakeRunner
from lenbatch.runners.faulty import FaultyRunner

POISON = 7


@dataclass(frozen=True)
class Call:
    inputs: list[list[int]]
    timeout: float | None
    cancel_after: int | None  # loop iterations before the caller goes away


token = st.integers(min_value=1000, max_value=1100)
sequence = st.builds(
    lambda body, poison: [101, *body, *([POISON] if poison else []), 102],
    st.lists(token, min_size=1, max_size=24),
    st.integers(min_value=0, max_value=6).map(lambda k: k == 0),  # poison one time in seven
)
calls = st.lists(
    st.builds(
        Call,
        st.lists(sequence, min_size=1, max_size=4),
        st.none() | st.floats(min_value=0.0005, max_value=0.02),
        st.none() | st.integers(min_value=0, max_value=3),
    ),
    min_size=1,
    max_size=10,
)


async def _scenario(plan: list[Call], strategy: str, max_batch: int, oom_tokens: int) -> None:
    fake = FakeRunner(record=False)
    engine = Engine(
        FaultyRunner(fake, poison_token=POISON, oom_tokens=oom_tokens),
        BatchingConfig(strategy=strategy, max_batch=max_batch, max_wait_ms=1, boundaries=(8, 16)),
        recovery=RecoveryConfig(oom_cooldown_s=0.01, probe_after_failures=3),
    )
    await engine.start()
    tasks = [asyncio.create_task(engine.embed(c.inputs, timeout=c.timeout)) for c in plan]
    for step in range(4):
        for call, task in zip(plan, tasks, strict=True):
            if call.cancel_after == step:
                task.cancel()
        await asyncio.sleep(0)
    _, pending = await asyncio.wait(tasks, timeout=20)
    assert not pending, "a call never ended"
    survived = 0  # inputs of calls not cancelled: all of them were admitted
    for call, task in zip(plan, tasks, strict=True):
        if task.cancelled():
            assert call.cancel_after is not None
            continue
        exc = task.exception()
        if exc is None:
            vectors = task.result()
            assert len(vectors) == len(call.inputs)
            for ids, vec in zip(call.inputs, vectors, strict=True):
                np.testing.assert_array_equal(vec, fake.vector(ids))
            assert not any(POISON in ids for ids in call.inputs)
        else:
            assert isinstance(exc, LenbatchError)
            if isinstance(exc, ModelFailed):
                assert any(POISON in ids for ids in call.inputs)
            elif isinstance(exc, OutOfMemory):
                assert any(len(ids) > oom_tokens for ids in call.inputs)
            elif isinstance(exc, DeadlineExceeded):
                assert call.timeout is not None
            else:
                raise AssertionError(f"unexpected {exc!r}")
        survived += len(call.inputs)
    assert engine.unanswered == 0 and engine.queues.size == 0
    assert engine.state.value == "running"  # poison and OOM never take the server down
    # each admitted input ended once: those of surviving calls, plus those of cancelled calls
    # that had been admitted before their caller left
    ended = sum(engine.metrics.stats()["requests"].values())
    assert survived <= ended <= sum(len(c.inputs) for c in plan)
    await engine.stop(timeout=1)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    plan=calls,
    strategy=st.sampled_from(["fifo", "bucketed", "sorted"]),
    max_batch=st.integers(min_value=1, max_value=8),
    oom_tokens=st.integers(min_value=20, max_value=120),
)
def test_every_call_ends_once_with_what_it_earned(
    plan: list[Call], strategy: str, max_batch: int, oom_tokens: int
) -> None:
    """Random faults and callers: every call ends, vectors are right, errors are earned."""
    asyncio.run(_scenario(plan, strategy, max_batch, oom_tokens))
