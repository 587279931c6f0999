"""Shedding as a last resort, and the decision log that says why each shed happened.

A refusal happens only when the call cannot finish by its due time even ahead of every queued
request it may jump (lower priority levels, later due times); a stale prediction of the
runner's backlog never refuses anything once the runner is idle, and measured batch times
move the predicted backlog so errors do not pile up. Each refusal and shed is recorded with
what was predicted, and `worst_burst` summarises the densest second."""

from __future__ import annotations

import pytest

from lenbatch.core.adaptive import AdaptivePolicy, AdaptiveState
from lenbatch.core.costfit import CostCoefficients, OnlineCostModel
from lenbatch.core.decisions import DecisionLog, ShedDecision
from lenbatch.core.lanes import SchedulerConfig
from lenbatch.core.occupancy import RequestCpu
from lenbatch.core.queues import Queues
from lenbatch.core.request import Request
from lenbatch.core.scheduler import schedule
from tests.helpers import push, sched_cfg

TRUE = CostCoefficients(0.02, 2.5e-4, 1.5e-7)


def _cfg() -> SchedulerConfig:
    return sched_cfg("adaptive", (16, 32, 64), 128, max_batch=32, max_batch_tokens=8192)


def _state(cfg: SchedulerConfig, slo: tuple[float, ...] = (1.0,)) -> AdaptiveState:
    return AdaptiveState(AdaptivePolicy(level_slo=slo), OnlineCostModel(TRUE), cfg)


def _arrive(q: Queues, st: AdaptiveState, length: int, t: float, priority: int = 0) -> Request:
    r = push(q, length, t, priority=priority)
    r.due = st.due_of(t, r.priority, None)
    st.on_arrival(r.lane, length, t)
    return r


def test_a_stale_backlog_refuses_nothing_once_the_runner_is_idle() -> None:
    """A predicted backlog left in the future (the batches finished early) is not work: with
    nothing in flight the call is admitted."""
    cfg = _cfg()
    st = _state(cfg, slo=(0.1,))
    q = Queues(cfg)
    st.backlog_end = 5.0  # predicted long ago; every batch has since finished
    assert q.inflight_total == 0
    assert st.admit([60], 1.1, q, cfg, 1.0) is None
    assert len(st.decisions) == 0


def test_measured_batches_move_the_predicted_backlog() -> None:
    """A batch that took less than predicted brings the predicted end of the work forward by
    the difference (per runner slot); one that took longer pushes it back."""
    cfg = _cfg()
    st = _state(cfg)
    q = Queues(cfg)
    for i in range(8):
        _arrive(q, st, 60, 0.0 + i * 1e-3)
    st.draining = True  # no waiting to fill: emit at once
    d = schedule(q, 0.01, cfg, st)
    assert d.batches
    emitted = st.backlog_end
    b = d.batches[0]
    predicted = st.cost.coefficients.seconds(len(b.requests), b.padded_len)
    st.observe_batch(b.lane, len(b.requests), b.padded_len, predicted / 2)
    assert st.backlog_end == pytest.approx(emitted - predicted / 2, rel=1e-6)


def test_a_higher_level_call_is_not_refused_for_lower_level_work() -> None:
    """A deep queue of level-0 work refuses a level-0 call but not a level-1 call, which
    jumps it; the refusal is logged with what was predicted."""
    cfg = _cfg()
    st = _state(cfg, slo=(0.5, 0.5))
    q = Queues(cfg)
    for _ in range(300):
        _arrive(q, st, 60, 1.0, priority=0)
    low = st.admit([60], 1.5, q, cfg, 1.0, 0)
    assert low is not None and low.code == "deadline_unmeetable"
    assert st.admit([60], 1.5, q, cfg, 1.0, 1) is None
    (d,) = st.decisions.decisions()
    assert d.where == "admission" and d.length == 60 and d.priority == 0
    assert d.queue_ahead == 300 and d.queued == 300
    assert d.finish_in > d.due_in == pytest.approx(0.5)
    assert d.queued_s > 0.5 and d.cost_a_s == pytest.approx(TRUE.a)


def test_a_call_due_earlier_jumps_the_requests_due_later() -> None:
    """Queued requests due after a call (its own short timeout) are served after it: they
    do not count against it."""
    cfg = _cfg()
    st = _state(cfg, slo=(10.0,))
    q = Queues(cfg)
    for _ in range(300):
        _arrive(q, st, 60, 1.0)  # due at 11.0
    assert st.admit([60], 1.5, q, cfg, 1.0) is None  # due at 1.5, before all of them


