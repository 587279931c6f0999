"""embed/warmup.py: every bucket's shapes run before the engine is ready, within a budget."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from lenbatch.config import BatchingConfig
from lenbatch.core.lanes import resolve_lanes
from lenbatch.embed.engine import Engine
from lenbatch.embed.warmup import warm_shapes, warm_up
from lenbatch.runners.fake import FakeRunner


def _cfg(**kw: object) -> object:
    batching = BatchingConfig(strategy="bucketed", boundaries=[16, 64], **kw)  # type: ignore[arg-type]
    return resolve_lanes(batching, 128).cfg


def test_shapes_are_one_row_and_the_full_batch_of_each_lane_at_its_longest() -> None:
    cfg = _cfg(max_batch=8, max_batch_tokens=256, overlong_max_batch=2)
    shapes = warm_shapes(cfg, 128)  # type: ignore[arg-type]
    got = {(s.lane, s.rows, s.length) for s in shapes}
    # 16: 8 rows; 64: 256 // 64 = 4 rows; overlong (to 128): its cap of 2
    assert got == {(0, 1, 16), (0, 8, 16), (1, 1, 64), (1, 4, 64), (2, 1, 128), (2, 2, 128)}
    assert [s.tokens for s in shapes] == sorted(s.tokens for s in shapes)  # cheapest first
    for s in shapes:
        assert s.rows * s.length <= 256 or s.rows == 1


async def test_warm_up_runs_every_shape_and_stops_at_its_budget() -> None:
    cfg = _cfg(max_batch=8, max_batch_tokens=256)
    seen: list[tuple[int, int]] = []

    async def run(seqs: Sequence[Sequence[int]], pad_to: int | None) -> None:
        assert len({len(s) for s in seqs}) == 1
        seen.append((len(seqs), len(seqs[0])))
        await asyncio.sleep(0.01)

    def tokenize(texts: Sequence[str], truncate: bool) -> list[list[int]]:
        return [list(range(3, 3 + min(len(t.split()), 128))) for t in texts]

    done, total = await warm_up(run, tokenize, cfg, 128, slots=2)  # type: ignore[arg-type]
    assert done == total == len(seen) == 6
    assert sorted(seen) == sorted((s.rows, s.length) for s in warm_shapes(cfg, 128))  # type: ignore[arg-type]
    seen.clear()
    done, total = await warm_up(run, tokenize, cfg, 128, budget_s=0.0)  # type: ignore[arg-type]
    assert done == 0 and total == 6 and not seen


@dataclass
class WarmedFake(FakeRunner):
    """A fake that asks for warm-up, as the torch runners do."""

    needs_warm_up: bool = True


async def test_engine_is_ready_only_after_warming_each_bucket() -> None:
    runner = WarmedFake()
    engine = Engine(runner, BatchingConfig(strategy="bucketed", boundaries=[8, 32], max_wait_ms=0))
    assert runner.batches == []
    await engine.start()
    try:
        lengths = sorted({b.lengths[0] for b in runner.batches})
        assert lengths[:2] == [8, 32]  # each bucket's longest, before any request
        warm = len(runner.batches)
        assert (await engine.embed(["a b c"]))[0] is not None
        assert len(runner.batches) == warm + 1
    finally:
        await engine.stop()


async def test_fakes_that_do_not_ask_are_not_warmed() -> None:
    runner = FakeRunner()
    engine = Engine(runner, BatchingConfig(max_wait_ms=0))
    await engine.start()
    await engine.stop()
    assert runner.batches == []
