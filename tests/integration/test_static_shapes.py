"""Fixed shapes (`[generation] compile`): bucket-padded prefill and fixed-width decode give the
tokens of `model.generate()` on each prompt alone, and compiled graphs give the eager path's."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from lenbatch.config import BatchingConfig, DecodeMode, GenerationConfig
from lenbatch.core.request import Request
from lenbatch.generate import Generation, GenerationEngine, SamplingParams
from lenbatch.generate.decode import Decoder
from lenbatch.generate.generation import Timings
from lenbatch.generate.sampling import TextTracker
from lenbatch.generate.shapes import ShapeClasses, make_fixed_shapes
from lenbatch.runners.graphs import GraphInputs
from tests.llm_reference import MAX_NEW

pytestmark = pytest.mark.slow


async def _collect(engine: GenerationEngine, seq: Generation) -> list[int]:
    tokens: list[int] = []
    async for delta in engine.stream(seq):
        tokens.extend(delta.token_ids)
    return tokens


@pytest.mark.parametrize("mode", [DecodeMode.LOCKSTEP, DecodeMode.CONTINUOUS])
async def test_fixed_shapes_equal_generate_alone(
    mode: DecodeMode, greedy_refs: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prefill padded to the bucket bound and rows to a power of two, decode in a fixed-width
    buffer with dummy rows, requests joining mid-decode: the tokens of generate() alone. The
    eager forward is never called, so every unit really ran in a fixed shape."""
    runner, prompts, expected = greedy_refs["llama"]
    batching = BatchingConfig(boundaries=(8, 16, 32), max_batch=3, max_wait_ms=5)
    gen = GenerationConfig(mode=mode, step_tokens=4096, max_running=8, compile_max_width=128)
    engine = GenerationEngine(runner, batching, generation=gen, fixed_shapes=True)

    def no_eager(*a: Any, **k: Any) -> Any:
        raise AssertionError("a unit ran on the eager path")

    await engine.start()  # warms up on the eager path first
    monkeypatch.setattr(runner, "forward", no_eager)
    try:
        params = SamplingParams(max_tokens=MAX_NEW, temperature=0)
        half = len(prompts) // 2
        early = [engine.submit(p, params) for p in prompts[:half]]
        tasks = [asyncio.create_task(_collect(engine, s)) for s in early]
        while not any(len(s.generated) >= 3 for s in early):
            await asyncio.sleep(0.001)
        late = [engine.submit(p, params) for p in prompts[half:]]
        tasks += [asyncio.create_task(_collect(engine, s)) for s in late]
        got = await asyncio.wait_for(asyncio.gather(*tasks), timeout=120)
    finally:
        await engine.stop()
    assert list(got) == expected
    assert engine.stats()["compile"] == {
        "enabled": False, "graphs": 0, "compile_s": 0.0, "hits": 0, "misses": 0
    }  # fmt: skip
    text = engine.lm.prometheus().decode()
    assert "lenbatch_llm_compiled_graphs 0.0" in text
    assert 'lenbatch_llm_compiled_units{result="miss"} 0.0' in text


def test_shape_classes() -> None:
    """Prefill pads to the bucket bound (beyond the last, a power of two); row and width
    classes keep their size while it fits and is at most 4x too big."""
    c = ShapeClasses(bounds=(8, 16, 32, 511), max_rows=6, max_width=64)
    assert [c.prefill_cols(w) for w in (1, 8, 9, 32, 33, 65)] == [8, 8, 16, 32, 64, 128]
    assert c.row_class(3, None) == 4 and c.row_class(3, 16) == 16 and c.row_class(3, 32) == 4
    assert c.row_class(5, 4) == 8 and c.row_class(3, 11) == 4  # 11 rows: not a class
    assert c.decode_width(70, 141) == 128
    assert c.decode_width(10, None) == 64 and c.decode_width(65, 64) == 128
    prefill, decode = c.shapes()
    assert prefill == [(r, b) for b in (8, 16, 32, 64) for r in (1, 2, 4, 8)]
    assert decode == [(r, 64) for r in (1, 2, 4, 8)]


def _seqs(runner: Any, prompts: list[list[int]], n: int) -> list[Generation]:
    out = []
    for p in prompts:
        params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        req: Request[Generation] = Request(len(p), 0.0, list(p))
        seq = Generation(req, params, TextTracker(runner.decode), Timings(0.0), runner.device)
        req.handle = seq
        out.append(seq)
    return out


def _generate(runner: Any, prompts: list[list[int]], compile: bool) -> tuple[list[list[int]], Any]:
    shapes = make_fixed_shapes(runner, (16, 32), 4, 64, compile=compile)
    decoder = Decoder(runner, time.perf_counter, True, shapes)
    seqs = _seqs(runner, prompts, 12)
    job = decoder.add_job(0, seqs, None)
    decoder.prefill(job, job.remaining)
    while decoder.running_rows:
        decoder.decode()
    return [s.generated for s in seqs], shapes.graphs.stats


def test_compiled_graphs_give_the_eager_tokens(llama_runner: Any) -> None:
    """torch.compile'd fixed shapes (one prefill shape, one decode shape) produce the same
    greedy tokens as the same shapes run eager; the second call of a shape is a hit."""
    prompts = llama_runner.tokenize(["Weng earns $12 an hour", "Hi", "James writes a letter"])
    eager, _ = _generate(llama_runner, prompts, compile=False)
    compiled, stats = _generate(llama_runner, prompts, compile=True)
    assert compiled == eager
    assert stats.graphs == 2  # prefill 4x16, decode 4 rows x 64 columns
    assert stats.shapes.keys() == {"4x16->16", "4x1->64"}
    # 12 tokens: 1 from prefill, 11 decode steps of which the first compiles its shape.
    assert stats.hits == 10 and stats.misses == 0


def test_warm_up_runs_every_shape_class(llama_runner: Any) -> None:
    """Start-up runs each prefill class (bucket bounds, then powers of two up to the widest)
    and each decode class once (eager here; compiled with `compile`)."""
    shapes = make_fixed_shapes(llama_runner, (16, 511), 2, 64, compile=False)
    calls: list[str] = []
    run = shapes.graphs.run

    def spy(step: GraphInputs) -> Any:
        calls.append(step.shape_key)
        return run(step)

    shapes.graphs.run = spy  # type: ignore[method-assign]
    assert shapes.warm_up() == 8
    assert calls == [
        "1x16->16", "2x16->16", "1x32->32", "2x32->32", "1x64->64", "2x64->64",
        "1x1->64", "2x1->64",
    ]  # fmt: skip
