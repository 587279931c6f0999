"""Batched, left-padded generation equals `model.generate()` on each prompt alone, token for
token: lockstep and continuous decode modes, requests joining mid-decode, chunked prefill, for a
tiny random Llama (rotary positions) and a tiny random GPT-2 (absolute positions)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from lenbatch.config import BatchingConfig, DecodeMode, GenerationConfig
from lenbatch.generate import Generation, GenerationEngine, SamplingParams
from lenbatch.generate.policy import FEW_ROWS
from tests.llm_reference import MAX_NEW, PROMPTS, reference_greedy

pytestmark = pytest.mark.slow


def _engine(runner: Any, mode: DecodeMode, **gen: Any) -> GenerationEngine:
    batching = BatchingConfig(boundaries=(8, 16, 32), max_batch=4, max_wait_ms=5)
    return GenerationEngine(runner, batching, generation=GenerationConfig(mode=mode, **gen))


async def _collect(engine: GenerationEngine, seq: Generation) -> list[int]:
    tokens: list[int] = []
    async for delta in engine.stream(seq):
        tokens.extend(delta.token_ids)
    return tokens


async def _decoding(seqs: list[Generation]) -> None:
    """Return once one of `seqs` has generated 3 tokens (at once if there are none)."""
    while seqs and not any(len(s.generated) >= 3 for s in seqs):
        await asyncio.sleep(0.001)


async def _run_with_late_joiners(
    engine: GenerationEngine, prompts: list[list[int]], params: SamplingParams
) -> tuple[list[list[int]], list[Generation]]:
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
@pytest.mark.parametrize("mode", [DecodeMode.LOCKSTEP, DecodeMode.CONTINUOUS])
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
    """With a step budget far below the prompt lengths, late joiners are prefilled in chunks
    beside the running rows' decode steps (mixed in or between them), prompts that find nothing
    decoding run whole, and the tokens are still those of generate() alone."""
    runner, prompts, expected = greedy_refs[arch]
    engine = _engine(runner, DecodeMode.CONTINUOUS, step_tokens=6)
    decoder = engine.decoder
    chunks: list[tuple[int, int, int]] = []  # (running rows, chunk columns, columns left)
    real_prefill, real_mixed = decoder.prefill, decoder.mixed

    def record(job: Any, cols: int, more: Any) -> None:
        for j, c in [(job, cols), *more]:
            chunks.append((decoder.running_rows, min(c, j.remaining), j.remaining))

    def spy_prefill(job: Any, cols: int, more: Any = ()) -> Any:
        record(job, cols, more)
        return real_prefill(job, cols, more)

    def spy_mixed(job: Any, cols: int, more: Any = ()) -> Any:
        record(job, cols, more)
        return real_mixed(job, cols, more)

    decoder.prefill = spy_prefill  # type: ignore[method-assign]
    decoder.mixed = spy_mixed  # type: ignore[method-assign]
    got, _ = await _run_with_late_joiners(
        engine, prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0)
    )
    assert got == expected
    beside = [(rows, c) for rows, c, _ in chunks if rows]
    # twice the budget while at most FEW_ROWS streams wait on the unit
    limit = {rows: 2 * 6 if rows <= FEW_ROWS else 6 for rows, _ in beside}
    assert beside and all(c <= limit[rows] for rows, c in beside), "prefill was not chunked"
    alone = [(c, left) for rows, c, left in chunks if not rows]
    assert alone and all(c == left for c, left in alone), "an idle engine chunked a prompt"


@pytest.mark.parametrize("step_tokens", [6, 256])
async def test_prefill_mixed_into_decode_steps_equals_generate_alone(
    step_tokens: int, greedy_refs: dict[str, Any]
) -> None:
    """On the lean path, late joiners' prefill chunks run in one forward with the running
    rows' decode step (mixed units), and prompts of several buckets share a forward (with a
    budget that holds them); every request still gets generate()'s tokens alone. GPT-2
    (transformers' forward) never mixes. The prompts go twice, so that more than FEW_ROWS rows
    decode beside the late joiners' last chunks (with fewer, those run alone)."""
    runner, prompts, expected = greedy_refs["llama"]
    prompts, expected = prompts * 2, expected * 2
    engine = _engine(runner, DecodeMode.CONTINUOUS, step_tokens=step_tokens)
    assert engine.decoder.mixer is not None
    got, _ = await _run_with_late_joiners(
        engine, prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0)
    )
    assert got == expected
    steps = engine.lm.stats()["steps"]
    assert steps["mixed"]["count"] > 0, "no prefill chunk rode with a decode step"
    if step_tokens == 256:
        # prompts of several buckets, admitted together, share forwards
        packed = [steps[k]["mean_jobs"] for k in ("prefill", "mixed")]
        assert max(packed) > 1, "no unit carried several jobs' chunks"
    # a turn (a unit, its hand-offs and delivery, up to the next unit) holds its forward and
    # a thread hand-off each way
    decode = steps["decode"]
    assert 0 < decode["turns"] <= decode["count"]
    assert 0 < decode["mean_between_forwards_ms"] < decode["mean_turn_ms"]
    gpt2 = _engine(greedy_refs["gpt2"][0], DecodeMode.CONTINUOUS)
    assert gpt2.decoder.mixer is None


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


