"""The Ray Serve request router's choices, with stand-ins for Ray's replica and request objects
(the router's own logic only; the live routing is tests/integration/test_ray_scaleout.py)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("ray", reason="needs the Ray extra: pip install 'lenbatch[ray]'")

from lenbatch.scaleout.board import RoutingBoard
from lenbatch.scaleout.router import LengthRangeRouter


@dataclass
class FakeReplica:
    uid: str

    @property
    def replica_id(self) -> Any:
        return SimpleNamespace(unique_id=self.uid)


@dataclass
class FakeRequest:
    kwargs: dict[str, Any]
    args: list[Any] = field(default_factory=lambda: [[[1, 2, 3]]])
    method: str = "embed"
    request_id: str = "call-1"

    def __post_init__(self) -> None:
        self.routing_context = SimpleNamespace(should_backoff=False)
        self.metadata = SimpleNamespace(
            call_method=self.method, internal_request_id=self.request_id
        )


def router(
    policy: str = "length", spill_at: int = 2, spill_wait: float = float("inf")
) -> tuple[LengthRangeRouter, list[FakeReplica]]:
    r = LengthRangeRouter.__new__(LengthRangeRouter)  # Ray's constructor needs a cluster
    r.board, r.policy, r.spill_at = RoutingBoard(2), policy, spill_at
    r.spill_wait = spill_wait
    replicas = [FakeReplica("a"), FakeReplica("b")]
    r.board.set_replicas(x.uid for x in replicas)  # a: group 0, b: group 1
    return r, replicas


def choose(r: LengthRangeRouter, replicas: list[FakeReplica], req: FakeRequest) -> list[list[str]]:
    ranks = asyncio.run(r.choose_replicas(replicas, req))  # type: ignore[arg-type]
    return [[x.uid for x in rank] for rank in ranks]


def test_owner_group_first_then_the_rest_and_backoff_is_on() -> None:
    r, replicas = router()
    req = FakeRequest({"group": 1})
    assert choose(r, replicas, req) == [["b"], ["a"]]
    assert req.routing_context.should_backoff


def test_saturated_owner_spills_and_the_board_counts_it() -> None:
    r, replicas = router(spill_at=2)
    for i in range(2):
        r.on_request_routed(
            FakeRequest({"group": 0}, request_id=f"c{i}"), replicas[0].replica_id, None
        )
    assert choose(r, replicas, FakeRequest({"group": 0})) == [["b"], ["a"]]
    r.on_request_routed(FakeRequest({"group": 0}, request_id="c9"), replicas[1].replica_id, None)
    snap = r.board.snapshot()
    assert snap["spills"] == {"0": 1} and snap["routed_total"] == 3
    r.on_request_completed(replicas[0].replica_id, "c0")
    assert {x["replica"]: x["in_flight"] for x in r.board.snapshot()["replicas"]} == {
        "a": 1,
        "b": 1,
    }


def test_owner_with_a_long_expected_wait_spills() -> None:
    """Calls carry their estimated model seconds (`cost`); once the owner's queue holds more
    than `spill_wait` seconds beyond the other replica's, the next call spills."""
    r, replicas = router(spill_at=64, spill_wait=0.3)
    call = FakeRequest({"group": 0, "cost": 0.2}, request_id="c0")
    r.on_request_routed(call, replicas[0].replica_id, None)
    assert choose(r, replicas, FakeRequest({"group": 0})) == [["a"], ["b"]]
    r.on_request_routed(
        FakeRequest({"group": 0, "cost": 0.2}, request_id="c1"), replicas[0].replica_id, None
    )
    assert choose(r, replicas, FakeRequest({"group": 0})) == [["b"], ["a"]]
    r.on_request_completed(replicas[0].replica_id, "c0")
    assert choose(r, replicas, FakeRequest({"group": 0})) == [["a"], ["b"]]


