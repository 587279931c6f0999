"""Warm-up: every bucket's batch shapes run once before the engine says it is ready.

The first batch of a shape pays for what later ones reuse: oneDNN builds and caches its kernels
per shape, the allocator grows its arenas, attention picks its kernel. Served cold, those costs
land on the first requests of each bucket. So before `/health` turns 200 the engine runs, per
lane, a one-row batch and a full batch (the lane's row cap, within the token budget) at the
lane's longest length, on the runner threads it will serve with, within a time budget: what the
budget leaves out is logged, never silently skipped. Only runners that ask for it
(`needs_warm_up`: the torch runners) are warmed; fakes in tests are not.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from lenbatch.core.lanes import SchedulerConfig

__all__ = ["WARM_UP_BUDGET_S", "WarmShape", "warm_shapes", "warm_up"]

log = logging.getLogger("lenbatch.embed.warmup")

# Seconds of warm-up at most: with loading (a few seconds for MiniLM), start-up stays well
# within a minute.
WARM_UP_BUDGET_S = 40.0

# Text to cut the warm-up inputs from (its tokens are ordinary words; the values do not matter
# to the cost, only the shapes do).
_TEXT = "the quick brown fox jumps over the lazy dog while the server warms up its kernels "


@dataclass(frozen=True, slots=True)
class WarmShape:
    """A batch to run once: `rows` inputs of `length` tokens each, for lane `lane`."""

    lane: int
    rows: int
    length: int
    pad_to: int | None

    @property
    def tokens(self) -> int:
        """Tokens the batch holds."""
        return self.rows * self.length


def warm_shapes(cfg: SchedulerConfig, longest: int) -> list[WarmShape]:
    """Per lane, a one-row batch and its largest batch (row cap and token budget) at the
    lane's longest length (at most `longest`, the model's limit); cheapest first, so a budget
    that runs out leaves out the largest."""
    shapes: set[WarmShape] = set()
    lower = 0
    for k, lane in enumerate(cfg.lanes):
        length = max(1, min(lane.upper, longest))
        if length <= lower:
            continue  # an empty lane (its upper is at or below the one before it)
        lower = length
        width = lane.pad_to or length
        rows = max(1, min(lane.max_batch, cfg.max_batch_tokens // max(width, 1)))
        for r in {1, rows}:
            shapes.add(WarmShape(k, r, length, lane.pad_to))
    return sorted(shapes, key=lambda s: (s.tokens, s.lane))


async def warm_up(
    run: Callable[[Sequence[Sequence[int]], int | None], Awaitable[object]],
    tokenize: Callable[[Sequence[str], bool], list[list[int]]],
    cfg: SchedulerConfig,
    longest: int,
    *,
    slots: int = 1,
    budget_s: float = WARM_UP_BUDGET_S,
) -> tuple[int, int]:
    """Run each of `warm_shapes` once through `run(token_ids, pad_to)` (the engine's batch
    runner), `slots` at a time, until `budget_s` has passed; returns (shapes run, shapes in
    all). A shape that fails is logged (its exception's type) and skipped: serving then finds
    out about the runner as it would have without warm-up."""
    shapes = warm_shapes(cfg, longest)
    if not shapes:
        return 0, 0
    need = max(s.length for s in shapes)
    sample = tokenize([_TEXT * (need // 8 + 2)], True)[0]
    ids = (sample * (need // max(len(sample), 1) + 1))[:need]
    start = time.monotonic()
    done = 0
    queue = list(shapes)

    async def worker() -> None:
        nonlocal done
        while queue and time.monotonic() - start < budget_s:
            s = queue.pop(0)
            try:
                await run([ids[: s.length]] * s.rows, s.pad_to)
            except Exception as exc:  # the runner's problem shows when serving, as before
                log.warning(
                    "warm-up batch of %d x %d tokens failed (%s)",
                    s.rows,
                    s.length,
                    type(exc).__name__,
                )
                continue
            done += 1

    await asyncio.gather(*(worker() for _ in range(max(1, slots))))
    took = time.monotonic() - start
    if done < len(shapes):
        log.warning(
            "warm-up: %d of %d batch shapes in %.1f s (budget %g s); the rest run cold",
            done,
            len(shapes),
            took,
            budget_s,
        )
    else:
        log.info("warm-up: %d batch shapes in %.1f s", done, took)
    return done, len(shapes)
