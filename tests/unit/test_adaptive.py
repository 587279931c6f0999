"""The `adaptive` strategy's pure parts: online cost model, late binding, deadlines, merges,
shedding, priorities. Explicit times (a fake clock), no sleeps."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from lenbatch.config import AdaptiveConfig, ShedMode
from lenbatch.core import costfit
from lenbatch.core.adaptive import AdaptivePolicy, AdaptiveState, check_slo, derive_slo
from lenbatch.core.costfit import CostCoefficients, OnlineCostModel
from lenbatch.core.errors import Overloaded, Unavailable
from lenbatch.core.lanes import SchedulerConfig
from lenbatch.core.queues import Queues
from lenbatch.core.request import Request
from lenbatch.core.scheduler import schedule
from tests.helpers import push, sched_cfg

TRUE = CostCoefficients(0.02, 2.5e-4, 1.5e-7)  # the MiniLM profile on a 2-core CPU, roughly


def _cfg(**kw: object) -> SchedulerConfig:
    base: dict[str, object] = {"max_batch": 32, "max_batch_tokens": 8192}
    base.update(kw)
    return sched_cfg("adaptive", (16, 32, 64), 128, **base)


def _state(cfg: SchedulerConfig, slo: float = 1.0, **kw: object) -> AdaptiveState:
    policy = AdaptivePolicy(level_slo=(slo,), **kw)  # type: ignore[arg-type]
    return AdaptiveState(policy, OnlineCostModel(TRUE), cfg)


def _arrive(q: Queues, st: AdaptiveState, length: int, t: float, **kw: object) -> Request:
    r = push(q, length, t, **kw)
    r.due = st.due_of(t, r.priority, None)
    st.on_arrival(r.lane, length, t)
    return r


# ---------------------------------------------------------------------- online cost model


def test_cost_model_converges_on_a_synthetic_cost() -> None:
    """Fed noisy timings of a known cost, the fit recovers it (from a wrong prior)."""
    rng = np.random.default_rng(0)
    model = OnlineCostModel(CostCoefficients(0.1, 1e-3, 0.0), window=200)
    for _ in range(400):
        b, n = int(rng.integers(1, 33)), int(rng.integers(8, 257))
        model.observe(b, n, TRUE.seconds(b, n) * float(rng.normal(1.0, 0.02)))
    co = model.coefficients
    assert co.a == pytest.approx(TRUE.a, rel=0.1)
    assert co.b == pytest.approx(TRUE.b, rel=0.1)
    for b, n in [(1, 16), (8, 64), (32, 256)]:
        assert model.seconds(b, n) == pytest.approx(TRUE.seconds(b, n), rel=0.03)
    err = model.fit_error()
    assert err is not None and err < 0.05


def test_cost_model_fits_only_its_window_of_latest_batches() -> None:
    """Once more batches came than the window holds, the fit is that of the latest `window`
    alone: the same as a fresh model fed only those (the ring overwrites the oldest), and a
    slowdown that filled the window is what it predicts for a full batch."""
    rng = np.random.default_rng(1)
    shapes = [(int(rng.integers(1, 33)), int(rng.integers(8, 257))) for _ in range(45)]
    times = [TRUE.seconds(b, n) * (1.0 if i < 30 else 2.0) for i, (b, n) in enumerate(shapes)]
    rolled = OnlineCostModel(TRUE, window=15)
    for (b, n), t in zip(shapes, times, strict=True):
        rolled.observe(b, n, t)
    fresh = OnlineCostModel(TRUE, window=15)
    for (b, n), t in list(zip(shapes, times, strict=True))[-15:]:
        fresh.observe(b, n, t)
    fresh.observed = rolled.observed  # the same refit schedule
    for b, n in [(1, 16), (8, 64), (32, 256)]:
        assert rolled.seconds(b, n) == pytest.approx(fresh.seconds(b, n), rel=1e-9)
    assert rolled.seconds(32, 256) == pytest.approx(2 * TRUE.seconds(32, 256), rel=0.05)
    assert rolled.describe()["window"] == 15
    assert rolled.fit_error() == pytest.approx(fresh.fit_error(), abs=1e-9)


@pytest.mark.parametrize("curved", [True, False])
def test_cost_model_is_the_weighted_relative_least_squares_fit(curved: bool) -> None:
    """The fit is least squares of relative residuals over the window plus the prior's
    pseudo-batches (worth `prior_weight` x max(0.02, 1 - fill) over five shapes), computed
    here independently with `np.linalg.lstsq`. Timings without curvature give a negative
    L^2 term: it is dropped and the other two refitted, so it is exactly 0."""
    rng = np.random.default_rng(2)
    prior = CostCoefficients(0.004, 3e-5, 2e-8)
    model = OnlineCostModel(prior, window=64, prior_weight=8.0)
    rows = []
    for _ in range(40):
        b, n = int(rng.integers(1, 33)), int(rng.integers(8, 257))
        y = (0.003 + 2e-5 * b * n + (6e-8 * b * n * n if curved else -4e-9 * b * n * n)) * float(
            rng.lognormal(0.0, 0.1)
        )
        model.observe(b, n, y)
        rows.append((b, n, y, 1.0))
    w_prior = 8.0 * (1 - 40 / 64) / 5
    shapes = ((1, 16), (1, 128), (8, 64), (16, 128), (4, 256))
    rows += [(b, n, prior.seconds(b, n), w_prior) for b, n in shapes]
    data = np.array(rows)
    b, n, y, w = data.T
    x = np.stack([np.ones_like(y), b * n, b * n * n], axis=1) * (np.sqrt(w) / y)[:, None]
    target = np.sqrt(w)
    terms = 3 if curved else 2
    want = np.linalg.lstsq(x[:, :terms], target, rcond=None)[0]
    co = model.coefficients
    assert [co.a, co.b] == pytest.approx(want[:2], rel=1e-9)
    if curved:
        assert co.c == pytest.approx(want[2], rel=1e-9)
        assert co.c > 0
    else:
        assert co.c == 0.0
        assert np.linalg.lstsq(x, target, rcond=None)[0][2] < 0  # why it was dropped


def test_cost_model_running_sums_equal_a_fresh_fit_over_many_windows() -> None:
    """The fit reads running sums (a batch added, the one it displaces taken out): after
    every batch of 400 whose times swing over two decades, its predictions equal those of a
    fresh model fed only the window's batches."""
    rng = np.random.default_rng(3)
    window = 16
    rolled = OnlineCostModel(TRUE, window=window)
    seen: list[tuple[int, int, float]] = []
    for i in range(400):
        b, n = int(rng.integers(1, 33)), int(rng.integers(8, 257))
        y = TRUE.seconds(b, n) * float(10 ** rng.uniform(-1, 1)) * (10.0 if i % 50 < 5 else 1.0)
        rolled.observe(b, n, y)
        seen.append((b, n, y))
        fresh = OnlineCostModel(TRUE, window=window)
        for row in seen[-window:]:
            fresh.observe(*row)
        for model in (rolled, fresh):
            model._fitted_at = -1  # refit now, whatever the cadence
        for shape in [(1, 16), (8, 64), (32, 256)]:
            assert rolled.seconds(*shape) == pytest.approx(fresh.seconds(*shape), rel=1e-9)


