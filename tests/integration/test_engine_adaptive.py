"""Strategy adaptive in the engine and over HTTP, with the fake runner (no model).

Where a test needs the runner busy it holds it with an event (`FaultyRunner(hold=...)`), so
what is asserted follows from predictions, never from how long anything took.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import httpx
import numpy as np
import pytest

from lenbatch.config import AdaptiveConfig, BatchingConfig
from lenbatch.core.costfit import CostCoefficients
from lenbatch.core.errors import BadInput, Overloaded, Unavailable
from lenbatch.embed.engine import Engine
from lenbatch.runners.fake import FakeRunner
from lenbatch.runners.faulty import FaultyRunner

ADAPTIVE = BatchingConfig(strategy="adaptive", boundaries=(16, 64), max_wait_ms=0)


def _ids(n: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    return [101, *rng.integers(1000, 30000, n - 2).tolist(), 102]


async def test_adaptive_answers_in_order_and_learns_its_cost() -> None:
    """Every input gets its own vector; /stats shows the cost model fed by the engine's own
    batches, the lanes' windows and the switches."""
    runner = FakeRunner(max_length=128)
    engine = Engine(runner, ADAPTIVE, adaptive=AdaptiveConfig(slo_ms=2000))
    await engine.start()
    inputs = [_ids(n, i) for i, n in enumerate([5, 60, 12, 100, 3, 40, 64, 17] * 3)]
    try:
        results = await asyncio.gather(*(engine.embed([x]) for x in inputs))
        stats = engine.stats()
        metrics = engine.prometheus().decode()
    finally:
        await engine.stop()
    for x, (vec,) in zip(inputs, results, strict=True):
        np.testing.assert_array_equal(vec, runner.vector(x))
    ad = stats["adaptive"]
    assert ad["cost_model"]["observed_batches"] == len(runner.batches)
    # each model call's idle slot time before it, which the cost model learns with it
    assert stats["runner_gaps"]["calls"] == len(runner.batches)
    assert stats["runner_gaps"]["mean_gap_ms"] >= 0
    assert ad["cost_model"]["prior"] == "generic prior"
    assert [lane["bucket"] for lane in ad["lanes"]] == ["1-16", "17-64", "overlong(65-128)"]
    assert ad["switches"] == {
        "late_binding": True,
        "fill_above_load": 0.7,
        "fill_ramp": 0.3,
        "merge": True,
        "shed": "429",
        "priority_levels": 1,
    }
    assert 'lenbatch_cost_model{term="a"}' in metrics
    assert "lenbatch_adaptive_fill_window_seconds" in metrics


async def test_a_call_predicted_to_miss_its_slo_is_shed_at_once_with_retry_after() -> None:
    """Each batch is predicted to take 1 s; with the runner busy, a call with a 1.5 s SLO
    cannot make it: 429 at once, with Retry-After, counted; the running call is unaffected."""
    hold = threading.Event()
    runner = FaultyRunner(FakeRunner(max_length=128), hold=hold)
    engine = Engine(
        runner,
        ADAPTIVE.model_copy(update={"prefetch_batches": 0}),
        adaptive=AdaptiveConfig(slo_ms=1500),
        cost_prior=CostCoefficients(1.0, 0.0, 0.0),
    )
    await engine.start()
    try:
        busy = asyncio.create_task(engine.embed([_ids(5)]))
        while engine.queues.inflight_total == 0:
            await asyncio.sleep(0)  # let the loop take the first call (no time passes)
        with pytest.raises(Overloaded) as err:
            await engine.embed([_ids(6)])
        assert err.value.status == 429 and err.value.code == "deadline_unmeetable"
        assert err.value.retry_after is not None and 0.5 < err.value.retry_after <= 1.0
        hold.set()
        assert len(await busy) == 1
        stats = engine.stats()
    finally:
        hold.set()
        await engine.stop()
    assert stats["rejected"] == {"deadline_unmeetable": 1}
    assert stats["adaptive"]["shed"] == {"admission": 1, "queue": 0}
    assert stats["unanswered"] == 0


async def test_the_time_before_admission_counts_against_the_slo() -> None:
    """A call the route received 1.2 s ago (reading, tokenizing, a busy event loop) has 0.3 s
    of its 1.5 s SLO left: with a batch predicted at 1 s it is refused at once, although the
    runner is idle; the same call received now is served. /stats shows both intakes."""
    engine = Engine(
        FakeRunner(max_length=128),
        ADAPTIVE,
        adaptive=AdaptiveConfig(slo_ms=1500),
        cost_prior=CostCoefficients(1.0, 0.0, 0.0),
    )
    await engine.start()
    try:
        with pytest.raises(Overloaded) as err:
            await engine.embed([_ids(6)], arrival=engine.clock.now() - 1.2)
        assert err.value.code == "deadline_unmeetable"
        assert len(await engine.embed([_ids(6)], arrival=engine.clock.now())) == 1
        stats = engine.stats()
    finally:
        await engine.stop()
    assert stats["rejected"] == {"deadline_unmeetable": 1}
    assert stats["intake_p50_ms"] is not None and 500 < stats["intake_p95_ms"] < 1300


