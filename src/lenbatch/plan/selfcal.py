"""Self-calibration: a server measures its own cost model when none was measured on this
processor, and keeps it in the user's cache folder so the next start loads it at once.

The cache (`plan.costcache`) keys each file by processor key (with its thread count), dtype,
quantization, execution, lenbatch and torch version: a change of any of them measures afresh.

`calibrate_runner` is a bounded `lenbatch profile`: the grid's points run smallest first and a
point is skipped when its predicted time (from the points measured so far) would pass the
budget, so a start-up never spends more than `budget_s` (default 30 s) measuring. Memory is not
measured (the online scheduler does not read it). `auto_cost` is what `serve --cost auto`
does: the cache, then the cost folders (`plan.costsource.choose_auto`), then, where the
strategy reads a cost model, calibrate and cache.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

from lenbatch.core.clock import Clock
from lenbatch.core.costkey import CostKey, WorkKind
from lenbatch.plan.costcache import cached_cost, store_cost
from lenbatch.plan.costmodel import CostModel
from lenbatch.plan.costsource import AUTO, choose_auto

__all__ = [
    "CALIBRATION_BUDGET_S",
    "GENERIC",
    "auto_cost",
    "calibrate_runner",
    "runner_key",
    "serve_cost_spec",
]

log = logging.getLogger("lenbatch.selfcal")

CALIBRATION_BUDGET_S = 30.0
# `--cost generic`: start at once on the online cost model's generic CPU prior (no file, no
# start-up measurement); the engine's own batches then correct it.
GENERIC = "generic"
# The grid a start-up calibration samples (capped to the model's limit and the batch budget),
# visited smallest first: small shapes fix the per-call constant, the larger ones the per-token
# terms; four points at least are needed to fit the four terms.
_BATCHES = (1, 4, 16, 32)
_LENGTHS = (16, 64, 128, 256, 512)
_REPEATS = 3
_WARMUP = 1


def _grid(max_length: int, max_tokens: int) -> list[tuple[int, int]]:
    lengths = sorted({min(n, max_length) for n in _LENGTHS})
    shapes = {(b, n) for b in _BATCHES for n in lengths if b * n <= max_tokens}
    return sorted(shapes, key=lambda s: (s[0] * s[1], s[0]))


def calibrate_runner(
    runner: Any,
    *,
    budget_s: float = CALIBRATION_BUDGET_S,
    device: str = "cpu",
    max_tokens: int = 8192,
    clock: Clock | None = None,
) -> CostModel:
    """A cost model of `runner` (an `EmbeddingRunner`) measured within about `budget_s`
    seconds: `lenbatch profile`'s fit on the grid points that fit the budget, smallest first
    (see the module docstring). Raises RuntimeError when fewer than four points fit."""
    from lenbatch.plan.profile import NoMemoryProbe, PerfClock, fit_cost_model, profile_runner
    from lenbatch.runners.base import PackedEmbeddingRunner
    from lenbatch.runners.hardware import processor_key

    clock = clock or PerfClock()
    start = clock.now()
    deadline = start + budget_s
    calls = _REPEATS + _WARMUP
    points: list[Any] = []  # profile.ProfilePoint
    per_token = 0.0  # worst seconds per padded token seen so far, to predict the next point
    per_call = 0.0
    for rows, length in _grid(runner.info.max_length, max_tokens):
        predicted = calls * (per_call + per_token * rows * length)
        if points and clock.now() + predicted > deadline:
            continue  # a smaller point further on may still fit
        (point,) = profile_runner(
            runner,
            [rows],
            [length],
            repeats=_REPEATS,
            warmup=_WARMUP,
            probe=NoMemoryProbe(),
            seed=len(points),
            clock=clock,
        )
        points.append(point)
        per_call = min(per_call or point.latency_s, point.latency_s)
        per_token = max(per_token, (point.latency_s - per_call) / (rows * length))
    spent = clock.now() - start
    if len(points) < 4:
        raise RuntimeError(
            f"self-calibration measured only {len(points)} shapes in {spent:.1f} s (budget "
            f"{budget_s:g} s; 4 are needed): pass --cost FILE from `lenbatch profile`"
        )
    cost = fit_cost_model(
        points,
        weights_bytes=runner.memory().weights,
        model=runner.info.name,
        device=device,
        memory_method="not measured (start-up self-calibration)",
    )
    precision = getattr(runner, "precision", None)
    log.info(
        "self-calibration: %d batch shapes in %.1f s (budget %g s), fit error %.1f %%",
        len(points),
        spent,
        budget_s,
        100 * cost.fit_error,
    )
    return dataclasses.replace(
        cost,
        processor=processor_key(device),
        dtype=precision.name if precision is not None else "",
        execution="packed" if isinstance(runner, PackedEmbeddingRunner) else "padded",
        quantization=getattr(runner, "quantization", "none"),
    )


def runner_key(runner: Any, device: str = "cpu") -> tuple[CostKey, str]:
    """The `CostKey` and execution a cost model of `runner` is stored and looked up under."""
    from lenbatch.runners.base import PackedEmbeddingRunner
    from lenbatch.runners.hardware import processor_key

    precision = getattr(runner, "precision", None)
    key = CostKey(
        model=runner.info.name,
        work=WorkKind.ENCODER_BATCH,
        processor=processor_key(device),
        dtype=precision.name if precision is not None else "",
        quantization=getattr(runner, "quantization", "none"),
    )
    return key, "packed" if isinstance(runner, PackedEmbeddingRunner) else "padded"


def auto_cost(
    runner: Any,
    device: str = "cpu",
    *,
    calibrate: bool = True,
    budget_s: float = CALIBRATION_BUDGET_S,
    max_tokens: int = 8192,
    environ: Mapping[str, str] | None = None,
) -> tuple[CostModel, str] | None:
    """`serve --cost auto`: the cost model of `runner` on this processor and where it came
    from: this key's cached file; else a matching file of the cost folders
    (`plan.costsource.choose_auto`); else, when `calibrate`, one measured now (bounded by
    `budget_s`) and cached. None when nothing matches and `calibrate` is off."""
    key, execution = runner_key(runner, device)
    hit = cached_cost(key, execution, environ)
    if hit is not None:
        return hit[1], f"cached self-calibration {hit[0]}"
    try:
        path, why = choose_auto(
            key.processor,
            dtype=key.dtype or None,
            execution=execution,
            quantization=key.quantization,
            environ=environ,
            cache=False,
        )
        return CostModel.load(path), f"{path} ({why})"
    except ValueError:
        pass
    if not calibrate:
        return None
    log.info(
        "no cost model measured on this processor (%s, %s %s): measuring one now, at most "
        "%g s, before /health turns 200; it is cached for the next start",
        key.processor,
        key.dtype or "?",
        execution,
        budget_s,
    )
    cost = calibrate_runner(runner, budget_s=budget_s, device=device, max_tokens=max_tokens)
    try:
        path = store_cost(cost, cost.cost_key(key.model), environ)
    except OSError as exc:  # a read-only home must not stop the server
        log.warning("could not cache the self-calibrated cost model: %s", exc)
        return cost, "self-calibrated now (not cached)"
    return cost, f"self-calibrated now, cached in {path}"


def serve_cost_spec(spec: str | None, *, reads_cost: bool) -> tuple[str | None, str]:
    """What `serve` does with `--cost` `spec` for a strategy that reads a cost model
    (`reads_cost`, strategy adaptive) or not, and the sentence to log.

    - absent, strategy adaptive: `auto` (this processor's cached or committed model, else
      one measured now), because a generic prior misjudges a processor by a factor of
      several and its shedding then refuses what could be served;
    - `generic`: None, the online model's generic prior (instant start, learned online);
    - anything else: unchanged."""
    if spec is None:
        if not reads_cost:
            return None, ""
        return AUTO, (
            "no --cost: strategy adaptive uses this processor's cost model as --cost auto "
            "does (cached or committed, else measured now); --cost generic starts at once "
            "on the generic CPU prior instead"
        )
    if spec.strip().lower() == GENERIC:
        return None, (
            "--cost generic: the online cost model starts on its generic CPU prior and "
            "learns this server from its own batches"
        )
    return spec, ""
