"""Prefix caching: prompts that start like an earlier one take its keys and values from the
prefix cache and still get `model.generate()`'s tokens alone, token for token (a tiny random
Llama on the lean path, a tiny GPT-2 with absolute positions on transformers' forward), batched
with left padding, chunked beside running decode steps, and through HTTP, where the `openai`
client reads `usage.prompt_tokens_details.cached_tokens`."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import openai
import pytest

from lenbatch.config import BatchingConfig, DecodeMode, GenerationConfig, Settings
from lenbatch.generate import Generation, GenerationEngine, SamplingParams
from lenbatch.generate.api import create_llm_app
from lenbatch.generate.prefixcache import BLOCK_TOKENS
from tests.integration.conftest import LiveServer
from tests.integration.test_generate_equality import _collect
from tests.llm_reference import MAX_NEW, PROMPTS, reference_greedy

pytestmark = pytest.mark.slow

SYSTEM = (
    "You are a patient tutor. Read the word problem, name the quantities it gives, write "
    "each step of the arithmetic on its own line and end with the answer alone. Problem: "
)


def _engine(runner: Any, mode: DecodeMode = DecodeMode.CONTINUOUS, **gen: Any) -> Any:
    batching = BatchingConfig(boundaries=(256,), max_batch=8, max_wait_ms=20)
    return GenerationEngine(runner, batching, generation=GenerationConfig(mode=mode, **gen))


async def _waves(
    engine: GenerationEngine, first: list[list[int]], second: list[list[int]], overlap: bool
) -> tuple[list[list[int]], list[Generation]]:
    """Run `first`, then `second` (while `first` still decodes where `overlap`, else after it
    ended); returns every prompt's tokens and the second wave's generations."""
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0)
    await engine.start()
    try:
        early = [engine.submit(p, params) for p in first]
        tasks = [asyncio.create_task(_collect(engine, s)) for s in early]
        if overlap:
            while not any(len(s.generated) >= 2 for s in early):
                await asyncio.sleep(0.001)
        else:
            await asyncio.gather(*tasks)
        late = [engine.submit(p, params) for p in second]
        tasks += [asyncio.create_task(_collect(engine, s)) for s in late]
        return list(await asyncio.gather(*tasks)), late
    finally:
        await engine.stop()


def _prompts(runner: Any) -> tuple[list[list[int]], int]:
    """The questions behind the shared system text, and the tokens every one of them shares."""
    ids = runner.tokenize([SYSTEM + q for q in PROMPTS])
    shared = 0
    while all(len(p) > shared and p[shared] == ids[0][shared] for p in ids):
        shared += 1
    assert shared >= 3 * BLOCK_TOKENS, "the shared text must cover several blocks"
    return ids, shared


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("mode", [DecodeMode.LOCKSTEP, DecodeMode.CONTINUOUS])
async def test_prompts_behind_a_cached_prefix_equal_generate_alone(
    arch: str, mode: DecodeMode, llama_runner: Any, gpt2_runner: Any
) -> None:
    """One prompt runs; then all of them, in one left-padded batch, take the shared blocks
    from the cache (each row from its own first column) and get generate()'s tokens."""
    runner = llama_runner if arch == "llama" else gpt2_runner
    prompts, shared = _prompts(runner)
    expected = [reference_greedy(runner, p, MAX_NEW) for p in prompts]
    engine = _engine(runner, mode)
    got, late = await _waves(engine, prompts[:1], prompts, overlap=False)
    assert got == [expected[0], *expected]
    whole = shared // BLOCK_TOKENS * BLOCK_TOKENS
    starts = [max(len(p) for p in prompts) - len(p) for p in prompts]
    # the batch starts where the longest row's cached prefix ends; each row took what it has
    # of the prefix before that column
    assert [g.cached_tokens for g in late] == [max(0, whole - s) for s in starts]
    assert max(g.cached_tokens for g in late) == whole >= 3 * BLOCK_TOKENS
    stats = engine.decoder.prefixes.stats()
    assert stats["hit_tokens"] == sum(g.cached_tokens for g in late)
    assert stats["bytes"] > 0 and stats["blocks"] * BLOCK_TOKENS >= whole


async def test_a_seeded_prompt_is_chunked_beside_running_decode_steps(llama_runner: Any) -> None:
    """With a step budget far below the prompts, the second wave joins while the first
    decodes: its chunks start past the cached columns and ride with decode steps (mixed
    units), and every row still gets generate()'s tokens."""
    prompts, _ = _prompts(llama_runner)
    expected = [reference_greedy(llama_runner, p, MAX_NEW) for p in prompts]
    engine = _engine(llama_runner, step_tokens=6)
    got, late = await _waves(engine, prompts[:2], prompts[2:], overlap=True)
    assert got == expected
    assert max(g.cached_tokens for g in late) >= 3 * BLOCK_TOKENS
    assert engine.lm.stats()["steps"]["mixed"]["count"] > 0