async def _all_tokens(engine: GenerationEngine, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0)
    await engine.start()
    try:
        seqs = [engine.submit(p, params) for p in prompts]
        return list(await asyncio.gather(*(_collect(engine, s) for s in seqs)))
    finally:
        await engine.stop()


@pytest.mark.parametrize("mode", [DecodeMode.LOCKSTEP, DecodeMode.CONTINUOUS])
async def test_prefill_out_of_memory_splits_and_retries_losing_nothing(
    mode: DecodeMode, greedy_refs: dict[str, Any]
) -> None:
    """A prefill over the memory limit is split into smaller batches and, for a single long
    prompt, finer chunks; every request still gets exactly generate()'s tokens."""
    from lenbatch.runners.faulty import FaultyCausalRunner

    runner, prompts, expected = greedy_refs["llama"]
    limit = 24  # tokens per prefill call; the longest prompt alone is longer
    assert max(len(p) for p in prompts) > limit
    faulty = FaultyCausalRunner(runner, oom_prefill_tokens=limit)
    engine = _engine(faulty, mode, step_tokens=512)
    got = await _all_tokens(engine, prompts)
    assert got == expected
    assert faulty.faults["prefill_oom"] >= 2
    assert max(r * c for r, c in faulty.calls if c > 1) <= limit
    # a chunk mixed with a decode step (the lean path) that runs out of memory counts as mixed
    ooms = engine.lm.stats()["out_of_memory"]
    assert ooms.get("prefill", 0) + ooms.get("mixed", 0) == faulty.faults["prefill_oom"]
    assert not engine.unanswered


async def test_decode_out_of_memory_hands_rows_back_to_prefill_losing_nothing(
    greedy_refs: dict[str, Any],
) -> None:
    """A decode step over the memory limit is undone and the newest rows go back to prefill
    (over prompt and generated tokens); they resume and match generate() token for token."""
    from lenbatch.runners.faulty import FaultyCausalRunner

    runner, prompts, expected = greedy_refs["llama"]
    faulty = FaultyCausalRunner(runner, oom_decode_rows=2)
    engine = _engine(faulty, DecodeMode.CONTINUOUS)
    got = await _all_tokens(engine, prompts)
    assert got == expected
    assert faulty.faults["decode_oom"] >= 1
    assert engine.decoder.preempted >= 1
    assert max(r for r, c in faulty.calls if c == 1) <= 2  # steps that ran fit the limit
    assert not engine.unanswered


async def test_a_prompt_that_runs_out_of_memory_alone_gets_503(llama_runner: Any) -> None:
    """When even one prompt in the smallest chunks runs out of memory, its request ends with
    a 503 out_of_memory error (Retry-After); the others of its batch are still answered."""
    from lenbatch.core.errors import OutOfMemory
    from lenbatch.generate.failures import MIN_OOM_CHUNK
    from lenbatch.runners.faulty import FaultyCausalRunner

    faulty = FaultyCausalRunner(llama_runner, oom_prefill_tokens=MIN_OOM_CHUNK - 1)
    engine = _engine(faulty, DecodeMode.CONTINUOUS)
    short = llama_runner.tokenize(["Hi"])[0]
    assert len(short) < MIN_OOM_CHUNK
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    await engine.start()
    try:
        long_seq = engine.submit(llama_runner.tokenize([PROMPTS[2]])[0], params)
        short_seq = engine.submit(short, params)
        with pytest.raises(OutOfMemory) as err:
            await _collect(engine, long_seq)
        assert len(await _collect(engine, short_seq)) == 3
    finally:
        await engine.stop()
    assert err.value.status == 503
    assert not engine.unanswered


async def test_masked_cache_columns_are_never_read_on_the_lean_path(
    greedy_refs: dict[str, Any],
) -> None:
    """Where the decode step reads only each row's real columns (`reads_real_columns`), the
    running batch's masked columns are not zeroed when rows join: NaN written into every
    masked column before each step changes no token. Where it does not, they hold zeros."""
    runner, prompts, expected = greedy_refs["llama"]
    engine = _engine(runner, DecodeMode.CONTINUOUS, step_tokens=256)
    decoder = engine.decoder
    poisoned: list[int] = []
    real_decode, real_mixed = decoder.decode, decoder.mixed

    def poison() -> None:
        kv = decoder.running
        if kv is None or kv.rows == 0:
            return
        padding = kv.mask == 0
        if not runner.reads_real_columns:
            for layer in kv.cache.window_layers():
                held = layer.keys.transpose(1, 2)[padding]  # [masked columns, kv, dim]
                assert not held.abs().sum(), "a masked column holds garbage"
            return
        for layer in kv.cache.window_layers():
            for t in (layer.keys, layer.values):
                t.masked_fill_(padding[:, None, :, None], float("nan"))
        poisoned.append(int(padding.sum()))

    def spy_decode() -> Any:
        poison()
        return real_decode()

    def spy_mixed(job: Any, cols: int, more: Any = ()) -> Any:
        poison()
        return real_mixed(job, cols, more)

    decoder.decode = spy_decode  # type: ignore[method-assign]
    decoder.mixed = spy_mixed  # type: ignore[method-assign]
    got, _ = await _run_with_late_joiners(
        engine, prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0)
    )
    assert got == expected
    if runner.reads_real_columns:
        assert decoder.running is None or not decoder.running.masked_reads
        assert sum(poisoned) > 0, "no masked column to poison: the test saw no padding"