async def test_shed_503_and_serve_late_are_configurable() -> None:
    """shed = 503 answers Unavailable; shed = late admits and serves the call (late)."""
    for mode, expect in (("503", Unavailable), ("late", None)):
        hold = threading.Event()
        runner = FaultyRunner(FakeRunner(max_length=128), hold=hold)
        engine = Engine(
            runner,
            ADAPTIVE.model_copy(update={"prefetch_batches": 0}),
            adaptive=AdaptiveConfig(slo_ms=1500, shed=mode),  # type: ignore[arg-type]
            cost_prior=CostCoefficients(1.0, 0.0, 0.0),
        )
        await engine.start()
        try:
            busy = asyncio.create_task(engine.embed([_ids(5)]))
            while engine.queues.inflight_total == 0:
                await asyncio.sleep(0)
            second = asyncio.create_task(engine.embed([_ids(6)]))
            for _ in range(20):
                await asyncio.sleep(0)
            hold.set()
            if expect is None:
                assert len(await second) == 1
            else:
                with pytest.raises(expect) as err:
                    await second
                assert err.value.status == 503 and err.value.retry_after is not None
            await busy
        finally:
            hold.set()
            await engine.stop()


def test_an_slo_no_batch_can_meet_is_refused_at_start_up() -> None:
    """The longest input alone is predicted at ~1.3 s: an SLO of 500 ms is refused, saying so."""
    with pytest.raises(ValueError, match=r"SLO of 500 ms is below .* 1 x 128 tokens"):
        Engine(
            FakeRunner(max_length=128),
            ADAPTIVE,
            adaptive=AdaptiveConfig(slo_ms=500),
            cost_prior=CostCoefficients(0.02, 0.01, 0.0),
        )


async def test_priority_outside_the_levels_is_a_400_naming_the_range() -> None:
    """priority must lie in [0, levels - 1]; a valid one is served."""
    engine = Engine(
        FakeRunner(max_length=128), ADAPTIVE, adaptive=AdaptiveConfig(priority_levels=3)
    )
    await engine.start()
    try:
        for bad in (-1, 3, 10):
            with pytest.raises(BadInput, match=r"priority must be an integer in \[0, 2\]"):
                await engine.embed([_ids(5)], priority=bad)
        assert len(await engine.embed([_ids(5)], priority=2)) == 1
    finally:
        await engine.stop()


async def test_one_priority_level_says_how_to_get_more() -> None:
    """With the default single level the error says only 0 is allowed and how to add levels."""
    engine = Engine(FakeRunner(max_length=128), ADAPTIVE)
    await engine.start()
    try:
        with pytest.raises(BadInput, match=r"priority must be 0 .*--priority-levels N"):
            await engine.embed([_ids(5)], priority=1)
        assert len(await engine.embed([_ids(5)], priority=0)) == 1
    finally:
        await engine.stop()


def test_priority_field_and_header_over_http(live_server: Any) -> None:
    """The body's `priority` and the X-Priority header both reach the engine; out of range is
    a 400 in the OpenAI error shape naming the range; a non-integer header is a 400 too."""
    engine = Engine(
        FakeRunner(max_length=128), ADAPTIVE, adaptive=AdaptiveConfig(priority_levels=2)
    )
    with live_server(engine) as srv:
        ok = httpx.post(f"{srv.url}/v1/embeddings", json={"input": "a b", "priority": 1})
        assert ok.status_code == 200
        ok = httpx.post(
            f"{srv.url}/v1/embeddings", json={"input": "a b"}, headers={"x-priority": "1"}
        )
        assert ok.status_code == 200
        bad = httpx.post(f"{srv.url}/v1/embeddings", json={"input": "a b", "priority": 2})
        assert bad.status_code == 400
        err = bad.json()["error"]
        assert "[0, 1]" in err["message"] and err["code"] == "invalid_priority"
        bad = httpx.post(
            f"{srv.url}/v1/embeddings", json={"input": "a b"}, headers={"x-priority": "high"}
        )
        assert bad.status_code == 400 and "x-priority" in bad.json()["error"]["message"]
        stats = httpx.get(f"{srv.url}/stats").json()
        metrics = httpx.get(f"{srv.url}/metrics").text
    assert stats["priority_levels"] == 2
    assert 'lenbatch_priority_requests_total{level="1"} 2.0' in metrics


