"""Synthetic traffic with real lengths: short-request bursts, concentrated long requests, mixed.

Arrival processes are synthetic (seeded, so a scenario is the same every run); input lengths
are drawn from the bundled real text, measured with the served model's tokenizer:

- `short`: GSM8K questions (≈ 20-200 tokens),
- `paragraph`: paragraphs of US inaugural addresses (≈ 10-500 tokens),
- `speech`: whole inaugural addresses (thousands of tokens: they land at the model's limit
  once `--max-length` clips them, as real traffic piles up under the context limit).

Output lengths (for completions) are GSM8K answer lengths. The result is a `Trace`, so the same
mapping options (`--max-length`, `--rate-scale`, ...) apply afterwards.

| scenario | arrivals | lengths |
|---|---|---|
| `bursts` | 30 % Poisson + bursts every `period` s, 0.25 s wide | bursts: short; rest: mixed |
| `long-heavy` | Poisson | 70 % speech, 20 % paragraph, 10 % short |
| `mixed` | Poisson | 50 % short, 35 % paragraph, 15 % speech |
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import numpy.typing as npt

from lenbatch.plan.trace import Trace
from lenbatch.replay.bodies import TextBuilder

__all__ = ["SCENARIOS", "LengthPools", "build_scenario", "pools_from_builder"]

IntArray = npt.NDArray[np.int64]
LengthPools = Mapping[str, IntArray]

SCENARIOS = ("bursts", "long-heavy", "mixed")

_MIXES = {
    "long-heavy": {"speech": 0.7, "paragraph": 0.2, "short": 0.1},
    "mixed": {"short": 0.5, "paragraph": 0.35, "speech": 0.15},
}
_BURST_SHARE = 0.7  # share of `bursts` traffic that comes in bursts
_BURST_WIDTH_S = 0.25


def pools_from_builder(builder: TextBuilder) -> dict[str, IntArray]:
    """Real length pools, in the builder's tokenizer: short / paragraph / speech / output."""
    return {
        "short": builder.unit_lengths("gsm8k"),
        "paragraph": builder.unit_lengths("inaugural"),
        "speech": builder.unit_lengths("inaugural-speech"),
        "output": builder.unit_lengths("gsm8k-answers"),
    }


def _draw(
    pools: LengthPools, mix: Mapping[str, float], n: int, rng: np.random.Generator
) -> IntArray:
    kinds = list(mix)
    p = np.asarray([mix[k] for k in kinds], dtype=np.float64)
    which = rng.choice(len(kinds), size=n, p=p / p.sum())
    out = np.empty(n, dtype=np.int64)
    for j, k in enumerate(kinds):
        sel = which == j
        out[sel] = rng.choice(pools[k], size=int(sel.sum()))
    return out


def _poisson(rate: float, duration: float, rng: np.random.Generator) -> npt.NDArray[np.float64]:
    n = int(rng.poisson(rate * duration))
    return np.sort(rng.uniform(0.0, duration, size=n))


def build_scenario(
    name: str,
    pools: LengthPools,
    *,
    rate: float,
    duration_s: float,
    seed: int = 0,
    period_s: float = 5.0,
) -> Trace:
    """The scenario `name` at a mean of `rate` requests/s for `duration_s` seconds."""
    if name not in SCENARIOS:
        raise ValueError(f"unknown scenario {name!r}; choose one of: {', '.join(SCENARIOS)}")
    if rate <= 0 or duration_s <= 0:
        raise ValueError(f"rate and duration must be positive, got {rate} and {duration_s}")
    missing = {"short", "paragraph", "speech"} - set(pools)
    if missing:
        raise ValueError(f"length pools missing: {sorted(missing)}")
    rng = np.random.default_rng(seed)
    if name == "bursts":
        if period_s <= 0:
            raise ValueError(f"burst period must be positive, got {period_s}")
        bg = _poisson(rate * (1 - _BURST_SHARE), duration_s, rng)
        bg_len = _draw(pools, _MIXES["mixed"], len(bg), rng)
        starts = np.arange(0.0, duration_s, period_s)
        per_burst = max(1, round(rate * _BURST_SHARE * period_s))
        burst_t = (
            starts[:, None] + rng.uniform(0, _BURST_WIDTH_S, (len(starts), per_burst))
        ).ravel()
        burst_t = burst_t[burst_t < duration_s]
        burst_len = rng.choice(pools["short"], size=len(burst_t))
        arrivals = np.concatenate([bg, burst_t])
        lengths = np.concatenate([bg_len, burst_len])
        desc = (
            f"scenario bursts: {per_burst} short requests within {_BURST_WIDTH_S} s every "
            f"{period_s:g} s + Poisson background; mean {rate:g} req/s"
        )
    else:
        arrivals = _poisson(rate, duration_s, rng)
        lengths = _draw(pools, _MIXES[name], len(arrivals), rng)
        mix = ", ".join(f"{int(100 * v)}% {k}" for k, v in _MIXES[name].items())
        desc = f"scenario {name}: Poisson {rate:g} req/s, lengths {mix}"
    order = np.argsort(arrivals, kind="stable")
    arrivals = arrivals[order]
    lengths = lengths[order]
    outputs = None
    if "output" in pools:
        outputs = rng.choice(pools["output"], size=len(arrivals)).astype(np.int64)
    if len(arrivals):
        arrivals = arrivals - arrivals[0]
    return Trace(
        input_lengths=lengths.astype(np.int64),
        arrivals=arrivals.astype(np.float64),
        output_lengths=outputs,
        source=f"scenario:{name}",
        notes=(f"{desc}; {duration_s:g} s, seed {seed}; lengths from the bundled real text",),
    )
