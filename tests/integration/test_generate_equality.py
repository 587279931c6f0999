"""Batched, left-padded generation equals `model.generate()` on each prompt alone, token for
token: static and continuous decode modes, requests joining mid-decode, chunked prefill, for a
tiny random Llama (rotary positions) and a tiny random GPT-2 (absolute positions)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from lenbatch.config import BatchingConfig, DecodeMode, GenerationConfig
from lenbatch.generate import GenerationEngine, SamplingParams, Sequence
from tests.llm_reference import MAX_NEW, PROMPTS, reference_greedy


def _engine(runner: Any, mode: DecodeMode, **gen: Any) -> GenerationEngine:
    batching = BatchingConfig(boundaries=(8, 16, 32), max_batch=4, max_wait_ms=5)
    return GenerationEngine(runner, batching, generation=GenerationConfig(mode=mode, **gen))


async def _collect(engine: GenerationEngine, seq: Sequence) -> list[int]:
    tokens: list[int] = []
    async for delta in engine.stream(seq):
        tokens.extend(delta.token_ids)
    return tokens


async def _decoding(seqs: list[Sequence]) -> None:
    """Return once one of `seqs` has generated 3 tokens (at once if there are none)."""
    while seqs and not any(len(s.generated) >= 3 for s in seqs):
        await asyncio.sleep(0.001)


async def _run_with_late_joiners(
    engine: GenerationEngine, prompts: list[list[int]], params: SamplingParams
) -> tuple[list[list[int]], list[Sequence]]:
    """Submit half the prompts, wait until decoding is under way, then submit the rest."""
    await engine.start()
    try:
        half = len(prompts) // 2
        early = [engine.submit(p, params) for p in prompts[:half]]
        tasks = [asyncio.create_task(_collect(engine, s)) for s in early]
        await asyncio.wait_for(_decoding(early), timeout=60)
        late = [engine.submit(p, params) for p in prompts[half:]]
        tasks += [asyncio.create_task(_collect(engine, s)) for s in late]
        return list(await asyncio.gather(*tasks)), early + late
    finally:
        await engine.stop()


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("mode", [DecodeMode.STATIC, DecodeMode.CONTINUOUS])
async def test_greedy_batched_equals_generate_alone(
    arch: str, mode: DecodeMode, greedy_refs: dict[str, Any]
) -> None:
    """Greedy tokens of batched requests (some joining mid-decode) equal generate() alone."""
    runner, prompts, expected = greedy_refs[arch]
    assert len({len(p) for p in prompts}) > 3, "prompts must differ in length to need padding"
    engine = _engine(runner, mode)
    got, seqs = await _run_with_late_joiners(
        engine, prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0)
    )
    assert got == expected
    for s, exp in zip(seqs, expected, strict=True):
        assert s.finish_reason == ("stop" if len(exp) < MAX_NEW else "length")
    if mode is DecodeMode.CONTINUOUS:
        # The late requests really joined a running batch: their first token came before the
        # early requests finished.
        early_end = max(s.timings.finished for s in seqs[: len(seqs) // 2])
        assert min(s.timings.first_token for s in seqs[len(seqs) // 2 :]) < early_end


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
async def test_chunked_prefill_equals_generate_alone(
    arch: str, greedy_refs: dict[str, Any]
) -> None:
    """With a step budget far below the prompt lengths, prefill runs in chunks between
    decode steps, and the tokens are still those of generate() alone."""
    runner, prompts, expected = greedy_refs[arch]
    engine = _engine(runner, DecodeMode.CONTINUOUS, step_tokens=6)
    chunks = []
    real_prefill = engine.core.prefill

    def spy(job: Any, cols: int) -> Any:
        chunks.append(min(cols, job.remaining))
        return real_prefill(job, cols)

    engine.core.prefill = spy  # type: ignore[method-assign]
    got, _ = await _run_with_late_joiners(
        engine, prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0)
    )
    assert got == expected
    assert max(chunks) < max(len(p) for p in prompts), "prefill was not chunked"


async def test_seeded_sampling_is_the_same_alone_and_batched(llama_runner: Any) -> None:
    """A seeded sampled request draws the same tokens alone and inside a batch."""
    prompts = llama_runner.tokenize(PROMPTS)
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=1234)
    alone_engine = _engine(llama_runner, DecodeMode.CONTINUOUS)
    alone, _ = await _run_with_late_joiners(alone_engine, prompts[:1], params)
    batched_engine = _engine(llama_runner, DecodeMode.CONTINUOUS)
    batched, _ = await _run_with_late_joiners(batched_engine, prompts, params)
    assert batched[0] == alone[0]
    greedy = reference_greedy(llama_runner, prompts[0], 12)
    assert alone[0] != greedy, "sampling at temperature 0.9 should leave the greedy path"


def test_gpt2_needs_explicit_positions_when_left_padded(gpt2_runner: Any) -> None:
    """Negative control: without explicit position ids a left-padded GPT-2 row computes
    different logits, so the equality tests above would catch wrong positions."""
    short, long = gpt2_runner.tokenize(["Hi there", "Weng earns $12 an hour for babysitting"])
    width = len(long)
    ids = torch.full((1, width), gpt2_runner.info.pad_token_id)
    ids[0, width - len(short) :] = torch.tensor(short)
    mask = torch.zeros((1, width), dtype=torch.long)
    mask[0, width - len(short) :] = 1
    alone = gpt2_runner.forward(
        torch.tensor([short]),
        torch.ones((1, len(short)), dtype=torch.long),
        torch.arange(len(short))[None],
        gpt2_runner.new_cache(),
    )
    right = (mask.cumsum(-1) - 1).clamp(min=0)
    padded_ok = gpt2_runner.forward(ids, mask, right, gpt2_runner.new_cache())
    naive = torch.arange(width)[None]
    padded_naive = gpt2_runner.forward(ids, mask, naive, gpt2_runner.new_cache())
    assert torch.allclose(padded_ok, alone, atol=1e-5)
    assert not torch.allclose(padded_naive, alone, atol=1e-3)
