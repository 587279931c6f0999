"""`SlotGaps`: the idle time of a runner slot before each model call, the server's own cost
per batch that the model call's timing misses."""

from __future__ import annotations

import pytest

from lenbatch.core.occupancy import SlotGaps


def test_a_batch_emitted_on_an_idle_runner_costs_its_preparation() -> None:
    g = SlotGaps(2)
    assert g.started(at=1.004, emitted=1.0) == pytest.approx(0.004)  # never-used slots
    g.ended(1.5)
    assert g.started(at=3.01, emitted=3.0) == pytest.approx(0.01)  # free long before


def test_a_batch_waiting_for_its_slot_costs_only_the_hand_off() -> None:
    g = SlotGaps(1)
    g.started(at=0.0, emitted=0.0)
    # emitted (prefetched) at 0.1 while the slot was busy; the slot frees at 0.5
    g.ended(0.5)
    assert g.started(at=0.502, emitted=0.1) == pytest.approx(0.002)


def test_without_a_prefetched_batch_the_whole_turn_around_counts() -> None:
    """The slot frees at 0.5, the next batch is decided and collated only then and starts at
    0.53: 30 ms the model call's timing does not see."""
    g = SlotGaps(1)
    g.started(at=0.0, emitted=0.0)
    g.ended(0.5)
    assert g.started(at=0.53, emitted=0.52) == pytest.approx(0.01)
    g.ended(1.0)
    assert g.started(at=1.03, emitted=0.9) == pytest.approx(0.03)


def test_two_slots_take_the_earliest_free_and_the_average_follows() -> None:
    g = SlotGaps(2, alpha=0.5)
    g.started(0.0, 0.0)
    g.started(0.0, 0.0)
    g.ended(1.0)
    g.ended(2.0)
    assert g.started(2.5, 0.0) == pytest.approx(1.5)  # the slot free since 1.0
    assert g.started(2.5, 0.0) == pytest.approx(0.5)  # the one free since 2.0
    assert g.describe() == {"calls": 4, "mean_gap_ms": pytest.approx(625.0)}  # 0, 0, 1.5, 0.5
    for t in (3.0, 3.1, 3.2):  # more ends than starts: only the latest `slots` are kept
        g.ended(t)
    assert g.started(3.3, 0.0) == pytest.approx(0.2)
    with pytest.raises(ValueError):
        SlotGaps(0)


# ---------------------------------------------------------------- per-request server CPU


def test_request_cpu_is_cpu_per_request_between_readings() -> None:
    """Cumulative CPU readings and request counts give CPU seconds per request; readings
    closer than the interval, intervals without requests and readings that went down (a
    thread ended) change nothing."""
    from lenbatch.core.occupancy import RequestCpu

    m = RequestCpu(cores=2, alpha=0.5, min_interval_s=1.0)
    m.observe(0.0, 10.0, 0)  # the baseline
    assert m.per_request_s == 0 and not m.due(0.5) and m.due(1.0)
    m.observe(0.5, 99.0, 5)  # too soon: ignored
    m.observe(1.0, 10.2, 100)  # 0.2 s over 100 requests: 2 ms each (first: taken as is)
    assert m.per_request_s == pytest.approx(0.002)
    m.observe(2.0, 10.25, 100)  # no request: the baseline moves, the mean does not
    assert m.per_request_s == pytest.approx(0.002)
    m.observe(3.0, 10.65, 200)  # 4 ms each: half-way with alpha 0.5
    assert m.per_request_s == pytest.approx(0.003)
    m.observe(4.0, 5.0, 300)  # went down: ignored
    assert m.per_request_s == pytest.approx(0.003) and m.samples == 2
    assert m.describe() == {"cpu_per_request_ms": 3.0, "cores": 2, "intervals": 2}


def test_the_slowdown_is_the_simulators() -> None:
    """The live slowdown and the simulator's (`CostModel.slowdown`) are one formula: at 200
    requests/s of 5 ms each on 2 cores, half the cores go to request-side work."""
    from lenbatch.core.occupancy import RequestCpu, cpu_slowdown
    from lenbatch.plan.costmodel import CostModel

    assert cpu_slowdown(200, 0.005, 2) == pytest.approx(2.0)
    assert cpu_slowdown(0, 0.005, 2) == 1.0 and cpu_slowdown(200, 0.0, 2) == 1.0
    assert cpu_slowdown(1e9, 0.005, 2) == pytest.approx(10.0)  # capped
    m = RequestCpu(cores=2)
    m.per_request_s = 0.005
    cost = CostModel(0.01, cpu_per_request_s=0.005, cpu_cores=2)
    for rate in (0, 10, 100, 200, 350):
        assert m.slowdown(rate) == pytest.approx(cost.slowdown(rate))