def test_cost_model_falls_back_to_lstsq_over_the_rows_with_the_same_fit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the small normal equations count as singular, the fit is lstsq over every row
    and the prior's: the same coefficients as the normal equations give when solvable."""
    rng = np.random.default_rng(4)
    model = OnlineCostModel(CostCoefficients(0.004, 3e-5, 2e-8), window=64, prior_weight=8.0)
    for _ in range(40):
        b, n = int(rng.integers(1, 33)), int(rng.integers(8, 257))
        model.observe(b, n, (0.003 + 2e-5 * b * n + 6e-8 * b * n * n) * rng.lognormal(0, 0.1))
    solved = model._refit()
    monkeypatch.setattr(costfit, "_solve_small", lambda a, b: None)
    fallback = model._refit()
    assert [fallback.a, fallback.b, fallback.c] == pytest.approx(
        [solved.a, solved.b, solved.c], rel=1e-9
    )
    assert solved.c > 0


def test_cost_model_without_data_uses_its_prior_and_stays_non_negative() -> None:
    """No batches: the prior predicts. Degenerate data (one shape) never makes a term negative."""
    model = OnlineCostModel(TRUE)
    assert model.seconds(4, 64) == pytest.approx(TRUE.seconds(4, 64))
    for _ in range(50):
        model.observe(1, 16, 0.001)  # far below the prior, always the same shape
    co = model.coefficients
    assert co.a >= 0 and co.b >= 0 and co.c >= 0
    assert model.seconds(1, 16) == pytest.approx(0.001, rel=0.3)
    assert model.describe()["observed_batches"] == 50


