"""The simulator on cases small enough to work out by hand, and its accounting."""

from __future__ import annotations

import numpy as np
import pytest

from lenbatch.config import AdmissionConfig, BatchingConfig, Strategy
from lenbatch.plan.costmodel import CostModel
from lenbatch.plan.sim import simulate
from lenbatch.plan.summary import OUTCOME_ERROR, OUTCOME_OK, OUTCOME_REJECTED, SUMMARY_KEYS
from lenbatch.plan.trace import Trace

EXACT = 1e-9
MB = 1024 * 1024


def trace(arrivals: list[float], lengths: list[int]) -> Trace:
    return Trace(np.asarray(lengths, dtype=np.int64), np.asarray(arrivals, dtype=np.float64))


def fifo(**kw: object) -> BatchingConfig:
    return BatchingConfig(strategy=Strategy.FIFO, **kw)  # type: ignore[arg-type]


def test_low_load_each_request_waits_max_wait_then_runs_alone() -> None:
    """Sparse arrivals: latency = max_wait + service time, exactly."""
    t = trace([0.0, 1.0, 2.0, 3.0], [10, 10, 10, 10])
    run = simulate(t, CostModel(const=0.1), fifo(max_wait_ms=10))
    assert run.latencies == pytest.approx([0.11] * 4, abs=EXACT)
    assert run.waits == pytest.approx([0.01] * 4, abs=EXACT)
    assert run.mean_batch_size == 1


def test_full_batch_flushes_before_max_wait() -> None:
    """The second request fills max_batch=2, so both start at its arrival."""
    t = trace([0.0, 0.004], [10, 10])
    run = simulate(t, CostModel(const=0.1), fifo(max_batch=2, max_wait_ms=10))
    assert run.latencies == pytest.approx([0.104, 0.100], abs=EXACT)


def test_prefetched_batch_is_formed_early_and_waits_for_the_runner() -> None:
    """With prefetch 1 a due request is batched alone while the runner is busy; a later one
    cannot join it and runs after it (the engine collates at emission, runs at a free slot)."""
    t = trace([0.0, 0.004, 0.050, 0.080], [10] * 4)
    cfg = fifo(max_batch=2, max_wait_ms=10, prefetch_batches=1)
    run = simulate(t, CostModel(const=0.1), cfg)
    assert run.latencies == pytest.approx([0.104, 0.100, 0.154, 0.224], abs=EXACT)
    assert run.waits == pytest.approx([0.004, 0.0, 0.054, 0.124], abs=EXACT)
    assert [s.batches for s in run.lane_stats] == [3]


def test_without_prefetch_waiting_requests_batch_together_after_the_runner_frees() -> None:
    """Same arrivals, no prefetch: the two waiting requests form one batch at 0.104."""
    t = trace([0.0, 0.004, 0.050, 0.080], [10] * 4)
    cfg = fifo(max_batch=2, max_wait_ms=10, prefetch_batches=0)
    run = simulate(t, CostModel(const=0.1), cfg)
    assert run.latencies == pytest.approx([0.104, 0.100, 0.154, 0.124], abs=EXACT)
    assert [s.batches for s in run.lane_stats] == [2]


def test_service_time_follows_padded_length() -> None:
    """fifo pads to the batch's longest, static to the model limit."""
    t = trace([0.0, 0.001], [10, 30])
    cost = CostModel(const=0.01, per_token=0.001)
    dyn = simulate(t, cost, fifo(max_batch=2), max_length=64)
    assert dyn.latencies == pytest.approx([0.071, 0.070], abs=EXACT)  # 0.01 + 2*30*0.001
    assert dyn.padding_waste == pytest.approx(1 - 40 / 60)
    static = simulate(t, cost, BatchingConfig(strategy=Strategy.STATIC, max_batch=2), max_length=64)
    assert static.latencies == pytest.approx([0.139, 0.138], abs=EXACT)  # 0.01 + 2*64*0.001
    assert static.padding_waste == pytest.approx(1 - 40 / 128)