def test_control_calls_go_to_their_replica_and_are_not_counted() -> None:
    r, replicas = router()
    req = FakeRequest({"replica": "b"}, method="figures")
    assert choose(r, replicas, req) == [["b"]]
    assert choose(r, replicas, FakeRequest({"replica": "gone"}, method="figures")) == []
    r.on_request_routed(req, replicas[1].replica_id, None)
    assert r.board.snapshot()["routed_total"] == 0


def test_pow2_picks_two_replicas_regardless_of_length() -> None:
    r, replicas = router(policy="pow2")
    ranks = choose(r, replicas, FakeRequest({"group": None}))
    assert len(ranks) == 1 and sorted(ranks[0]) == ["a", "b"]


class FakeFiguresHandle:
    """A deployment handle whose `figures` call answers each replica's `/stats` from a table."""

    def __init__(self) -> None:
        self.stats: dict[str, dict[str, Any]] = {}
        self.figures = SimpleNamespace(remote=self._figures)

    async def _figures(self, replica: str) -> tuple[dict[str, Any], bytes]:
        return self.stats[replica], b""


def _bucket(label: str, batches: int, rows: int, padded_len: int, ms: float) -> dict[str, Any]:
    return {
        "bucket": label,
        "batches": batches,
        "requests": batches * rows,
        "real_tokens": batches * rows * padded_len,
        "padded_tokens": batches * rows * padded_len,
        "mean_batch_size": float(rows),
        "padding_waste": 0.0,
        "mean_exec_ms": ms,
    }


def test_the_ingress_fits_the_cost_model_on_the_replicas_batches() -> None:
    """Each refresh turns what every replica's buckets ran since the last one into cost-model
    observations; the fit (with each lane's batch size) prices requests and weighs the ranges,
    and a refresh with nothing new adds nothing."""
    from lenbatch.core.costfit import CostCoefficients
    from lenbatch.runners.base import ModelInfo
    from lenbatch.runners.fake import FakeRunner
    from lenbatch.scaleout.frontend import Frontend

    true = CostCoefficients(a=0.03, b=2e-4)
    handle = FakeFiguresHandle()
    board = RoutingBoard(2)
    board.set_replicas(["r1", "r2"])
    info = ModelInfo("m", 256, 0, "right", False, 1000, 8)
    frontend = Frontend(handle, board, FakeRunner().tokenize, info, [16, 64], refresh_s=0)

    def replica(k: int) -> dict[str, Any]:
        # k rounds of batches: lane <=16 runs batches of 8, lane <=64 of 4, overlong of 1.
        return {
            "per_bucket": [
                _bucket("<=16", 10 * k, 8, 16, 1000 * true.seconds(8, 16)),
                _bucket("<=64", 5 * k, 4, 64, 1000 * true.seconds(4, 64)),
                _bucket("overlong", 2 * k, 1, 200, 1000 * true.seconds(1, 200)),
            ]
        }

    handle.stats = {"r1": replica(1), "r2": replica(2)}
    frontend.ranges.observe([10] * 200)  # a window to re-weigh
    asyncio.run(frontend.refresh())
    assert frontend.cost_model.observed == 6  # 3 buckets x 2 replicas
    asyncio.run(frontend.refresh())  # nothing new
    assert frontend.cost_model.observed == 6
    handle.stats = {"r1": replica(3), "r2": replica(2)}
    asyncio.run(frontend.refresh())
    assert frontend.cost_model.observed == 9
    # While the window is young the generic prior (20 ms, 0.25 ms/token) still pulls: the fit
    # lies between it and the truth, and predicts the observed shapes closely.
    fit = frontend.cost_model.coefficients
    assert 0.02 < fit.a <= 0.03 * 1.02
    for rows, length in ((8, 16), (4, 64), (1, 200)):
        assert fit.seconds(rows, length) == pytest.approx(true.seconds(rows, length), rel=0.15)
    assert frontend.request_cost.batch == (8.0, 4.0, 1.0)
    assert frontend.ranges.cost == frontend.request_cost
    # A 10-token input: its lane's call shared by 8, plus 16 padded tokens.
    assert frontend.cost_of([10]) == pytest.approx(fit.seconds(8, 16) / 8)
    assert frontend.stats()["cost_model"]["observed_batches"] == 9