async def test_prefix_cache_off(llama_runner: Any) -> None:
    """`prefix_cache_mb = 0`: nothing is kept or taken, and /stats says it is off."""
    prompts, _ = _prompts(llama_runner)
    engine = _engine(llama_runner, prefix_cache_mb=0)
    got, late = await _waves(engine, prompts[:1], prompts[:2], overlap=False)
    assert got[0] == got[1] == reference_greedy(llama_runner, prompts[0], MAX_NEW)
    assert [g.cached_tokens for g in late] == [0, 0]
    assert engine.decoder.prefixes is None
    assert engine.stats()["prefix_cache"] == {"enabled": False}


async def test_a_budget_of_a_few_blocks_keeps_the_most_recent(llama_runner: Any) -> None:
    """A budget that holds one prompt's blocks: the next prompt's blocks replace them, the
    budget holds, and answers stay generate()'s."""
    prompts, shared = _prompts(llama_runner)
    cfg = llama_runner.model.config
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4
    blocks = len(prompts[4]) // BLOCK_TOKENS
    engine = _engine(llama_runner)
    engine.decoder.prefixes.max_bytes = blocks * BLOCK_TOKENS * per_token
    other = llama_runner.tokenize(["Unrelated text about rivers and boats " * 6])[0]
    got, late = await _waves(engine, [prompts[4], other], [prompts[4]], overlap=False)
    ref = reference_greedy(llama_runner, prompts[4], MAX_NEW)
    assert got[0] == got[2] == ref
    stats = engine.decoder.prefixes.stats()
    assert stats["bytes"] <= stats["max_bytes"]
    assert stats["evicted_blocks"] > 0
    assert late[0].cached_tokens < shared  # some of its blocks made way for the other text


def test_openai_usage_reports_the_cached_prompt_tokens(llama_runner: Any) -> None:
    """A chat with a long system message, sent twice: the second answer is the same text
    (generate()'s), its usage says how many prompt tokens came from the cache (whole and
    streamed), and /stats and /metrics count them."""
    messages = [
        {"role": "system", "content": SYSTEM * 2},
        {"role": "user", "content": PROMPTS[2]},
    ]
    prompt = llama_runner.chat_prompt(messages)
    text = llama_runner.decode(reference_greedy(llama_runner, prompt, 10))
    engine = GenerationEngine(
        llama_runner,
        BatchingConfig(boundaries=(8, 16, 32), max_batch=4, max_wait_ms=2),
        generation=GenerationConfig(),
    )
    app = create_llm_app(engine, Settings.model_validate({"model": {"name": "tiny-llama"}}))
    with LiveServer(None, app=app) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="-", max_retries=0, timeout=60)
        kw: dict[str, Any] = {"model": "tiny-llama", "messages": messages, "max_tokens": 10}
        first = client.chat.completions.create(temperature=0, **kw)
        second = client.chat.completions.create(temperature=0, **kw)
        chunks = list(
            client.chat.completions.create(
                temperature=0, stream=True, stream_options={"include_usage": True}, **kw
            )
        )
        stats = httpx.get(s.url + "/stats", timeout=30).json()
        metrics = httpx.get(s.url + "/metrics", timeout=30).text
    assert first.choices[0].message.content == second.choices[0].message.content == text
    assert first.usage is not None and second.usage is not None
    assert first.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details
    assert cached is not None and cached.cached_tokens is not None
    whole = (len(prompt) - 1) // BLOCK_TOKENS * BLOCK_TOKENS
    assert cached.cached_tokens == whole >= 4 * BLOCK_TOKENS
    assert second.usage.prompt_tokens == len(prompt)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    last = chunks[-1].usage
    assert last is not None and last.prompt_tokens_details is not None
    assert last.prompt_tokens_details.cached_tokens == whole
    pc = stats["prefix_cache"]
    assert pc["enabled"] and pc["hit_tokens"] == 2 * whole and pc["lookups"] == 3
    assert f"lenbatch_llm_prefix_cache_hit_tokens {float(2 * whole)}" in metrics


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
async def test_choices_of_one_prompt_prefill_it_once(
    arch: str, llama_runner: Any, gpt2_runner: Any
) -> None:
    """Three rows of one prompt (a call's `n` choices) in one scheduler batch: the first
    prefills the prompt, the other two, queued right behind it, take its blocks (looked up
    when their job starts, after the first kept them) and run only the last partial block;
    every row gets generate()'s tokens, and a seeded sampled choice draws what it draws
    alone."""
    runner = llama_runner if arch == "llama" else gpt2_runner
    prompts, _ = _prompts(runner)
    prompt = prompts[4]
    expected = reference_greedy(runner, prompt, MAX_NEW)
    engine = _engine(runner)
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0)
    await engine.start()
    try:
        seqs = [engine.submit(prompt, greedy) for _ in range(3)]
        got = await asyncio.gather(*(_collect(engine, s) for s in seqs))
    finally:
        await engine.stop()
    assert got == [expected] * 3
    whole = (len(prompt) - 1) // BLOCK_TOKENS * BLOCK_TOKENS
    assert [s.cached_tokens for s in seqs] == [0, whole, whole]
    assert engine.lm.stats()["steps"]["prefill"]["count"] >= 2  # two jobs
    sampled = SamplingParams(max_tokens=MAX_NEW, temperature=0.9, seed=7)
    shared_engine = _engine(runner)
    await shared_engine.start()
    try:
        seqs = [shared_engine.submit(prompt, p) for p in (greedy, sampled)]
        both = await asyncio.gather(*(_collect(shared_engine, s) for s in seqs))
    finally:
        await shared_engine.stop()
    assert both[0] == expected and seqs[1].cached_tokens == whole
    alone_sampled = _engine(runner, prefix_cache_mb=0)
    await alone_sampled.start()
    try:
        ref = await _collect(alone_sampled, alone_sampled.submit(prompt, sampled))
    finally:
        await alone_sampled.stop()
    assert both[1] == ref


