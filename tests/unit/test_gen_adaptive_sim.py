"""Issue 25's bar for adaptive generation, in simulation (`plan.gensim`): with SmolLM2-sized
costs on two cores, at 2x capacity adaptive's goodput (TTFT <= 1 s, mean inter-token <=
150 ms) is >= 1.5x that of `continuous` with its best running cap; below capacity it sheds
(almost) nothing and matches the best cap."""

from __future__ import annotations

import math
import random

import pytest

from lenbatch.config import AdaptiveConfig, GenerationConfig
from lenbatch.core.costfit import CostCoefficients
from lenbatch.generate.adaptive import AdaptiveGenPolicy
from lenbatch.generate.costs import GenCosts
from lenbatch.generate.policy import ContinuousPolicy
from lenbatch.plan.gensim import GenRequest, goodput, simulate_generation

# The generic priors' order of magnitude (SmolLM2-135M bf16, two cores): the policy starts from
# other coefficients than the truth, and learns them from the units it sees.
PREFILL = CostCoefficients(0.025, 4e-4)
DECODE = CostCoefficients(0.04, 1e-5)
SPAN = 60.0
CAPS = (4, 8, 16, 32)


def _requests(rate: float, seed: int) -> list[GenRequest]:
    """Poisson arrivals; prompts 20-400 tokens, outputs 8-64 (the completions mapping's range)."""
    rnd, t, out = random.Random(seed), 0.0, []
    while (t := t + rnd.expovariate(rate)) <= SPAN:
        out.append(GenRequest(t, rnd.randint(20, 400), rnd.randint(8, 64)))
    return out


def _capacity() -> float:
    """Completions per second of continuous (cap 32) far past saturation."""
    outs = simulate_generation(_requests(30.0, 0), ContinuousPolicy(32, 256), PREFILL, DECODE)
    done = [o.finished for o in outs if not math.isnan(o.finished)]
    return len(done) / max(done)


def _adaptive() -> AdaptiveGenPolicy:
    cfg = AdaptiveConfig(slo_ms=1000, itl_slo_ms=150)
    return AdaptiveGenPolicy(GenerationConfig(max_running=64), cfg, GenCosts("smollm2"))


@pytest.mark.parametrize("seed", [1, 2])
def test_twice_capacity_adaptive_beats_the_best_cap_by_half(seed: int) -> None:
    """At 2x capacity: adaptive >= 1.5x continuous at its best cap; what it admits is good."""
    reqs = _requests(2 * _capacity(), seed)
    best = max(
        goodput(simulate_generation(reqs, ContinuousPolicy(c, 256), PREFILL, DECODE), SPAN)
        for c in CAPS
    )
    outs = simulate_generation(reqs, _adaptive(), PREFILL, DECODE)
    ours = goodput(outs, SPAN)
    assert ours >= 1.5 * best, (ours, best)
    admitted = [o for o in outs if not o.refused]
    good = [o for o in admitted if o.ttft <= 1.0 and o.mean_itl <= 0.150]
    assert len(good) >= 0.8 * len(admitted)


@pytest.mark.parametrize("load", [0.3, 0.5])
def test_below_capacity_it_sheds_nothing_and_matches_the_best_cap(load: float) -> None:
    """At 0.3-0.5x capacity: <= 1 % refused, goodput >= 0.97x the best cap's."""
    reqs = _requests(load * _capacity(), 7)
    best = max(
        goodput(simulate_generation(reqs, ContinuousPolicy(c, 256), PREFILL, DECODE), SPAN)
        for c in CAPS
    )
    outs = simulate_generation(reqs, _adaptive(), PREFILL, DECODE)
    assert sum(o.refused for o in outs) <= 0.01 * len(outs)
    assert goodput(outs, SPAN) >= 0.97 * best


def test_every_request_ends_once_and_streams_make_sense() -> None:
    """Every request is either refused or has a TTFT and a finish after it."""
    outs = simulate_generation(_requests(10.0, 3), _adaptive(), PREFILL, DECODE)
    for o in outs:
        assert o.refused == math.isnan(o.finished)
        if not o.refused:
            assert o.ttft >= 0 and o.mean_itl >= 0


def test_a_chunk_costs_its_real_prompt_tokens_unless_told_padded() -> None:
    """Prompts of 10 and 300 tokens in one job (left-padded to 300): their one chunk costs
    `prefill.seconds(1, 310)` by real tokens (the lean path), `prefill.seconds(2, 300)` by
    padded shape (transformers' forward); both get their first token when it ends."""
    reqs = [GenRequest(0.0, 10, 2), GenRequest(0.0, 300, 2)]
    for real, took in ((True, PREFILL.seconds(1, 310)), (False, PREFILL.seconds(2, 300))):
        outs = simulate_generation(
            reqs, ContinuousPolicy(32, 4096), PREFILL, DECODE, real_tokens=real
        )
        assert [o.ttft for o in outs] == pytest.approx([took, took])


def test_adaptive_learns_on_the_basis_the_simulator_prices() -> None:
    """The simulator sets adaptive's cost models to its own pricing basis, as the engine sets
    them from its runner: after a run by real tokens its prefill model holds ~0.4 ms per real
    token (the truth), not per padded one."""
    reqs = _requests(8.0, 5)
    for real in (True, False):
        policy = _adaptive()
        simulate_generation(reqs, policy, PREFILL, DECODE, real_tokens=real)
        assert policy.costs.real_tokens is real
        assert policy.costs.prefill.seconds(1, 300) == pytest.approx(
            PREFILL.seconds(1, 300), rel=0.05
        )


def test_simulate_generation_cli_prints_each_cap_and_adaptive(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`lenbatch simulate-generation` on the bundled dev trace's completions mapping prints a
    row per load with every cap's goodput and adaptive's; its default costs are the priors."""
    from lenbatch.cli import build_parser
    from lenbatch.cli import gensim as cli
    from lenbatch.generate.costs import DECODE_PRIOR, PREFILL_PRIOR

    assert (cli.PREFILL_DEFAULT, cli.DECODE_DEFAULT) == (PREFILL_PRIOR, DECODE_PRIOR)
    args = build_parser().parse_args(
        ["simulate-generation", "--duration", "30", "--loads", "2", "--caps", "8,32"]
    )
    assert args.run(args) == 0
    out = capsys.readouterr().out
    assert "| load | cap 8 | cap 32 | adaptive | refused |" in out
    (row,) = [line for line in out.splitlines() if line.startswith("| 2x |")]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert float(cells[3]) >= 1.5 * max(float(cells[1]), float(cells[2]))