def test_a_queue_shed_is_logged_and_summarised_in_stats() -> None:
    cfg = _cfg()
    st = _state(cfg, slo=(0.1,))
    q = Queues(cfg)
    stale = _arrive(q, st, 60, 0.0)
    d = schedule(q, 0.08, cfg, st)
    assert d.shed == [stale]
    (rec,) = st.decisions.decisions()
    assert rec.where == "queue" and rec.at == 0.08 and rec.lane == stale.lane
    assert rec.due_in == pytest.approx(0.02) and rec.finish_in > rec.due_in
    stats = st.describe(["a", "b", "c", "d"], 0.5)["decisions"]
    assert stats["totals"] == {"admission": 0, "queue": 1}
    (shown,) = stats["recent"]
    assert shown["age_s"] == pytest.approx(0.42) and shown["where"] == "queue"
    assert shown["late_by_ms"] > 0 and "token" not in str(shown)
    assert stats["worst_burst"]["shed"] == 1


def _rec(at: float, where: str = "queue", late: float = 0.1) -> ShedDecision:
    return ShedDecision(
        at, where, 50, 1, 0, 0, 1.0, 0.5, 1.0 + late, 0.5, 0.3, 4, 9, 2, 0.02, 1e-4, 0.0, 10
    )


def test_the_ring_is_bounded_and_the_worst_burst_is_the_densest_window() -> None:
    log = DecisionLog(capacity=50)
    assert log.worst_burst() is None
    for i in range(10):  # a sparse trickle, one per 2 s
        log.record(_rec(2.0 * i, "admission"))
    for i in range(20):  # a burst: 20 in 0.4 s at t = 30
        log.record(_rec(30.0 + 0.02 * i, late=0.2))
    for i in range(30):  # more trickle pushes the oldest out of the ring
        log.record(_rec(40.0 + 2.0 * i))
    assert len(log) == 50 and log.totals == {"admission": 10, "queue": 50}
    burst = log.worst_burst(1.0)
    assert burst is not None
    assert burst["shed"] == 20 and burst["start"] == pytest.approx(30.0)
    assert burst["by_where"] == {"admission": 0, "queue": 20}
    assert burst["median_late_by_ms"] == pytest.approx(200.0)
    with pytest.raises(ValueError):
        DecisionLog(capacity=0)


def test_shedding_follows_what_the_last_batches_measured() -> None:
    """Batches running twice as slow as the cost model predicts (another process took the
    cores) make shedding refuse what the model alone would admit, within a few dozen
    batches (the queue's drain speed is the last ~20 batches'; the work in flight follows
    the last ~5 at once); batches back at speed bring both back to 1."""
    cfg = _cfg()
    st = _state(cfg, slo=(1.0,))
    q = Queues(cfg)
    for _ in range(32):
        _arrive(q, st, 60, 1.0)  # with the call: 0.6 s of work per the model, due in 1 s
    assert st.drift == pytest.approx(1.0) and st.queue_drift == pytest.approx(1.0)
    assert st.admit([60], 2.0, q, cfg, 1.0) is None
    for _ in range(10):
        st.observe_batch(1, 16, 60, 2 * st.cost.coefficients.seconds(16, 60))
    assert st.drift > 1.8 and 1.2 < st.queue_drift < 1.5
    for _ in range(30):
        st.observe_batch(1, 16, 60, 2 * st.cost.coefficients.seconds(16, 60))
    assert st.queue_drift > 1.8
    refusal = st.admit([60], 2.0, q, cfg, 1.0)
    assert refusal is not None
    assert st.decisions.decisions()[-1].drift == pytest.approx(st.drift)
    # back at the speed of the fit of the moment (which has learned some of the slowdown)
    for _ in range(80):
        st.observe_batch(1, 16, 60, st.cost.coefficients.seconds(16, 60))
    assert st.drift == pytest.approx(1.0, abs=0.05)
    assert st.queue_drift == pytest.approx(1.0, abs=0.05)
    # one stalled batch (a pause of the process) moves it by a bounded factor only
    st.observe_batch(1, 16, 60, 100.0)
    assert st.drift < 4.0**0.2 * 1.06


def test_stats_show_how_much_batch_times_varied_around_the_fit() -> None:
    """`/stats`' `batch_spread`: the quantiles of the last batches' measured / predicted time,
    scaled to mean 1; none before 30 batches. Batches alternating 0.7x and 1.3x the fit of
    the moment spread from about 0.7 to 1.3; batches at the fit's time, not at all."""
    cfg = _cfg()
    st = _state(cfg)
    labels = ["1-16", "17-32", "33-64"]
    for _ in range(29):
        st.observe_batch(1, 16, 30, st.cost.coefficients.seconds(16, 30))
    assert st.describe(labels, 0.0)["cost_model"]["batch_spread"] == []
    st.observe_batch(1, 16, 30, st.cost.coefficients.seconds(16, 30))
    assert st.describe(labels, 0.0)["cost_model"]["batch_spread"] == pytest.approx([1.0] * 21)
    for i in range(600):
        factor = 0.7 if i % 2 else 1.3
        st.observe_batch(1, 16, 30, factor * st.cost.coefficients.seconds(16, 30))
    spread = st.describe(labels, 0.0)["cost_model"]["batch_spread"]
    assert len(spread) == 21 and spread == sorted(spread)
    assert spread[0] < 0.8 and spread[-1] > 1.2 and 0.95 < spread[10] < 1.05


