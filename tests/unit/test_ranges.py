"""Length ranges across replica groups (`lenbatch.core.ranges`) and the routing board."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lenbatch.core.ranges import (
    LengthRanges,
    assign_groups,
    padded_work,
    plan_ranges,
    rank_replicas,
)
from lenbatch.scaleout.board import RoutingBoard
from lenbatch.scaleout.figures import aggregate_replicas, merge_expositions

BOUNDS = (16, 32, 64, 128)
MAX = 512


def test_padded_work_is_the_bucket_ceiling_or_the_length_when_overlong() -> None:
    assert padded_work(1, BOUNDS, MAX) == 16
    assert padded_work(16, BOUNDS, MAX) == 16
    assert padded_work(17, BOUNDS, MAX) == 32
    assert padded_work(128, BOUNDS, MAX) == 128
    assert padded_work(300, BOUNDS, MAX) == 300  # overlong lane: padded to itself at most


def test_cut_lands_on_a_boundary_when_that_balances_the_work() -> None:
    # 200 inputs of 10 tokens (16 padded each: 3200) and 25 of 100 tokens (128 each: 3200).
    sample = [10] * 200 + [100] * 25
    plan = plan_ranges(sample, BOUNDS, MAX, 2)
    assert plan.cuts == (16,)
    assert plan.shares == pytest.approx((0.5, 0.5))
    assert plan.owner(10) == 0 and plan.owner(16) == 0 and plan.owner(17) == 1
    assert plan.owner(100) == 1


def test_cut_falls_inside_a_bucket_when_no_boundary_balances() -> None:
    # Every length in one bucket (same padded work each): the work median splits them.
    sample = list(range(1, 61))
    plan = plan_ranges(sample, (64,), MAX, 2)
    assert plan.cuts == (30,)
    assert plan.shares == pytest.approx((0.5, 0.5))


def test_one_group_owns_everything() -> None:
    plan = plan_ranges([5, 50, 500], BOUNDS, MAX, 1)
    assert plan.cuts == () and plan.owner(500) == 0 and plan.shares == (1.0,)


def test_describe_gives_contiguous_ranges() -> None:
    rows = plan_ranges([10] * 200 + [100] * 25, BOUNDS, MAX, 2).describe()
    assert rows[0]["min_len"] == 1 and rows[0]["max_len"] == 16
    assert rows[1]["min_len"] == 17 and rows[1]["max_len"] is None


@given(
    st.lists(st.integers(1, MAX), min_size=1, max_size=200),
    st.integers(1, 6),
)
def test_plans_are_well_formed(sample: list[int], groups: int) -> None:
    plan = plan_ranges(sample, BOUNDS, MAX, groups)
    assert plan.groups == groups
    assert all(a < b for a, b in zip(plan.cuts, plan.cuts[1:], strict=False))
    assert sum(plan.shares) == pytest.approx(1.0)
    owners = [plan.owner(n) for n in range(1, MAX + 1)]
    assert owners == sorted(owners)  # contiguous ranges, in length order
    assert set(owners) <= set(range(groups))


def test_drift_re_plans_once_and_then_holds() -> None:
    ranges = LengthRanges(BOUNDS, MAX, 2, window=512, check_every=64, min_sample=64)
    before = ranges.plan.cuts
    # Traffic far shorter than the prior (bucket middles): all work on group 0 at first.
    assert not ranges.observe([5] * 63)  # below check_every: no check yet
    changed = ranges.observe([5] * 150 + [60] * 50)
    assert changed and ranges.rebalances == 1
    assert ranges.plan.cuts != before
    assert max(ranges.current_shares()) <= 0.5 * 1.25
    # The same mix again: within the drift tolerance, nothing moves.
    assert not ranges.observe([5] * 150 + [60] * 50)
    assert ranges.rebalances == 1


def test_assign_groups_keeps_replicas_and_fills_the_empty_group() -> None:
    first = assign_groups({}, ["b", "a"], 2)
    assert first == {"a": 0, "b": 1}
    # "a" died, "c" replaced it: "c" takes group 0, "b" keeps group 1.
    assert assign_groups(first, ["b", "c"], 2) == {"b": 1, "c": 0}
    # Scale up: the newcomers balance the groups.
    assert assign_groups({"b": 1, "c": 0}, ["b", "c", "d", "e"], 2) == {
        "b": 1,
        "c": 0,
        "d": 0,
        "e": 1,
    }


def test_rank_owner_first_then_spill_when_saturated() -> None:
    groups = {"a": 0, "b": 1, "c": 1}
    ranks, spilled = rank_replicas(1, groups, {"b": 3, "c": 1}, spill_at=8)
    assert ranks == [["c", "b"], ["a"]] and not spilled
    ranks, spilled = rank_replicas(1, groups, {"a": 2, "b": 9, "c": 8}, spill_at=8)
    assert ranks == [["a"], ["c", "b"]] and spilled
    # Saturated owners, but the others are busier still: stay home.
    ranks, spilled = rank_replicas(1, groups, {"a": 20, "b": 9, "c": 8}, spill_at=8)
    assert ranks[0] == ["c", "b"] and not spilled
    # The owning group has no live replica: spill to the rest.
    ranks, spilled = rank_replicas(2, groups, {}, spill_at=8)
    assert spilled and ranks == [["a", "b", "c"]]


def test_board_counts_routes_spills_in_flight_and_replacements() -> None:
    board = RoutingBoard(2)
    assert board.set_replicas(["r1", "r2"]) == {"r1": 0, "r2": 1}
    board.routed("c1", "r1", owner=0, inputs=3)
    board.routed("c2", "r1", owner=1, inputs=1)  # group 1's call placed on r1: a spill
    board.routed("c3", "r2", owner=-1, inputs=1)  # routed without regard to length
    snap = board.snapshot()
    assert snap["routed_total"] == 3 and snap["spills"] == {"1": 1}
    assert {r["replica"]: r["in_flight"] for r in snap["replicas"]} == {"r1": 2, "r2": 1}
    board.completed("c1")
    board.completed("c1")  # a second completion of the same call changes nothing
    assert {r["replica"]: r["in_flight"] for r in board.snapshot()["replicas"]}["r1"] == 1
    routed = {(r["owner_group"], r["replica"]): r["inputs"] for r in snap["routed"]}
    assert routed == {(0, "r1"): 3, (1, "r1"): 1, (-1, "r2"): 1}
    assert board.set_replicas(["r2", "r3"]) == {"r2": 1, "r3": 0}
    assert board.snapshot()["replicas_replaced"] == 1


def test_replica_figures_are_summed_per_bucket() -> None:
    def replica(batches: int, requests: int, real: int, padded: int) -> dict[str, object]:
        row = {
            "bucket": "<=16",
            "batches": batches,
            "requests": requests,
            "real_tokens": real,
            "padded_tokens": padded,
            "mean_exec_ms": 10.0,
        }
        return {
            "batches": batches,
            "real_tokens": real,
            "padded_tokens": padded,
            "requests": {"ok": requests},
            "per_bucket": [row],
        }

    out = aggregate_replicas([replica(2, 8, 60, 100), replica(6, 8, 20, 100)])
    assert out["batches"] == 8 and out["mean_batch_size"] == 2.0
    assert out["padding_waste"] == pytest.approx(1 - 80 / 200)
    assert out["requests"] == {"ok": 16}
    assert out["per_bucket"][0]["mean_exec_ms"] == pytest.approx(10.0)


def test_expositions_merge_with_replica_labels() -> None:
    text = (
        b"# HELP lenbatch_batches_total Batches run\n# TYPE lenbatch_batches_total counter\n"
        b'lenbatch_batches_total{bucket="<=16"} 3.0\n'
    )
    merged = merge_expositions([("r1", 0, text), ("r2", 1, text.replace(b"3.0", b"5.0"))])
    lines = merged.decode().splitlines()
    assert sum(1 for x in lines if x.startswith("# TYPE lenbatch_batches_total")) == 1
    assert 'lenbatch_batches_total{bucket="<=16",group="0",replica="r1"} 3.0' in lines
    assert 'lenbatch_batches_total{bucket="<=16",group="1",replica="r2"} 5.0' in lines