def test_bucketed_overlong_lane_has_its_own_wait_and_queues_behind_the_runner() -> None:
    """Short request: 10 ms wait; overlong one: 50 ms wait, then the busy runner."""
    t = trace([0.0, 0.001], [10, 40])
    cfg = BatchingConfig(boundaries=(16,), max_wait_ms=10, overlong_max_wait_ms=50)
    run = simulate(t, CostModel(const=0.1), cfg, max_length=64)
    assert run.latencies == pytest.approx([0.11, 0.209], abs=EXACT)
    assert list(run.lanes) == [0, 1]
    assert run.labels == ["1-16", "overlong(17-64)"]
    rows = run.summary()["per_bucket"]
    assert [r["completed"] for r in rows] == [1, 1]
    assert rows[1]["queue_wait_mean_ms"] == pytest.approx(109.0)


def test_default_boundaries_are_the_engines() -> None:
    """No boundaries given: the engine's default for the model limit, and it says so."""
    run = simulate(trace([0.0], [5]), CostModel(const=0.1), BatchingConfig(), max_length=256)
    assert run.cfg.boundaries == (16, 32, 64, 128, 256)
    assert run.uses_default_boundaries


def test_inputs_over_the_model_limit_are_rejected_unless_truncated() -> None:
    """413 by default; with truncate they run, cut to the limit."""
    t = trace([0.0, 1.0], [100, 10])
    run = simulate(t, CostModel(const=0.1), fifo(), max_length=64)
    assert list(run.outcomes) == [OUTCOME_REJECTED, OUTCOME_OK]
    assert run.rejections == {"input_too_long": 1}
    cut = simulate(t, CostModel(const=0.1), fifo(), max_length=64, truncate=True)
    assert list(cut.outcomes) == [OUTCOME_OK, OUTCOME_OK]
    assert list(cut.lengths) == [64, 10]


def test_queue_bound_rejects_what_does_not_fit() -> None:
    """Four simultaneous arrivals, room for two waiting requests: two 429s."""
    t = trace([0.0] * 4, [10] * 4)
    run = simulate(t, CostModel(const=0.1), fifo(), AdmissionConfig(max_queue_total=2))
    assert list(run.outcomes) == [OUTCOME_OK, OUTCOME_OK, OUTCOME_REJECTED, OUTCOME_REJECTED]
    assert run.rejections == {"queue_full": 2}


def test_token_bucket_refills_at_its_rate() -> None:
    """100 tokens/s, burst 100: 60 at t=0 fits, 60 at 0.1 s does not (50 left), at 0.5 s does."""
    t = trace([0.0, 0.1, 0.5], [60, 60, 60])
    adm = AdmissionConfig(tokens_per_s=100, burst_tokens=100)
    run = simulate(t, CostModel(const=0.01), fifo(), adm)
    assert list(run.outcomes) == [OUTCOME_OK, OUTCOME_REJECTED, OUTCOME_OK]


def test_deadlines_expire_queued_and_prefetched_requests_but_not_running_ones() -> None:
    """1 s batches, 0.5 s deadline: the running request finishes; the prefetched one and the
    queued one expire, the queued one at its deadline (freeing its queue place for a request
    at 0.6 s), and the prefetched batch then costs nothing."""
    t = trace([0.0, 0.01, 0.02, 0.6], [10, 10, 10, 10])
    cfg = fifo(max_batch=1, max_wait_ms=0, prefetch_batches=1)
    adm = AdmissionConfig(request_timeout_s=0.5, max_queue_total=1)
    run = simulate(t, CostModel(const=1.0), cfg, adm)
    assert list(run.outcomes) == [OUTCOME_OK, OUTCOME_ERROR, OUTCOME_ERROR, OUTCOME_OK]
    assert run.latencies[[0, 3]] == pytest.approx([1.0, 1.4], abs=EXACT)
    assert run.lane_stats[0].batches == 2
    assert run.busy_s == pytest.approx(2.0)