async def test_a_burst_on_a_new_system_prompt_prefills_it_once(llama_runner: Any) -> None:
    """Six prompts behind one system text nobody has sent before, in one batch: one row
    prefills the shared head, the other five wait for it in a job of their own and take its
    blocks; every row still gets generate()'s tokens."""
    prompts, _ = _prompts(llama_runner)
    expected = [reference_greedy(llama_runner, p, MAX_NEW) for p in prompts]
    engine = _engine(llama_runner)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0)
    await engine.start()
    try:
        seqs = [engine.submit(p, params) for p in prompts]
        got = await asyncio.gather(*(_collect(engine, s) for s in seqs))
    finally:
        await engine.stop()
    assert got == expected
    cached = [s.cached_tokens for s in seqs]
    assert cached[0] == 0 and max(cached) >= 3 * BLOCK_TOKENS
    assert engine.decoder.prefixes.stats()["hit_tokens"] == sum(cached)


def _gens(runner: Any, prompts: list[list[int]]) -> list[Any]:
    from lenbatch.core.request import Request
    from lenbatch.generate.generation import Timings
    from lenbatch.generate.streams import open_generation

    params = SamplingParams(max_tokens=4, temperature=0)
    return [
        open_generation(Request(len(p), 0.0, p), params, runner, Timings(arrival=0.0))
        for p in prompts
    ]


def test_which_rows_wait_for_a_shared_head(llama_runner: Any) -> None:
    """The decoder's split: a batch's rows behind one uncached head go after its first row;
    a later batch behind the same head waits for the queued job (never in its forward);
    rows that share only a block, or a head the cache already holds, run side by side."""
    from lenbatch.generate.decode import Decoder
    from lenbatch.generate.prefixcache import PrefixCache
    from lenbatch.generate.prefixjobs import SHARED_BLOCKS

    prompts, _ = _prompts(llama_runner)
    d = Decoder(llama_runner, lambda: 0.0, True, prefixes=PrefixCache(1 << 26))
    first = d.add_job(0, _gens(llama_runner, prompts[:3]), None)
    assert [j.rows for j in d.jobs] == [1, 2]
    assert not first.after_prefix and not first.releases
    assert d.jobs[1].after_prefix and d.jobs[1].releases
    later = d.add_job(1, _gens(llama_runner, prompts[3:4]), None)
    assert later.after_prefix and later.rows == 1
    # prompts that share less than SHARED_BLOCKS whole blocks are not split
    short = [[7] * (BLOCK_TOKENS * (SHARED_BLOCKS - 1)) + [i] * BLOCK_TOKENS for i in (1, 2)]
    apart = Decoder(llama_runner, lambda: 0.0, True, prefixes=PrefixCache(1 << 26))
    apart.add_job(0, _gens(llama_runner, short), None)
    assert [j.rows for j in apart.jobs] == [2]
    # without a prefix cache nothing is split
    plain = Decoder(llama_runner, lambda: 0.0, True)
    plain.add_job(0, _gens(llama_runner, prompts[:3]), None)
    assert [j.rows for j in plain.jobs] == [3] and not plain.jobs[0].after_prefix
