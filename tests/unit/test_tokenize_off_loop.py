"""Tokenization runs in a worker thread, not on the event loop: one huge input being
tokenized holds up no small request (a 1 MB input with `truncate`). Only a short call is
tokenized on the loop, where it costs less than the hop to a thread."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence

from lenbatch.config import BatchingConfig
from lenbatch.embed.engine import Engine
from lenbatch.runners.fake import FakeRunner

_BIG = 100_000  # characters: what counts as the huge input here


class GatedTokenizer(FakeRunner):
    """A fake runner whose tokenizer, given a huge text, blocks until the test opens the gate:
    a tokenization as slow as the test wants, without a timing in sight."""

    def __init__(self) -> None:
        super().__init__(max_length=64)
        self.entered = threading.Event()
        self.gate = threading.Event()

    def tokenize(self, texts: Sequence[str], truncate: bool) -> list[list[int]]:
        if any(len(t) > _BIG for t in texts):
            self.entered.set()
            assert self.gate.wait(30), "the test never opened the gate"
        return super().tokenize(texts, truncate)


async def test_small_requests_pass_a_huge_input_being_tokenized() -> None:
    """20 one-line requests sent while a 1 MB input is tokenizing are all answered before it;
    the huge input, truncated, is answered once its tokenization ends."""
    runner = GatedTokenizer()
    engine = Engine(runner, BatchingConfig(max_batch=8, max_wait_ms=1))
    await engine.start()
    try:
        huge = " ".join(["word"] * 200_000)  # 1 MB
        big = asyncio.create_task(engine.embed_with_usage([huge], truncate=True))
        assert await asyncio.to_thread(runner.entered.wait, 30)
        small = [engine.embed([f"one line number {i}"]) for i in range(20)]
        answered = await asyncio.wait_for(asyncio.gather(*small), 30)
        assert len(answered) == 20 and not big.done()  # none waited for the huge input
        runner.gate.set()
        done = await asyncio.wait_for(big, 30)
    finally:
        runner.gate.set()
        await engine.stop()
    assert done.prompt_tokens == 64  # truncated to the model limit
    sizes = [b.size for b in runner.batches]
    assert sum(sizes) == 21 and sizes[-1] == 1  # the huge input ran last, alone


class ThreadNoting(FakeRunner):
    """A fake runner that notes which thread tokenized each call."""

    def __init__(self) -> None:
        super().__init__(max_length=4096)
        self.threads: list[int] = []

    def tokenize(self, texts: Sequence[str], truncate: bool) -> list[list[int]]:
        self.threads.append(threading.get_ident())
        return super().tokenize(texts, truncate)


async def test_short_calls_tokenize_on_the_loop_long_ones_in_a_worker() -> None:
    runner = ThreadNoting()
    engine = Engine(runner, BatchingConfig(max_wait_ms=0, max_batch_tokens=100_000))
    await engine.start()
    try:
        loop_thread = threading.get_ident()
        await engine.embed(["a short line of text"])
        await engine.embed(["word " * 1000])  # 5,000 characters
        await engine.embed(["a", "b", "c", "d", "e"])  # more texts than a short call holds
    finally:
        await engine.stop()
    assert runner.threads[0] == loop_thread
    assert runner.threads[1] != loop_thread and runner.threads[2] != loop_thread
