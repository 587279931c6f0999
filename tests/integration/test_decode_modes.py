"""Decode-mode behaviour: finished rows stop costing compute, lockstep batches admit nobody
until empty, continuous batching admits under its running cap, a poison prompt fails alone."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from lenbatch.config import BatchingConfig, DecodeMode, GenerationConfig
from lenbatch.core.errors import ModelFailed, Unavailable
from lenbatch.generate import Generation, GenerationEngine, SamplingParams
from lenbatch.generate.kvcache import KVBatch
from lenbatch.runners.base import Segment
from tests.llm_reference import PROMPTS

pytestmark = pytest.mark.slow


def _engine(runner: Any, mode: DecodeMode, **gen: Any) -> GenerationEngine:
    batching = BatchingConfig(strategy="fifo", max_batch=8, max_wait_ms=20)
    return GenerationEngine(runner, batching, generation=GenerationConfig(mode=mode, **gen))


async def _drain(engine: GenerationEngine, seqs: list[Generation]) -> list[Any]:
    async def one(s: Generation) -> Any:
        try:
            return [d async for d in engine.stream(s)]
        except ModelFailed as exc:
            return exc

    return list(await asyncio.gather(*(one(s) for s in seqs)))


class _Poisoned:
    """`runner`, except that a forward with a prompt chunk (several new columns) holding token
    `poison` raises; with `late`, only after it wrote every segment's keys and values, as a
    model failing part-way would."""

    def __init__(self, runner: Any, poison: int, *, late: bool = False) -> None:
        self.runner, self.poison, self.late = runner, poison, late

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)

    def _hit(self, segments: Any) -> bool:
        return any(
            s.input_ids.shape[1] > 1 and (s.input_ids == self.poison).any() for s in segments
        )

    def forward_segments(self, segments: Any) -> Any:
        if not self.late and self._hit(segments):
            raise RuntimeError("boom")
        out = self.runner.forward_segments(segments)
        if self.late and self._hit(segments):
            raise RuntimeError("boom")
        return out

    def forward(self, ids: Any, mask: Any, pos: Any, cache: Any) -> Any:
        return self.forward_segments([Segment(ids, mask, pos, cache)])[0]


async def _run(engine: GenerationEngine, prompts: list[list[int]], p: SamplingParams) -> list[Any]:
    """Start `engine`, submit every prompt at once, and return each one's deltas or error."""
    await engine.start()
    try:
        return await _drain(engine, [engine.submit(x, p) for x in prompts])
    finally:
        await engine.stop()


