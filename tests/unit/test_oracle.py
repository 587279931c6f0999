"""The offline oracle: optimal batching of known lengths, never beaten by a live strategy."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from lenbatch.config import AdaptiveConfig, AdmissionConfig, BatchingConfig, ShedMode, Strategy
from lenbatch.plan.costmodel import CostModel
from lenbatch.plan.oracle import oracle, oracle_for
from lenbatch.plan.sim import simulate
from lenbatch.plan.trace import Trace

COST = CostModel(const=0.004, per_row=0.0002, per_token=2e-5, per_token_sq=1e-8)


def partitions(items: list[int]) -> Iterator[list[list[int]]]:
    """Every set partition of `items` (Bell number many; keep it tiny)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in partitions(rest):
        for i in range(len(part)):
            yield [*part[:i], [first, *part[i]], *part[i + 1 :]]
        yield [[first], *part]


def brute_force(lengths: list[int], max_batch: int, budget: int) -> float:
    best = float("inf")
    for part in partitions(lengths):
        if any(len(b) > max_batch or len(b) * max(b) > budget for b in part):
            continue
        best = min(best, sum(COST.latency(len(b), max(b)) for b in part))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_oracle_equals_brute_force_over_all_partitions(seed: int) -> None:
    """On 7 lengths, the DP over sorted cuts finds the best of all 877 partitions."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 120, 7).tolist()
    mb, budget = int(rng.integers(1, 5)), int(rng.choice([150, 300, 1000]))
    o = oracle(lengths, COST, max_batch=mb, max_batch_tokens=budget)
    assert o.busy_s == pytest.approx(brute_force(lengths, mb, budget), rel=1e-12)


def test_oracle_accounting() -> None:
    """Tokens, batches and waste of the ideal schedule add up."""
    o = oracle([10, 10, 10, 100], CostModel(const=1.0), max_batch=3, max_batch_tokens=10_000)
    # constant cost per batch: fewest batches; the best 2-batch cut pads 3x10 + 1x100
    assert (o.batches, o.padded_tokens, o.real_tokens) == (2, 130, 130)
    assert o.busy_s == 2.0
    assert o.throughput_rps == 2.0
    assert o.padding_waste == 0.0
    two = oracle([10, 10, 10, 100], CostModel(const=1.0), max_batch=3, max_batch_tokens=10_000,
                 concurrency=2)  # fmt: skip
    assert two.throughput_rps == 4.0


def test_memory_budget_limits_the_ideal_batches() -> None:
    """A memory budget that fits two rows of 50 tokens forces batches of two."""
    cost = CostModel(const=1.0, weights_bytes=1000, act_per_token=10.0)
    budget = 1000 + 10 * 2 * 50
    o = oracle([50] * 6, cost, max_batch=6, max_batch_tokens=10_000, memory_budget_bytes=budget)
    assert o.batches == 3


def test_oracle_for_leaves_out_what_the_server_would_reject() -> None:
    """Over the limit: dropped, or cut when truncating."""
    cfg = BatchingConfig(max_batch=4)
    assert oracle_for([10, 300], COST, cfg, max_length=256).requests == 1
    assert oracle_for([10, 300], COST, cfg, max_length=256, truncate=True).real_tokens == 266


@pytest.mark.parametrize("rate", [20.0, 200.0, 2000.0])
def test_oracle_is_never_below_any_strategy(rate: float) -> None:
    """From light load to heavy overload, no strategy serves the trace faster than the oracle
    (queue bound large enough that every strategy completes every request)."""
    rng = np.random.default_rng(11)
    n = 2000
    arrivals = np.sort(rng.uniform(0, n / rate, n))
    lengths = np.clip(rng.lognormal(3.5, 0.8, n).astype(np.int64), 1, 256)
    t = Trace(lengths, arrivals)
    cfg = BatchingConfig(max_batch=16, max_batch_tokens=2048)
    o = oracle_for(lengths, COST, cfg)
    for s in Strategy:
        run = simulate(t, COST, cfg.model_copy(update={"strategy": s}),
                       AdmissionConfig(max_queue_total=n),
                       adaptive=AdaptiveConfig(shed=ShedMode.LATE))  # fmt: skip
        summ = run.summary()
        assert summ["completed"] == n
        assert summ["throughput_rps"] <= o.throughput_rps
        assert summ["real_tokens_per_s"] <= o.real_tokens_per_s
        assert run.busy_s >= o.busy_s
