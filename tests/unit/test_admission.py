"""Admission control: what can never fit is 413, what does not fit now is 429 with the limit."""

from __future__ import annotations

import math

import pytest

from lenbatch.config import AdmissionConfig, BatchingConfig, Strategy
from lenbatch.core.admission import Admission, TokenBucket
from lenbatch.core.errors import InputTooLong, Overloaded
from lenbatch.core.lanes import LanePolicy, SchedulerConfig, resolve_scheduler
from lenbatch.core.queues import Queues
from lenbatch.core.request import Request


def _sched(max_length: int = 256, budget: int = 8192, pad_to: int | None = None) -> SchedulerConfig:
    if pad_to is None:
        return resolve_scheduler(
            BatchingConfig(boundaries=(32, 64), max_batch_tokens=budget, max_batch=8), max_length
        )
    lane = LanePolicy(upper=max_length, max_batch=8, max_wait=0.01, pad_to=pad_to)
    return SchedulerConfig(Strategy.STATIC, (), (lane,), max_length, budget, slots=2)


def _fill(queues: Queues, lengths: list[int]) -> None:
    for n in lengths:
        queues.push(Request(n, 0.0))


def test_token_bucket_takes_refills_and_reports_wait() -> None:
    """A bucket of 100 at 50/s: takes 80, refuses 40 for (40-20)/50 s, refills with time."""
    b = TokenBucket(rate=50, burst=100, now=0.0)
    assert b.try_take(80, 0.0) == 0.0
    assert b.try_take(40, 0.0) == pytest.approx(0.4)
    assert b.tokens == pytest.approx(20)  # a refusal takes nothing
    assert b.try_take(40, 0.4) == 0.0
    assert b.try_take(101, 100.0) == math.inf  # over the burst: never


def test_input_over_model_limit_is_413_naming_the_limit() -> None:
    """An input over the model limit is refused with 413 and the limit in the message."""
    adm = Admission(AdmissionConfig(), _sched(max_length=256))
    err = adm.check([10, 300], Queues(adm.sched), 0.0)
    assert isinstance(err, InputTooLong) and err.status == 413
    assert "input 1 has 300 tokens" in err.message and "256" in err.message


def test_input_over_batch_budget_is_413_not_queued() -> None:
    """An input the model takes but no batch budget can hold is refused, so it cannot hang."""
    adm = Admission(AdmissionConfig(), _sched(max_length=512, budget=100))
    queues = Queues(adm.sched)
    err = adm.check([101], queues, 0.0)
    assert isinstance(err, InputTooLong) and "max_batch_tokens is 100" in err.message
    assert adm.check([100], queues, 0.0) is None


def test_static_pad_over_budget_refuses_everything_with_the_reason() -> None:
    """A hand-built static lane padding past the budget: even 1 token is 413, saying why."""
    adm = Admission(AdmissionConfig(), _sched(max_length=512, budget=256, pad_to=512))
    err = adm.check([1], Queues(adm.sched), 0.0)
    assert isinstance(err, InputTooLong) and "padded to 512" in err.message


def test_static_config_over_budget_is_a_startup_error() -> None:
    """`static` with max_batch_tokens below the model limit is rejected when resolved."""
    with pytest.raises(ValueError, match="max_batch_tokens=256"):
        resolve_scheduler(BatchingConfig(strategy=Strategy.STATIC, max_batch_tokens=256), 512)


def test_queue_total_full_is_429_with_retry_after() -> None:
    """The total queue bound gives 429 `queue_full` with the configured Retry-After."""
    adm = Admission(AdmissionConfig(max_queue_total=4, retry_after_s=2.0), _sched())
    queues = Queues(adm.sched)
    _fill(queues, [5, 5, 40])
    assert adm.check([5], queues, 0.0) is None
    queues.push(Request(5, 0.0))
    err = adm.check([5], queues, 0.0)
    assert isinstance(err, Overloaded) and err.status == 429 and err.code == "queue_full"
    assert err.retry_after == 2.0 and "max_queue_total=4" in err.message


def test_bucket_queue_full_counts_only_that_bucket() -> None:
    """The per-bucket bound refuses a full bucket but admits into another one."""
    adm = Admission(AdmissionConfig(max_queue_per_bucket=2), _sched())
    queues = Queues(adm.sched)
    _fill(queues, [5, 6])
    err = adm.check([7], queues, 0.0)
    assert isinstance(err, Overloaded) and err.code == "bucket_queue_full"
    assert adm.check([50], queues, 0.0) is None


def test_call_larger_than_any_queue_is_413_not_429() -> None:
    """A call that could never fit the queue bound is 413: retrying would never help."""
    adm = Admission(AdmissionConfig(max_queue_total=3, max_queue_per_bucket=2), _sched())
    queues = Queues(adm.sched)
    err = adm.check([5, 5, 5, 5], queues, 0.0)
    assert isinstance(err, InputTooLong) and err.code == "too_many_inputs"
    err = adm.check([5, 5, 5], queues, 0.0)
    assert isinstance(err, InputTooLong) and "max_queue_per_bucket=2" in err.message


def test_token_rate_limit_counts_tokens_and_says_when() -> None:
    """The bucket is counted in tokens: 429 `rate_limited` with the exact wait, 413 over burst."""
    adm = Admission(AdmissionConfig(tokens_per_s=100, burst_tokens=150), _sched())
    queues = Queues(adm.sched)
    assert adm.check([100], queues, 0.0) is None
    err = adm.check([30, 30], queues, 0.0)  # 60 tokens, 50 left: 0.1 s to go
    assert isinstance(err, Overloaded) and err.code == "rate_limited"
    assert err.retry_after == pytest.approx(0.1)
    assert adm.check([30, 30], queues, 0.1) is None
    over = adm.check([100, 60], queues, 10.0)
    assert isinstance(over, InputTooLong) and over.code == "call_over_burst"


def test_refused_calls_take_no_tokens() -> None:
    """A call refused by a queue bound leaves the token bucket untouched."""
    adm = Admission(AdmissionConfig(max_queue_total=1, tokens_per_s=10, burst_tokens=10), _sched())
    queues = Queues(adm.sched)
    queues.push(Request(5, 0.0))
    assert isinstance(adm.check([5], queues, 0.0), Overloaded)
    assert adm.bucket is not None and adm.bucket.tokens == 10
