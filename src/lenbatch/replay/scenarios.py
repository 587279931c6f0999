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
| `swing` | Poisson at 5 %, 80 %, 5 % of `rate` in three equal phases | mixed |
| `onoff` | each `period`: 150 % of `rate` for its first 30 %, then 5 % | mixed |
| `drift` | Poisson | short mix (80 % short) in the first half, long mix (40 % speech) after |
| `bimodal` | Poisson | 50 % short, 50 % speech |

For `swing` and `onoff`, `rate` is the reference (think: the server's capacity), not the mean.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import numpy.typing as npt

from lenbatch.plan.trace import IntArray, Trace
from lenbatch.replay.bodies import TextBuilder

__all__ = ["SCENARIOS", "LengthPools", "build_scenario", "pools_from_builder"]

LengthPools = Mapping[str, IntArray]

SCENARIOS = ("bursts", "long-heavy", "mixed", "swing", "onoff", "drift", "bimodal")

_MIXES = {
    "long-heavy": {"speech": 0.7, "paragraph": 0.2, "short": 0.1},
    "mixed": {"short": 0.5, "paragraph": 0.35, "speech": 0.15},
    "short-mix": {"short": 0.8, "paragraph": 0.2},
    "long-mix": {"short": 0.2, "paragraph": 0.4, "speech": 0.4},
    "bimodal": {"short": 0.5, "speech": 0.5},
}
_SWING = (0.05, 0.8, 0.05)  # share of `rate` in each third of a `swing`
_ON_SHARE, _ON_LOAD, _OFF_LOAD = 0.3, 1.5, 0.05  # `onoff`: ON part of a period, loads
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
    elif name in ("swing", "onoff"):
        if name == "swing":
            third = duration_s / 3
            phases = [(k * third, third, share * rate) for k, share in enumerate(_SWING)]
            desc = (
                f"scenario swing: Poisson at {', '.join(f'{x:.0%}' for x in _SWING)} of "
                f"{rate:g} req/s in thirds of {third:g} s, mixed lengths"
            )
        else:
            if period_s <= 0:
                raise ValueError(f"on/off period must be positive, got {period_s}")
            on = _ON_SHARE * period_s
            phases = []
            for start in np.arange(0.0, duration_s, period_s):
                phases.append((float(start), on, _ON_LOAD * rate))
                phases.append((float(start) + on, period_s - on, _OFF_LOAD * rate))
            desc = (
                f"scenario onoff: every {period_s:g} s, {on:g} s at {_ON_LOAD:.0%} of "
                f"{rate:g} req/s then {_OFF_LOAD:.0%}; mixed lengths"
            )
        parts = [
            t0 + _poisson(r, min(span, duration_s - t0), rng)
            for t0, span, r in phases
            if t0 < duration_s
        ]
        arrivals = np.concatenate(parts) if parts else np.empty(0)
        lengths = _draw(pools, _MIXES["mixed"], len(arrivals), rng)
    elif name == "drift":
        arrivals = _poisson(rate, duration_s, rng)
        first = arrivals < duration_s / 2
        lengths = np.empty(len(arrivals), dtype=np.int64)
        lengths[first] = _draw(pools, _MIXES["short-mix"], int(first.sum()), rng)
        lengths[~first] = _draw(pools, _MIXES["long-mix"], int((~first).sum()), rng)
        desc = (
            f"scenario drift: Poisson {rate:g} req/s; lengths 80% short until "
            f"{duration_s / 2:g} s, then 40% speech, 40% paragraph, 20% short"
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
