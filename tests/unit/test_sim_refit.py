"""The simulator runs the engine's online re-fit of the boundaries (strategy `adaptive`):
the same `Refitter`, the same swap rule (`core.refit.BoundarySwap`), the same re-bucketing.
Virtual clock, no sleeps."""

from __future__ import annotations

import numpy as np

from lenbatch.config import AdaptiveConfig, BatchingConfig, Strategy
from lenbatch.core.refit import BoundarySwap, Refitter, padded_per_request
from lenbatch.plan.costmodel import CostModel
from lenbatch.plan.sim import simulate
from lenbatch.plan.summary import OUTCOME_OK
from lenbatch.plan.trace import Trace

# A call's fixed cost of 250 padded tokens: small next to the padding a drift wastes.
COST = CostModel(const=0.0005, per_token=2e-6)
START = (16, 32, 64, 128)


def drift_trace(n_each: int = 600, seed: int = 0) -> tuple[Trace, np.ndarray]:
    """A short mix (5-40 tokens) then a long mix (150-250 tokens), Poisson at 100/s."""
    rng = np.random.default_rng(seed)
    short = rng.integers(5, 41, n_each)
    long = rng.integers(150, 251, n_each)
    lengths = np.concatenate([short, long]).astype(np.int64)
    arrivals = np.cumsum(rng.exponential(0.01, len(lengths)))
    return Trace(lengths, arrivals), long


def run(refit: bool, boundaries: object = START) -> tuple[object, Trace, np.ndarray]:
    t, long = drift_trace()
    batching = BatchingConfig.model_validate(
        {"strategy": Strategy.ADAPTIVE, "boundaries": boundaries, "max_batch": 32}
    )
    ac = AdaptiveConfig(
        slo_ms=60_000, refit=refit, refit_min_requests=100, refit_min_interval_s=0.5
    )
    return simulate(t, COST, batching, max_length=256, adaptive=ac), t, long


def test_drift_with_refit_swaps_to_boundaries_that_fit_the_long_mix() -> None:
    sim, t, long = run(refit=True)
    assert sim.refit is not None and sim.refit["refits"] >= 1
    final = sim.cfg.boundaries
    assert final != START
    # The final boundaries pad the long mix far less than the start ones (whose overlong
    # lane pads everything to 250) and cut it inside the long range.
    assert padded_per_request(final, long, 0.0) < 0.9 * padded_per_request(START, long, 0.0)
    assert any(150 <= b <= 250 for b in final[:-1]) or len(final) == 1
    # Every request answered exactly once: all OK, and each ran in exactly one batch.
    assert (sim.outcomes == OUTCOME_OK).all()
    assert sum(s.requests for s in sim.lane_stats) == len(t)
    assert len(sim.labels) == len(sim.lane_stats) == len(sim.cfg.lanes)
    assert (sim.lanes >= 0).all() and (sim.lanes < len(sim.cfg.lanes)).all()
    assert sim.summary()["completed"] == len(t)


def test_refit_off_never_refits() -> None:
    sim, t, _ = run(refit=False)
    assert sim.refit is None
    assert sim.cfg.boundaries == START
    assert (sim.outcomes == OUTCOME_OK).all()
    assert sum(s.requests for s in sim.lane_stats) == len(t)


def test_auto_boundaries_learn_from_the_first_requests() -> None:
    sim, t, _ = run(refit=False, boundaries="auto")
    assert sim.refit is not None and sim.refit["refits"] >= 1
    assert sim.refit["events"][0]["old"] == [256]
    assert len(sim.cfg.boundaries) > 1
    assert sum(s.requests for s in sim.lane_stats) == len(t)


def test_the_refits_chain_from_the_start_boundaries_to_the_final_ones() -> None:
    """Each logged re-fit starts from the boundaries the previous one swapped to."""
    sim, _, _ = run(refit=True)
    assert sim.refit is not None
    bounds = START
    for ev in sim.refit["events"]:
        assert tuple(ev["old"]) == bounds
        bounds = tuple(ev["new"])
    assert bounds == sim.cfg.boundaries


def test_boundary_swap_holds_while_batches_are_in_flight() -> None:
    ref = Refitter(
        max_length=256, sample=200, min_requests=50, overhead_tokens=0.0, min_interval=0.0
    )
    swap = BoundarySwap(ref)
    for x in range(150, 250, 2):  # 50 long lengths: START pads them all to 248
        ref.observe(x)
    assert swap.step(1.0, START, inflight=2) is None
    assert swap.holding  # a swap is pending: hold new batches
    assert swap.step(1.1, START, inflight=1) is None and swap.holding
    new = swap.step(1.2, START, inflight=0)
    assert new is not None and new != START and not swap.holding
    assert len(ref.events) == 1  # proposed once, swapped once


def test_boundary_swap_asks_nothing_while_not_accepting() -> None:
    ref = Refitter(
        max_length=256, sample=200, min_requests=50, overhead_tokens=0.0, min_interval=0.0
    )
    swap = BoundarySwap(ref)
    for x in range(150, 250, 2):  # 50 long lengths: START pads them all to 248
        ref.observe(x)
    assert swap.step(1.0, START, inflight=0, accepting=False) is None
    assert not swap.holding and ref.checks == 0
