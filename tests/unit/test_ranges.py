"""Length ranges across replica groups (`lenbatch.core.ranges`) and the routing board."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lenbatch.core.costfit import CostCoefficients
from lenbatch.core.ranges import (
    LengthRanges,
    RequestCost,
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


# A call costs 20 ms, a padded token 0.1 ms: the fixed cost dominates short inputs.
COST = CostCoefficients(a=0.02, b=1e-4, c=1e-7)


def test_request_cost_is_padded_tokens_or_model_seconds_per_request() -> None:
    assert RequestCost().of(10, BOUNDS, MAX) == 16.0
    assert RequestCost().of(300, BOUNDS, MAX) == 300.0
    # Lane 0 runs batches of 4 on average: the 20 ms call is shared by 4 requests.
    cost = RequestCost(COST, batch=(4.0, 2.0))
    assert cost.of(10, BOUNDS, MAX) == pytest.approx(0.02 / 4 + 1e-4 * 16 + 1e-7 * 16**2)
    assert cost.of(20, BOUNDS, MAX) == pytest.approx(0.02 / 2 + 1e-4 * 32 + 1e-7 * 32**2)
    # Lanes without a measured batch size count one request per call.
    assert cost.of(300, BOUNDS, MAX) == pytest.approx(0.02 + 1e-4 * 300 + 1e-7 * 300**2)


def test_weighing_by_model_time_gives_the_short_range_fewer_requests() -> None:
    """Many short inputs, few long ones: padded tokens hand the short range most requests
    (the last benchmark's 68 %), though the per-call cost makes each short one relatively
    dear; weighed by model time, the cut moves down and each group's time share evens out."""
    sample = list(range(1, 17)) * 20 + [100] * 25
    by_tokens = plan_ranges(sample, BOUNDS, MAX, 2)
    by_time = plan_ranges(sample, BOUNDS, MAX, 2, cost=RequestCost(COST))
    assert by_time.cuts[0] < by_tokens.cuts[0]
    short_by_tokens = sum(n <= by_tokens.cuts[0] for n in sample)
    short_by_time = sum(n <= by_time.cuts[0] for n in sample)
    assert short_by_time < short_by_tokens
    # Under the cost model, the time-weighted plan is the more even one.
    seconds = [RequestCost(COST).of(n, BOUNDS, MAX) for n in sample]

    def time_shares(cut: int) -> tuple[float, float]:
        short = sum(w for n, w in zip(sample, seconds, strict=True) if n <= cut)
        return short / sum(seconds), 1 - short / sum(seconds)

    assert max(time_shares(by_time.cuts[0])) < max(time_shares(by_tokens.cuts[0]))
    assert by_time.shares == pytest.approx(time_shares(by_time.cuts[0]))


@given(
    st.lists(st.integers(1, MAX), min_size=1, max_size=200),
    st.integers(1, 5),
    st.floats(0, 0.1),
    st.floats(1e-6, 1e-3),
    st.lists(st.floats(1, 32), max_size=len(BOUNDS) + 1),
)
def test_time_weighted_plans_are_well_formed(
    sample: list[int], groups: int, a: float, b: float, batch: list[float]
) -> None:
    cost = RequestCost(CostCoefficients(a, b), tuple(batch))
    plan = plan_ranges(sample, BOUNDS, MAX, groups, cost=cost)
    assert plan.groups == groups and sum(plan.shares) == pytest.approx(1.0)
    assert all(x < y for x, y in zip(plan.cuts, plan.cuts[1:], strict=False))
    # The weight never falls as a request gets longer within one lane's batch size.
    assert all(cost.of(n, BOUNDS, MAX) > 0 for n in sample)


def test_a_new_cost_model_re_plans_the_window() -> None:
    ranges = LengthRanges(BOUNDS, MAX, 2, window=1024, check_every=64, min_sample=64)
    assert not ranges.set_cost(RequestCost(COST))  # nothing seen yet: nothing to weigh
    sample = list(range(1, 17)) * 20 + [100] * 25
    ranges.set_cost(RequestCost())
    ranges.observe(sample)
    cut_by_tokens = ranges.plan.cuts
    assert ranges.set_cost(RequestCost(COST))
    assert ranges.plan.cuts[0] < cut_by_tokens[0]
    assert not ranges.set_cost(RequestCost(COST))  # same weights: holds


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


def test_spill_on_expected_wait() -> None:
    """Owners 0.5 s of model time behind while another replica waits 0.1 s: the call spills
    when the gap passes `spill_wait`, whatever the call counts say."""
    groups = {"a": 0, "b": 1, "c": 1}
    counts = {"a": 1, "b": 2, "c": 2}
    waits = {"a": 0.1, "b": 0.6, "c": 0.5}
    ranks, spilled = rank_replicas(1, groups, counts, 64, waits, spill_wait=0.2)
    assert spilled and ranks == [["a"], ["c", "b"]]
    ranks, spilled = rank_replicas(1, groups, counts, 64, waits, spill_wait=0.5)
    assert not spilled and ranks == [["c", "b"], ["a"]]  # owners by expected wait
    ranks, spilled = rank_replicas(1, groups, counts, 64)  # no waits: calls in flight
    assert not spilled and ranks == [["b", "c"], ["a"]]


def test_board_tracks_expected_wait_per_replica() -> None:
    board = RoutingBoard(2)
    board.set_replicas(["r1", "r2"])
    board.routed("c1", "r2", owner=1, inputs=1, cost=0.5)
    board.routed("c2", "r2", owner=1, inputs=1, cost=0.25)
    waits = {r["replica"]: r["expected_wait_s"] for r in board.snapshot()["replicas"]}
    assert waits == {"r1": 0.0, "r2": 0.75}
    ranks, spilled = board.ranks(1, spill_at=64, spill_wait=0.5)
    assert spilled and ranks[0] == ["r1"]
    board.completed("c1")
    board.completed("c2")
    assert board.snapshot()["replicas"][1]["expected_wait_s"] == 0.0
    assert board.ranks(1, spill_at=64, spill_wait=0.5) == ([["r2"], ["r1"]], False)


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