def test_a_measured_profile_outweighs_a_fresh_servers_first_batches() -> None:
    """A fresh server's first batches: ten single rows of a trickle at twice the profile's
    time (cold weights), then two full batches at 2.5x while a burst's requests were being
    parsed on the same cores. Weighed as a guess, the fit takes that for the per-token cost
    and predicts full batches 1.3x slower than the profile (the live server did so, and
    refused a burst it then had time for); weighed as a measured profile
    (`PROFILE_PRIOR_WEIGHT`), within 10 % of it. A weight of 0 is refused."""
    from lenbatch.core.costfit import PROFILE_PRIOR_WEIGHT

    profile = CostCoefficients(2.5e-3, 2.8e-5, 7.8e-8)  # calibrated on a 2-core Intel Xeon
    guess = OnlineCostModel(profile)
    measured = OnlineCostModel(profile, prior_weight=PROFILE_PRIOR_WEIGHT)
    for model in (guess, measured):
        for n in (8, 32, 64, 16, 24, 48, 40, 12, 56, 20):
            model.observe(1, n, 2 * profile.seconds(1, n))
        for b, n in ((28, 73), (32, 73)):
            model.observe(b, n, 2.5 * profile.seconds(b, n))
    full = profile.seconds(32, 64)
    assert measured.seconds(32, 64) == pytest.approx(full, rel=0.1)
    assert guess.seconds(32, 64) > 1.25 * full
    with pytest.raises(ValueError, match="weight"):
        OnlineCostModel(profile, prior_weight=0)


def test_cost_model_from_profile_json() -> None:
    """A profile's const (+ calibrated batch overhead), per_token and per_token_sq seed it."""
    co = CostCoefficients.from_profile(
        {"const": 0.02, "batch_overhead_s": 0.005, "per_token": 1e-4, "per_token_sq": 2e-7}
    )
    assert (co.a, co.b, co.c) == pytest.approx((0.025, 1e-4, 2e-7))


# ---------------------------------------------------------------------- late binding


def test_fill_window_widens_then_narrows_with_the_arrival_rate_within_bounds() -> None:
    """Rare arrivals: no wait (a batch of one). More traffic: the lane waits for a batch. Much
    more: the batch fills faster, so the window narrows; always within [min, max]."""
    cfg = _cfg()
    st = _state(cfg, slo=1.0, min_wait=0.001, max_wait=0.08)
    windows = []
    for rate in (0.2, 5.0, 20.0, 80.0, 400.0, 3000.0):
        st.reset_lanes(cfg)
        for k in range(200):
            st.on_arrival(2, 50, k / rate)
        now = 199 / rate
        target = st.target_batch(2, cfg, now, 1.0)
        windows.append(st.fill_window(2, target, now))
    assert windows[0] == pytest.approx(0.001)  # the minimum: nothing to wait for
    assert all(0.001 <= w <= 0.08 for w in windows)
    peak = int(np.argmax(windows))
    assert 0 < peak < len(windows) - 1
    assert windows[: peak + 1] == sorted(windows[: peak + 1])
    assert windows[peak:] == sorted(windows[peak:], reverse=True)
    assert windows[-1] < windows[peak]


def test_a_lane_waits_while_filling_pays_and_runs_at_its_window() -> None:
    """Steady 100 req/s: the first request is held (a timer set within max_wait), and the lane
    runs once its window has passed."""
    cfg = _cfg()
    st = _state(cfg, slo=1.0, max_wait=0.05)
    q = Queues(cfg)
    for k in range(100):
        st.on_arrival(2, 50, k * 0.01)
    _arrive(q, st, 50, 1.0)
    d = schedule(q, 1.0, cfg, st)
    assert d.batches == []
    assert d.wake_at is not None and 1.0 < d.wake_at <= 1.05
    d = schedule(q, d.wake_at, cfg, st)
    assert [b.size for b in d.batches] == [1]