def test_peak_memory_sums_concurrent_batches_only() -> None:
    """Two overlapping batches on two runner slots add up; on one slot they do not."""
    t = trace([0.0, 0.01], [10, 20])
    cost = CostModel(const=0.1, weights_bytes=MB, act_per_token=1000.0)
    one = simulate(t, cost, fifo(max_batch=1, max_wait_ms=0, max_concurrent_batches=1))
    two = simulate(t, cost, fifo(max_batch=1, max_wait_ms=0, max_concurrent_batches=2))
    assert one.peak_memory_bytes == MB + 20_000
    assert two.peak_memory_bytes == MB + 30_000
    assert two.latencies == pytest.approx([0.1, 0.1], abs=EXACT)


def test_summary_has_exactly_the_shared_keys() -> None:
    """`simulate --json` and `replay --json` compare key for key."""
    run = simulate(trace([0.0, 0.5], [10, 20]), CostModel(const=0.1), fifo())
    s = run.summary()
    assert tuple(s) == SUMMARY_KEYS
    assert s["completed"] == 2
    assert s["throughput_rps"] == pytest.approx(2 / 0.61)
    assert s["per_bucket"][0]["exec_mean_ms"] == pytest.approx(100.0)


def test_trace_without_arrivals_is_refused() -> None:
    """Length-only traces (ShareGPT) cannot be simulated: say so."""
    with pytest.raises(ValueError, match="no arrival times"):
        simulate(Trace(np.array([5])), CostModel(const=0.1))


def test_every_request_is_accounted_for_under_overload() -> None:
    """A burst far beyond capacity: each request ends exactly once, as ok, error or reject."""
    rng = np.random.default_rng(7)
    n = 3000
    t = trace(np.sort(rng.uniform(0, 1.0, n)).tolist(), rng.integers(1, 200, n).tolist())
    adm = AdmissionConfig(max_queue_total=200, request_timeout_s=0.5)
    for s in Strategy:
        run = simulate(t, CostModel(const=0.01, per_token=1e-5), BatchingConfig(strategy=s), adm)
        counts = np.bincount(run.outcomes, minlength=3)
        assert counts.sum() == n
        assert counts[OUTCOME_OK] == sum(st.requests for st in run.lane_stats)
        assert counts[OUTCOME_REJECTED] == sum(run.rejections.values())
        assert np.isnan(run.latencies[run.outcomes != OUTCOME_OK]).all()
        assert (run.waits[run.outcomes == OUTCOME_OK] >= 0).all()


def test_a_packed_cost_model_prices_a_batch_by_its_rows_real_lengths() -> None:
    """Measured on a packed runner, a batch of 10 + 30 tokens costs 40 tokens (and 10^2 +
    30^2 for the squared term), not two rows of 30 as a padded runner pays."""
    t = trace([0.0, 0.001], [10, 30])
    cost = CostModel(const=0.01, per_token=0.001, per_token_sq=1e-5, execution="packed")
    run = simulate(t, cost, fifo(max_batch=2), max_length=64)
    service = 0.01 + 40 * 0.001 + (10 * 10 + 30 * 30) * 1e-5
    assert run.latencies == pytest.approx([0.001 + service, service], abs=EXACT)
    same = CostModel(const=0.01, per_token=0.001, per_token_sq=1e-5)  # measured padded
    padded = simulate(t, same, fifo(max_batch=2))
    assert padded.latencies == pytest.approx([0.001 + 0.088, 0.088], abs=EXACT)


def test_packed_seconds_carries_the_calibrated_scale_and_overhead() -> None:
    cost = CostModel(const=0.01, per_row=0.002, per_token=0.001, batch_scale=2.0,
                     batch_overhead_s=0.005, execution="packed")  # fmt: skip
    assert cost.packed_seconds([10, 30]) == pytest.approx(2.0 * (0.01 + 0.004 + 0.04) + 0.005)
    # rows of one length cost what the padded shape costs: the grid the model was fitted on
    assert cost.packed_seconds([20, 20]) == pytest.approx(cost.batch_seconds(2, 20))
