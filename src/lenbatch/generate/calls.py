"""What the generation routes share: their request headers, and reading a call's token
streams (every sequence's deltas merged as they come, a call's whole texts, the first delta
before a streamed answer's status line)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Annotated, Any

from fastapi import Header

from lenbatch.serving.messages import Delta, TokenLogprob
from lenbatch.serving.services import GenerationHandle, GenerationService

__all__ = ["PriorityHeader", "RequestTimeout", "collect_texts", "first_delta", "merged_deltas"]

RequestTimeout = Annotated[
    float | None,
    Header(
        gt=0,
        allow_inf_nan=False,
        description="Seconds the request may wait in the queue before it is answered 504.",
    ),
]


PriorityHeader = Annotated[
    int | None,
    Header(
        description="Priority level of this call (strategy adaptive): 0 (the default) to the "
        "server's priority_levels - 1; higher levels jump the queue of lower ones.",
    ),
]


async def merged_deltas(
    engine: GenerationService[Any], seqs: Sequence[GenerationHandle]
) -> AsyncGenerator[tuple[int, Delta]]:
    """(choice index, delta) from every sequence as they arrive."""
    if len(seqs) == 1:
        async for d in engine.stream(seqs[0]):
            yield 0, d
        return
    out: asyncio.Queue[tuple[int, Delta] | BaseException | None] = asyncio.Queue()

    async def pump(i: int, s: GenerationHandle) -> None:
        try:
            async for d in engine.stream(s):
                out.put_nowait((i, d))
        except BaseException as exc:  # forwarded to the consumer
            out.put_nowait(exc)
            return
        out.put_nowait(None)

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(seqs)]
    try:
        done = 0
        while done < len(seqs):
            item = await out.get()
            if item is None:
                done += 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        for s in seqs:
            engine.cancel(s)


async def collect_texts(
    engine: GenerationService[Any], seqs: list[GenerationHandle]
) -> tuple[list[str], list[str | None], list[list[TokenLogprob]]]:
    """Each choice's whole text, finish reason and token log-probabilities (where asked)."""
    texts = [""] * len(seqs)
    reasons: list[str | None] = [None] * len(seqs)
    logprobs: list[list[TokenLogprob]] = [[] for _ in seqs]
    async for i, d in merged_deltas(engine, seqs):
        texts[i] += d.text
        if d.logprobs:
            logprobs[i].extend(d.logprobs)
        if d.finish_reason is not None:
            reasons[i] = d.finish_reason
    return texts, reasons, logprobs


async def first_delta(
    merged: AsyncIterator[tuple[int, Delta]],
) -> tuple[tuple[int, Delta], ...]:
    """The first (choice index, delta) of `merged` as a one-item tuple; empty if none came."""
    try:
        return (await anext(merged),)
    except StopAsyncIteration:
        return ()