async def test_finished_rows_leave_the_batch_and_its_cache(llama_runner: Any) -> None:
    """Once a short request finishes, later decode steps run without its row, and the cache
    narrows to the rows still running."""
    engine = _engine(llama_runner, DecodeMode.LOCKSTEP)
    rows: list[tuple[int, int]] = []
    real_decode = engine.decoder.decode

    def spy() -> Any:
        kv = engine.decoder.running
        if kv is not None:
            rows.append((kv.rows, kv.width))
        return real_decode()

    engine.decoder.decode = spy  # type: ignore[method-assign]
    long_prompt, short_prompt = llama_runner.tokenize([PROMPTS[4], PROMPTS[3]])
    await engine.start()
    try:
        a = engine.submit(long_prompt, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
        b = engine.submit(
            short_prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        )
        await _drain(engine, [a, b])
    finally:
        await engine.stop()
    assert rows[0][0] == 2
    assert rows[-1][0] == 1, "the finished row kept costing compute"
    # Without the long prompt the cache is as wide as the short row's tokens so far.
    assert rows[-1][1] == len(short_prompt) + 10


async def test_lockstep_batches_admit_nobody_until_empty(llama_runner: Any) -> None:
    """In lockstep mode a request arriving mid-decode waits for the whole batch to finish."""
    engine = _engine(llama_runner, DecodeMode.LOCKSTEP)
    p = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    prompts = llama_runner.tokenize(PROMPTS[:2])
    await engine.start()
    try:
        first = engine.submit(prompts[0], p)
        task = asyncio.create_task(_drain(engine, [first]))
        while len(first.generated) < 2:
            await asyncio.sleep(0.001)
        late = engine.submit(prompts[1], p)
        await _drain(engine, [late])
        await task
    finally:
        await engine.stop()
    assert late.timings.prefill_start >= first.timings.finished


@pytest.mark.parametrize("strategy", ["fifo", "bucketed"])
async def test_continuous_admits_at_most_max_running(llama_runner: Any, strategy: str) -> None:
    """Continuous batching never runs more sequences than `max_running`, also when batches of
    several buckets are admitted in one turn (to share a forward)."""
    batching = BatchingConfig(strategy=strategy, boundaries=(8, 16), max_batch=8, max_wait_ms=20)
    generation = GenerationConfig(mode=DecodeMode.CONTINUOUS, max_running=3)
    engine = GenerationEngine(llama_runner, batching, generation=generation)
    seen: list[int] = []
    real_decode = engine.decoder.decode

    def spy() -> Any:
        seen.append(engine.decoder.running_rows)
        return real_decode()

    engine.decoder.decode = spy  # type: ignore[method-assign]
    p = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    out = await _run(engine, llama_runner.tokenize(PROMPTS), p)
    assert all(len(o) for o in out)
    assert max(seen) == 3


async def test_a_new_running_batch_takes_its_rows_and_steps_at_once(llama_runner: Any) -> None:
    """The running batch's buffers hold the running cap's rows and the answers' columns from
    its first step, so neither joining rows nor decode steps reallocate them (each
    reallocation copies the whole cache between two steps of every stream)."""
    batching = BatchingConfig(strategy="fifo", max_batch=2, max_wait_ms=0)
    generation = GenerationConfig(mode=DecodeMode.CONTINUOUS, max_running=20)
    engine = GenerationEngine(llama_runner, batching, generation=generation)
    seen: list[tuple[int, int, int]] = []  # (buffer, row capacity, rows) after each join
    decoder = engine.decoder
    real_join = decoder._join

    def join(*args: Any) -> Any:
        out = real_join(*args)
        kv = decoder.running
        assert kv is not None
        buf = kv.buffers()[0][0]
        seen.append((buf.data_ptr(), int(buf.shape[0]), kv.rows))
        return out

    decoder._join = join  # type: ignore[method-assign]
    p = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    out = await _run(engine, llama_runner.tokenize(PROMPTS * 2), p)
    assert all(len(o) for o in out)
    assert seen and seen[0][1] >= 20
    assert seen[0][2] <= 2 and max(rows for _, _, rows in seen) > 2  # rows joined it
    assert len({buf for buf, _, _ in seen}) == 1, "the running batch's buffers were reallocated"


@pytest.mark.parametrize("mode", [DecodeMode.LOCKSTEP, DecodeMode.CONTINUOUS])
async def test_poison_prompt_fails_alone(
    llama_runner: Any, mode: DecodeMode, caplog: pytest.LogCaptureFixture
) -> None:
    """A prompt the model raises on is isolated by bisecting its prefill batch; the other
    requests of the batch are answered, and every request gets exactly one ending. Decoding
    continuously with a small step budget, the poisoned half is prefilled in chunks mixed
    into the decode steps of the half already running, so a mixed unit fails first and is
    unmixed."""
    prompts = llama_runner.tokenize(PROMPTS[:4])
    poison = min(set(range(5, 512)) - {t for p in prompts for t in p})
    gen = {"step_tokens": 8} if mode is DecodeMode.CONTINUOUS else {}
    engine = _engine(llama_runner, mode, **gen)
    engine.decoder.runner = _Poisoned(llama_runner, poison)  # type: ignore[assignment]
    prompts[2] = [*prompts[2][:3], poison, *prompts[2][3:]]
    p = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    out = await _run(engine, prompts, p)
    assert isinstance(out[2], ModelFailed)
    assert [len(o) for i, o in enumerate(out) if i != 2] == [4, 4, 4]
    assert not engine.unanswered
    assert engine.queues.inflight_total == 0
    if mode is DecodeMode.CONTINUOUS:
        assert "unmixing" in caplog.text


async def test_drain_finishes_admitted_requests_and_refuses_new_ones(llama_runner: Any) -> None:
    """Draining answers everything already admitted, then new requests get 503."""
    engine = _engine(llama_runner, DecodeMode.CONTINUOUS)
    prompts = llama_runner.tokenize(PROMPTS[:3])
    p = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    await engine.start()
    try:
        seqs = [engine.submit(x, p) for x in prompts]
        results = asyncio.ensure_future(_drain(engine, seqs))
        await engine.drain(timeout=60)
        assert engine.unanswered == 0
        assert [s.finish_reason for s in seqs] == ["length"] * 3
        assert [len(r) for r in await results] == [8, 8, 8]
        with pytest.raises(Unavailable, match="shutting down"):
            engine.submit(prompts[0], p)
    finally:
        await engine.stop()


async def test_drain_timeout_ends_the_rest_with_503(llama_runner: Any) -> None:
    """Requests still running when the drain timeout passes end with an explicit 503."""
    engine = _engine(llama_runner, DecodeMode.CONTINUOUS)
    prompt = llama_runner.tokenize(PROMPTS[:1])[0]
    await engine.start()
    try:
        seq = engine.submit(prompt, SamplingParams(max_tokens=400, ignore_eos=True))
        while not seq.generated:
            await asyncio.sleep(0.001)
        await engine.drain(timeout=0.05)
        with pytest.raises(Unavailable, match="drain timeout"):
            async for _ in engine.stream(seq):
                pass
        assert engine.unanswered == 0
    finally:
        await engine.stop()


async def test_a_failure_while_sampling_first_tokens_fails_that_prompt_alone(
    llama_runner: Any,
) -> None:
    """Sampling the first token can fail too (NaN logits here): the job is still bisected, the
    poisoned prompt fails alone, and the engine keeps serving (it used to crash its loop)."""
    prompts = llama_runner.tokenize(PROMPTS[:4])
    poison = min(set(range(5, 512)) - {t for p in prompts for t in p})
    engine = _engine(llama_runner, DecodeMode.CONTINUOUS)
    real_forward = llama_runner.forward

    class NaNOnPoison:
        def __getattr__(self, name: str) -> Any:
            return getattr(llama_runner, name)

        def forward(self, ids: Any, *args: Any) -> Any:
            logits = real_forward(ids, *args)
            if ids.shape[1] > 1 and (ids == poison).any():
                logits[(ids == poison).any(dim=1)] = float("nan")
            return logits

        def forward_segments(self, segments: Any) -> Any:  # a prefill chunk mixed with decode
            out = llama_runner.forward_segments(segments)
            for s, logits in zip(segments, out, strict=True):
                if s.input_ids.shape[1] > 1 and (s.input_ids == poison).any():
                    logits[(s.input_ids == poison).any(dim=1)] = float("nan")
            return out

    engine.decoder.runner = NaNOnPoison()  # type: ignore[assignment]
    prompts[1] = [*prompts[1][:2], poison, *prompts[1][2:]]
    p = SamplingParams(max_tokens=3, temperature=0.8, seed=1, ignore_eos=True)
    await engine.start()
    try:
        out = await _drain(engine, [engine.submit(x, p) for x in prompts])
        after = await _drain(engine, [engine.submit(prompts[0], p)])
    finally:
        await engine.stop()
    assert isinstance(out[1], ModelFailed)
    assert [len(o) for i, o in enumerate(out) if i != 1] == [3, 3, 3]
    assert [len(o) for o in after] == [3]
    assert not engine.unanswered


async def test_an_idle_continuous_engine_admits_at_once(llama_runner: Any) -> None:
    """Decoding continuously, a prompt that finds the engine idle is admitted without waiting
    out the max wait (later arrivals join the running batch anyway); a lockstep engine waits
    for batch-mates as configured."""
    p = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    prompt = llama_runner.tokenize(PROMPTS[:1])[0]
    waits = {}
    for mode in (DecodeMode.CONTINUOUS, DecodeMode.LOCKSTEP):
        batching = BatchingConfig(strategy="fifo", max_batch=8, max_wait_ms=400)
        engine = GenerationEngine(llama_runner, batching, generation=GenerationConfig(mode=mode))
        await engine.start()
        try:
            gen = engine.submit(prompt, p)
            await _drain(engine, [gen])
        finally:
            await engine.stop()
        waits[mode] = gen.timings.stages()["queue"]
    assert waits[DecodeMode.CONTINUOUS] < 0.1
    assert waits[DecodeMode.LOCKSTEP] >= 0.4


async def test_first_tokens_reach_their_streams_before_the_rows_join(
    llama_runner: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prefilled prompt's first token is handed to its stream before its keys and values are
    copied into the running batch (`Decoder.publish`): that copy is not part of its TTFT."""
    engine = _engine(llama_runner, DecodeMode.CONTINUOUS)
    streamed = threading.Event()  # the late prompt's stream has its first token
    at_join: list[bool] = []
    real_join = KVBatch.join

    def join(self: KVBatch, *args: Any) -> None:
        # worker thread: wait (bounded) for the event loop to stream the first token
        at_join.append(streamed.wait(timeout=5))
        real_join(self, *args)

    monkeypatch.setattr(KVBatch, "join", join)
    running_prompt, late_prompt = llama_runner.tokenize(PROMPTS[:2])
    await engine.start()
    try:
        # Long enough to still be running when the late prompt is prefilled: with 40 tokens it
        # finished first once in a full suite on a fast CPU (AMD EPYC family 25 model 17), and
        # the late prompt then started a batch of its own, with no join to test.
        running = engine.submit(
            running_prompt, SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
        )
        task = asyncio.create_task(_drain(engine, [running]))
        while len(running.generated) < 2:
            await asyncio.sleep(0.001)
        late = engine.submit(late_prompt, SamplingParams(max_tokens=3, temperature=0))
        deltas = []
        async for d in engine.stream(late):
            streamed.set()
            deltas.append(d)
        await task
    finally:
        await engine.stop()
    assert at_join == [True], "the first token waited for the join"
    assert sum(len(d.token_ids) for d in deltas) == len(late.generated) >= 1


async def test_a_poison_prompt_packed_with_other_jobs_fails_alone(
    llama_runner: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Prompts of several buckets arriving together are prefilled in one forward; when the
    model raises on one of them (after writing every segment's keys and values), every job of
    that unit starts over alone with a fresh cache, the poisoned prompt fails by itself, and
    the others get their greedy tokens."""
    from tests.llm_reference import reference_greedy

    prompts = llama_runner.tokenize(PROMPTS[:4])
    assert len({len(x) for x in prompts}) == 4
    poison = min(set(range(5, 512)) - {t for x in prompts for t in x})
    batching = BatchingConfig(strategy="bucketed", boundaries=(8, 16, 32), max_wait_ms=20)
    engine = GenerationEngine(
        llama_runner, batching, generation=GenerationConfig(mode=DecodeMode.CONTINUOUS)
    )
    assert engine.decoder.mixer is not None

    engine.decoder.runner = _Poisoned(llama_runner, poison, late=True)  # type: ignore[assignment]
    clean = [list(x) for x in prompts]
    prompts[1] = [*prompts[1][:2], poison, *prompts[1][2:]]
    p = SamplingParams(max_tokens=4, temperature=0)
    out = await _run(engine, prompts, p)
    assert "a unit of 4 prefill jobs failed" in caplog.text
    assert isinstance(out[1], ModelFailed)
    for i in (0, 2, 3):
        tokens = [t for d in out[i] for t in d.token_ids]
        assert tokens == reference_greedy(llama_runner, clean[i], 4), i
    assert not engine.unanswered
    assert engine.queues.inflight_total == 0