def test_a_trickle_of_single_rows_leaves_the_queue_drain_speed_alone() -> None:
    """Single-row batches running twice as slow as the fit (weights gone cold between sparse
    requests) move the five-batch `drift`, which prices the work in flight, but not
    `queue_drift`: a queue drains in full batches, and only batches of at least half their
    lane's cap say how fast. So a burst after a trickle is admitted on the fit's drain time;
    full batches running slow still raise it."""
    cfg = _cfg()
    st = _state(cfg, slo=(1.0,))
    assert st.drain_rows[1] == 16  # lane 17-32: 32 rows (8192 tokens / 32 allow 256)
    q = Queues(cfg)
    for _ in range(40):
        st.observe_batch(1, 1, 30, 2 * st.cost.coefficients.seconds(1, 30))
    assert st.drift > 1.8 and st.queue_drift == pytest.approx(1.0)
    for _ in range(32):
        _arrive(q, st, 60, 1.0)  # 0.6 s of queued work per the model, due in 1 s
    assert st.admit([60], 2.0, q, cfg, 1.0) is None
    for _ in range(5):
        st.observe_batch(1, 15, 30, 2 * st.cost.coefficients.seconds(15, 30))
    assert st.queue_drift == pytest.approx(1.0)  # 15 rows: not yet a full batch
    for _ in range(10):
        st.observe_batch(1, 16, 30, 2 * st.cost.coefficients.seconds(16, 30))
    assert 1.2 < st.queue_drift < 1.5


def test_request_side_cpu_counts_in_shedding_and_not_in_the_learned_batch_cost() -> None:
    """The server's CPU per request outside the model (HTTP, tokenization), measured live,
    slows the batches by the share of the cores it takes at the arrival rate: under a load
    that lasts, a queue the model alone finishes in time is refused once that CPU is counted,
    and a batch measured while it ran teaches the cost model its own, unslowed, time."""
    cfg = _cfg()
    q0, q1 = Queues(cfg), Queues(cfg)
    plain, busy = _state(cfg), _state(cfg)
    busy.request_cpu = RequestCpu(cores=2)
    for i in range(2000):  # 200 requests/s for the 10 s before (answered since)
        plain.on_arrival(1, 60, i / 200)
        busy.on_arrival(1, 60, i / 200)
    for i in range(40):  # then 40 requests queued in 0.2 s
        _arrive(q0, plain, 60, 10 + i / 200)
        _arrive(q1, busy, 60, 10 + i / 200)
    now, due = 10.2, 11.2
    queued, _ = plain.queued_work(q0, cfg, due, 0, [60])
    assert 0.6 < queued < 0.8  # the model alone: done by 0.8-1.0, within the 1 s SLO
    assert plain.admit([60], due, q0, cfg, now) is None
    # 4 ms each (a slow tokenizer) at the steady rate of the last seconds (~175 requests/s)
    busy.request_cpu.per_request_s = 0.004
    slow = busy.cpu_slowdown(now, steady=True)
    assert 150 < busy.estimates.steady_rate(now) < 200
    assert slow == pytest.approx(1 / (1 - busy.estimates.steady_rate(now) * 0.004 / 2))
    assert slow > 1.0 + (due - now - queued) / queued  # enough to miss
    refusal = busy.admit([60], due, q1, cfg, now)
    assert refusal is not None and busy.decisions.decisions()[0].drift == pytest.approx(1.0)
    # a batch that took `slow` times its own cost: the model learns its own cost
    before = busy.cost.observed
    own = TRUE.seconds(8, 60)
    busy.observe_batch(1, 8, 60, own * busy.cpu_slowdown(now), now=now)
    assert busy.cost.observed == before + 1
    assert busy.drift == pytest.approx(1.0, abs=1e-6)


def test_a_burst_prices_the_queue_at_the_steady_rate_not_its_own() -> None:
    """The same 40 requests in 0.2 s after a quiet spell: the one-second rate follows the
    burst (its slowdown would refuse the call), but the queue drains after the burst has been
    parsed, so admission prices it at the five-second rate and admits the call."""
    cfg = _cfg()
    q = Queues(cfg)
    st = _state(cfg)
    st.request_cpu = RequestCpu(cores=2)
    for i in range(40):
        _arrive(q, st, 60, i / 200)
    now, due = 0.2, 1.2
    st.request_cpu.per_request_s = 0.02
    queued, _ = st.queued_work(q, cfg, due, 0, [60])
    assert st.cpu_slowdown(now) > 1.0 + (due - now - queued) / queued  # the burst's: a miss
    assert st.estimates.steady_rate(now) < 0.25 * busy_rate(st, now)
    assert st.admit([60], due, q, cfg, now) is None
    assert len(st.decisions) == 0


def busy_rate(st: AdaptiveState, now: float) -> float:
    """The arrival rate the state estimates at `now`, all lanes."""
    return sum(st.rate(i, now) for i in range(len(st.wait)))