def test_the_fill_threshold_counts_every_batch_slot() -> None:
    """~30 req/s of 50 tokens keep one slot over `fill_load` (0.7) busy serving them one by
    one: it waits to fill. Two one-thread batch slots would be half as busy: it runs."""
    held = []
    for slots in (1, 2):
        cfg = replace(_cfg(), slots=slots)
        st = AdaptiveState(
            AdaptivePolicy(level_slo=(1.0,), max_wait=0.05),
            OnlineCostModel(TRUE),
            cfg,
            concurrency=slots,
        )
        q = Queues(cfg)
        for k in range(60):
            st.on_arrival(2, 50, k / 30)
        _arrive(q, st, 50, 2.0)
        assert (st.load(2.0) >= 0.7) == (slots == 1)
        held.append(schedule(q, 2.0, cfg, st).batches == [])
    assert held == [True, False]


def test_the_fill_window_grows_with_the_load_over_the_ramp() -> None:
    """Below `fill_above_load` a lane runs at once; above it the lane waits a share of its
    fill window that grows with the load, (load - 0.7) / 0.3, up to the whole window; with no
    ramp the whole window applies from the threshold on."""
    seen = []
    for rate, ramp in ((20, 0.3), (25, 0.3), (30, 0.3), (40, 0.3), (25, 0.0)):
        cfg = replace(_cfg(), slots=1)
        policy = AdaptivePolicy(level_slo=(1.0,), max_wait=0.05, fill_ramp=ramp)
        st = AdaptiveState(policy, OnlineCostModel(TRUE), cfg)
        q = Queues(cfg)
        for k in range(2 * rate):
            st.on_arrival(2, 50, k / rate)
        _arrive(q, st, 50, 2.0)
        load = st.load(2.0)
        d = schedule(q, 2.0, cfg, st)
        full = st.fill_window(2, st.target[2], 2.0)
        if load < 0.7:
            assert [b.size for b in d.batches] == [1]
            seen.append(0.0)
            continue
        assert d.batches == [] and full > 0
        share = min(1.0, (load - 0.7) / ramp) if ramp else 1.0
        assert st.wait[2] == pytest.approx(share * full)
        assert d.wake_at == pytest.approx(2.0 + share * full)
        seen.append(share)
    assert seen[0] == 0.0 and 0 < seen[1] < seen[2] < 1 and seen[3] == 1.0 and seen[4] == 1.0


def test_the_total_arrival_rate_is_the_sum_of_the_lanes_rates() -> None:
    """`total_rate`, kept as one decaying average, equals the lanes' rates summed, between
    arrivals and after them, and starts afresh with the lanes."""
    cfg = _cfg()
    st = _state(cfg)
    est = st.estimates
    rng = np.random.default_rng(1)
    t = 0.0
    for _ in range(300):
        t += float(rng.exponential(0.01))
        est.on_arrival(int(rng.integers(0, est.lanes)), 40, t)
        for now in (t, t + 0.003, t + 0.5):
            total = sum(est.rate(i, now) for i in range(est.lanes))
            assert est.total_rate(now) == pytest.approx(total, rel=1e-9)
    assert est.total_rate(t) > 50
    est.reset(cfg)
    assert est.total_rate(t) == 0.0


def test_late_binding_off_runs_at_once() -> None:
    """The switch: with late binding off a lane runs as soon as a slot is free."""
    cfg = _cfg()
    st = _state(cfg, late_binding=False)
    q = Queues(cfg)
    for k in range(100):
        st.on_arrival(2, 50, k * 0.01)
    _arrive(q, st, 50, 1.0)
    assert [b.size for b in schedule(q, 1.0, cfg, st).batches] == [1]


def test_no_wait_when_one_more_request_does_not_pay() -> None:
    """With no fixed cost per call, batching gains nothing: the lane runs at once."""
    cfg = _cfg()
    policy = AdaptivePolicy(level_slo=(1.0,), max_wait=0.05)
    st = AdaptiveState(policy, OnlineCostModel(CostCoefficients(0.0, 2.5e-4, 0.0)), cfg)
    q = Queues(cfg)
    for k in range(100):
        st.on_arrival(2, 50, k * 0.01)
    _arrive(q, st, 50, 1.0)
    assert [b.size for b in schedule(q, 1.0, cfg, st).batches] == [1]