async def test_auto_boundaries_are_learnt_from_the_first_requests() -> None:
    """`boundaries = "auto"` starts with one lane; after `refit_min_requests` lengths the
    engine re-fits, swaps lanes with nothing lost, and reports the re-fit."""
    runner = FakeRunner(max_length=128)
    engine = Engine(
        runner,
        BatchingConfig(strategy="adaptive", boundaries="auto"),  # type: ignore[arg-type]
        adaptive=AdaptiveConfig(slo_ms=10_000, refit_min_requests=20, refit_min_interval_s=0),
    )
    assert engine.cfg.boundaries == (128,)
    await engine.start()
    inputs = [_ids(n, i) for i, n in enumerate([5, 9, 12, 30, 33, 40] * 8)]
    try:
        first = await asyncio.gather(*(engine.embed([x]) for x in inputs[:24]))
        rest = await asyncio.gather(*(engine.embed([x]) for x in inputs[24:]))
        stats = engine.stats()
        metrics = engine.prometheus().decode()
    finally:
        await engine.stop()
    for x, (vec,) in zip(inputs, [*first, *rest], strict=True):
        np.testing.assert_array_equal(vec, runner.vector(x))
    assert stats["refit"]["refits"] >= 1
    assert stats["boundaries"][-1] == 40 and len(stats["boundaries"]) > 1
    assert stats["refit"]["events"][0]["old"] == [128]
    assert f"lenbatch_refits_total {float(stats['refit']['refits'])}" in metrics
    assert stats["unanswered"] == 0


async def test_engine_and_simulator_make_the_same_first_refit_on_the_same_lengths() -> None:
    """The same lengths, in the same order, through the engine and through the simulator
    (both with the generic cost prior): the first re-fit swaps the same boundaries."""
    from lenbatch.plan.costmodel import CostModel
    from lenbatch.plan.sim import simulate
    from lenbatch.plan.trace import Trace

    lengths = [5, 9, 12, 30, 33, 40, 7, 64, 21, 18] * 4
    batching = BatchingConfig(strategy="adaptive", boundaries="auto")  # type: ignore[arg-type]
    ac = AdaptiveConfig(slo_ms=10_000, refit_min_requests=20, refit_min_interval_s=0)
    runner = FakeRunner(max_length=128)
    engine = Engine(runner, batching, adaptive=ac)
    await engine.start()
    try:
        # Exactly refit_min_requests first: the re-fitter's first look sees these 20.
        await asyncio.gather(*(engine.embed([_ids(n, i)]) for i, n in enumerate(lengths[:20])))
        await asyncio.gather(*(engine.embed([_ids(n, i)]) for i, n in enumerate(lengths[20:])))
        live = engine.stats()["refit"]["events"]
    finally:
        await engine.stop()
    t = Trace(np.asarray(lengths, dtype=np.int64), 0.01 * np.arange(len(lengths)))
    sim = simulate(
        t, CostModel(const=0.001), batching, max_length=128, adaptive=ac, adaptive_prior=False
    )
    assert sim.refit is not None and live
    simulated = sim.refit["events"]
    assert (live[0]["old"], live[0]["new"]) == (simulated[0]["old"], simulated[0]["new"])
    assert live[0]["new"] != [128]


async def test_the_engine_measures_the_cpu_per_request_outside_the_model(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Between batches the engine reads the request-side threads' CPU (here a fake reading
    of 3 ms per arrived request) and /stats shows the CPU per request it learned; a real
    reading of this process's threads is a non-negative, growing number."""
    import lenbatch.embed.engine as engine_module
    from lenbatch.serving.servercpu import request_side_cpu_s

    first = request_side_cpu_s()
    sum(i * i for i in range(200_000))  # some CPU on this thread
    assert request_side_cpu_s() > first >= 0

    runner = FakeRunner(max_length=128)
    engine = Engine(runner, ADAPTIVE, adaptive=AdaptiveConfig(slo_ms=5000))
    assert engine.adaptive is not None
    state = engine.adaptive
    state.request_cpu.min_interval_s = 0.0
    monkeypatch.setattr(engine_module, "request_side_cpu_s", lambda: 0.003 * state.arrivals)
    await engine.start()
    try:
        for i in range(6):
            await asyncio.gather(*(engine.embed([_ids(20, 10 * i + j)]) for j in range(4)))
        stats = engine.stats()
    finally:
        await engine.stop()
    cpu = stats["adaptive"]["request_cpu"]
    assert cpu["intervals"] >= 3
    assert cpu["cpu_per_request_ms"] == pytest.approx(3.0)
    assert cpu["cores"] >= 1 and cpu["slowdown"] >= 1.0
