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