# ---------------------------------------------------------------------- deadlines


def test_no_batch_is_started_that_breaks_a_deadline_when_a_feasible_one_exists() -> None:
    """Two ready lanes, one slot: the older lane's batch cannot meet its due time any more
    (served late), the other's can; the feasible one goes first."""
    cfg = replace(_cfg(), slots=1)
    st = _state(cfg, slo=0.2, shed=ShedMode.LATE, late_binding=False)
    q = Queues(cfg)
    late = _arrive(q, st, 60, 0.0)  # due 0.2; alone it takes ~0.036 s
    ok = _arrive(q, st, 10, 0.15)  # due 0.35
    d = schedule(q, 0.19, cfg, st)
    assert d.batches[0].requests == [ok] and len(d.batches) == 1
    assert late in q.lanes[late.lane]


def test_a_batch_stops_growing_before_it_breaks_a_members_due_time() -> None:
    """The head is due soon: the batch takes only as many rows as still finish in time."""
    cfg = _cfg()
    st = _state(cfg, slo=10.0, late_binding=False)
    q = Queues(cfg)
    head = _arrive(q, st, 60, 0.0)
    head.due = 0.1  # e.g. a short X-Request-Timeout
    for k in range(20):
        _arrive(q, st, 60, 0.001 * (k + 1))
    d = schedule(q, 0.03, cfg, st)
    first = d.batches[0]
    assert first.requests[0] is head
    assert 0.03 + TRUE.seconds(first.size, first.padded_len) <= 0.1
    assert first.size < 21


def test_a_member_already_late_does_not_hold_its_batch_back() -> None:
    """`shed = late`: the head can no longer meet its due time; the rows behind it, which
    can, still fill the batch (it used to run alone, its due time capping the batch)."""
    cfg = _cfg()
    st = _state(cfg, slo=1.0, shed=ShedMode.LATE, late_binding=False)
    q = Queues(cfg)
    head = _arrive(q, st, 60, 0.0)
    for k in range(20):
        _arrive(q, st, 60, 0.9 + 0.001 * k)
    d = schedule(q, 0.99, cfg, st)  # the head is due at 1.0, and alone takes ~0.036 s
    first = d.batches[0]
    assert first.requests[0] is head and first.size > 1
    assert 0.99 + TRUE.seconds(first.size, first.padded_len) <= 1.9  # the others' due time


def _late_head(
    st: AdaptiveState, cfg: SchedulerConfig, late_share: float
) -> tuple[Queues, Request, float]:
    """A queue whose head, served now, is predicted to finish `late_share` of its 1 s SLO
    past its due time; the time `now` that says so."""
    q = Queues(cfg)
    head = _arrive(q, st, 60, 10.0)
    now = 11.0 + late_share - TRUE.seconds(1, 60)
    return q, head, now


def test_a_head_barely_late_is_kept_while_the_load_drains_and_shed_under_overload() -> None:
    """Shedding at a lane's head is a last resort: a request predicted late by 1 % of its SLO
    is a coin flip worth taking while full batches can serve the arrivals of the last few
    seconds, and is shed once they cannot (a sustained overload), as is one predicted late by
    more than the 2 % tolerance."""
    cfg = _cfg()
    st = _state(cfg, slo=1.0, late_binding=False)
    q, head, now = _late_head(st, cfg, 0.01)
    assert st.drains(now, cfg)
    d = schedule(q, now, cfg, st)
    assert head not in d.shed and head in d.batches[0].requests
    st = _state(cfg, slo=1.0, late_binding=False)
    q, head, now = _late_head(st, cfg, 0.03)
    assert schedule(q, now, cfg, st).shed == [head]
    # 400 requests/s of 60 tokens for the last five seconds: a full batch of 32 takes
    # ~0.55 s, so full batches serve ~58/s a slot
    st = _state(cfg, slo=1.0, late_binding=False)
    for k in range(2000):
        st.on_arrival(2, 60, 5.0 + k / 400)
    q, head, now = _late_head(st, cfg, 0.01)
    assert not st.drains(now, cfg)
    assert schedule(q, now, cfg, st).shed == [head]


def test_a_batch_is_sized_by_what_the_last_batches_measured() -> None:
    """Batches measured twice as slow as the model predicts (`drift`): the batch stops
    growing where it still finishes in time at that speed, not where the bare fit says."""
    sizes = []
    for slow in (1.0, 2.0):
        cfg = _cfg()
        st = _state(cfg, slo=10.0, late_binding=False)
        for _ in range(10):
            st.observe_batch(3, 8, 60, slow * st.cost.coefficients.seconds(8, 60))
        q = Queues(cfg)
        head = _arrive(q, st, 60, 0.0)
        head.due = 0.25
        for k in range(20):
            _arrive(q, st, 60, 0.001 * (k + 1))
        first = schedule(q, 0.03, cfg, st).batches[0]
        co = st.cost.coefficients
        assert first.requests[0] is head
        assert 0.03 + st.drift * co.seconds(first.size, first.padded_len) <= 0.25
        assert 0.03 + st.drift * co.seconds(first.size + 1, first.padded_len) > 0.25
        sizes.append(first.size)
    assert sizes[1] < sizes[0]


def test_shedding_answers_once_with_the_documented_code() -> None:
    """A queued request that cannot meet its due time even alone is shed once (never also
    batched); admission refuses a call predicted late with 429 (or 503) and a Retry-After."""
    cfg = _cfg()
    st = _state(cfg, slo=0.1)
    q = Queues(cfg)
    stale = _arrive(q, st, 60, 0.0)
    fresh = _arrive(q, st, 60, 0.09)
    d = schedule(q, 0.08, cfg, st)  # 0.08 + 0.036 > 0.1: stale cannot make it
    assert d.shed == [stale]
    assert all(stale not in b.requests for b in d.batches)
    assert fresh in [r for b in d.batches for r in b.requests] or fresh in q.lanes[fresh.lane]
    d2 = schedule(q, 0.09, cfg, st)
    assert stale not in d2.shed
    err = st.shed_error(stale, 0.08)
    assert isinstance(err, Overloaded) and err.status == 429 and err.code == "deadline_unmeetable"
    assert err.retry_after is not None and err.retry_after > 0
    # admission: a deep queue ahead of a 100 ms budget
    q2 = Queues(cfg)
    for _ in range(200):
        _arrive(q2, st, 60, 1.0)
    refusal = st.admit([60], 1.1, q2, cfg, 1.0)
    assert isinstance(refusal, Overloaded) and refusal.retry_after is not None
    assert refusal.retry_after > 0.5
    st503 = _state(cfg, slo=0.1, shed=ShedMode.REJECT_503)
    refusal = st503.admit([60], 1.1, q2, cfg, 1.0)
    assert isinstance(refusal, Unavailable) and refusal.status == 503
    late = _state(cfg, slo=0.1, shed=ShedMode.LATE)
    assert late.admit([60], 1.1, q2, cfg, 1.0) is None


# ---------------------------------------------------------------------- merges


def test_merges_top_up_a_short_batch_within_the_token_budget() -> None:
    """Low traffic: a lone long request takes the shorter lanes' few requests along (each
    costs less padded in than in a call of its own), never past the token budget, and each
    merge is counted per lane pair."""
    for budget, size in ((8192, 4), (180, 3)):
        cfg = _cfg(max_batch_tokens=budget)
        st = _state(cfg, late_binding=False)
        q = Queues(cfg)
        long = _arrive(q, st, 60, 0.0)  # lane 2 (33-64)
        shorter = [_arrive(q, st, n, 0.001 * k) for k, n in enumerate([30, 28, 12])]
        d = schedule(q, 0.01, cfg, st)
        b = d.batches[0]
        assert b.lane == 2 and b.padded_len == 60
        assert b.padded_tokens <= budget
        assert b.requests == [long, *shorter][:size]
        assert d.merges == [(1, 2), (1, 2), (0, 2)][: size - 1]
        assert st.merges == {(1, 2): 2, **({(0, 2): 1} if size == 4 else {})}
        rest = [r for x in d.batches[1:] for r in x.requests] + [r for x in q.lanes for r in x]
        assert rest == shorter[size - 1 :]  # nothing lost, nothing twice


def test_a_merge_stops_where_the_shorter_lane_runs_cheaper_on_its_own() -> None:
    """Four short requests share a call of their own for less than padding each to 60."""
    cfg = _cfg()
    st = _state(cfg, late_binding=False)
    q = Queues(cfg)
    _arrive(q, st, 60, 0.0)
    for k, n in enumerate([12, 10, 9, 8]):
        _arrive(q, st, n, 0.001 * k)
    d = schedule(q, 0.01, cfg, st)
    assert d.merges == []
    # marginal cost of a row padded to 60 vs its share of the four's own batch
    assert TRUE.seconds(2, 60) - TRUE.seconds(1, 60) > TRUE.seconds(4, 12) / 4


def test_no_merges_when_switched_off_or_when_lanes_fill_on_their_own() -> None:
    """`merge = false` merges nothing; a full shorter lane is cheaper on its own."""
    cfg = _cfg()
    off = _state(cfg, late_binding=False, merge=False)
    q = Queues(cfg)
    _arrive(q, off, 60, 0.0)
    _arrive(q, off, 30, 0.0)
    d = schedule(q, 0.0, cfg, off)
    assert d.merges == [] and all(len({r.lane for r in b.requests}) == 1 for b in d.batches)
    on = _state(cfg, late_binding=False)
    q = Queues(cfg)
    _arrive(q, on, 60, 0.0)
    for k in range(32):
        _arrive(q, on, 30, 0.0001 * k)
    d = schedule(q, 0.01, cfg, on)
    assert d.merges == []


# ---------------------------------------------------------------------- priorities


def test_strict_levels_fifo_within_a_level() -> None:
    """A higher level runs first; within a level, arrival order."""
    cfg = _cfg(max_batch=2)
    policy = AdaptivePolicy(level_slo=(5.0, 5.0), late_binding=False, merge=False)
    st = AdaptiveState(policy, OnlineCostModel(TRUE), cfg)
    q = Queues(cfg)
    low = [_arrive(q, st, 50, 0.001 * k, priority=0) for k in range(2)]
    high = [_arrive(q, st, 50, 0.01 + 0.001 * k, priority=1) for k in range(2)]
    d = schedule(q, 0.02, cfg, st)
    assert [b.requests for b in d.batches] == [high, low]


def test_aging_bounds_the_low_levels_wait_under_a_high_level_flood() -> None:
    """A steady flood of level-1 requests would starve a level-0 one; aging runs it once it has
    waited `aging`, and not much later (one batch)."""
    cfg = replace(_cfg(max_batch=4), slots=1)
    policy = AdaptivePolicy(level_slo=(100.0, 100.0), late_binding=False, merge=False, aging=0.5)
    st = AdaptiveState(policy, OnlineCostModel(TRUE), cfg)
    q = Queues(cfg)
    low = _arrive(q, st, 50, 0.0, priority=0)
    now = 0.0
    served_at = None
    k = 0
    while now < 5.0 and served_at is None:
        for _ in range(8):  # more high-level work arrives than one batch takes
            _arrive(q, st, 50, now, priority=1)
            k += 1
        d = schedule(q, now, cfg, st)
        for b in d.batches:
            if low in b.requests:
                served_at = now
        longest = max((TRUE.seconds(b.size, b.padded_len) for b in d.batches), default=0.01)
        for b in d.batches:
            q.batch_done(b.lane)
        now += longest
    assert served_at is not None
    assert 0.5 <= served_at <= 0.5 + 2 * TRUE.seconds(4, 50)


def test_policy_from_config_and_slo_checks() -> None:
    """Per-level SLOs from the config; an SLO the longest input cannot meet alone is refused,
    saying why; the derived default is 4x that time."""
    ac = AdaptiveConfig(priority_levels=2, priority_slo_ms=(800, 200), max_wait_ms=30)
    pol = AdaptivePolicy.from_config(ac, 0.5)
    assert pol.level_slo == (0.8, 0.2) and pol.max_wait == pytest.approx(0.03)
    cost = OnlineCostModel(TRUE)
    check_slo(pol, cost, 256)
    with pytest.raises(ValueError, match=r"level 1's SLO of 20 ms .* at least \d+"):
        check_slo(AdaptivePolicy(level_slo=(1.0, 0.02)), cost, 256)
    assert derive_slo(cost, 256) == pytest.approx(4 * TRUE.seconds(1, 256))
    with pytest.raises(ValueError, match="one per level"):
        AdaptiveConfig(priority_levels=3, priority_slo_ms=(1, 2))
