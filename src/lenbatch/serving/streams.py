"""A generated sequence's deltas on their way to the caller, and the `Reply` that ends them.

The producer (a decode loop, or the Ray ingress relaying a replica's stream) puts each delta on
the sequence's `DeltaQueue` while the request is open; its ending goes through the ledger, which
puts the last delta or the error on the same queue through a `SinkReply`, so the caller reads
them in order with `read_deltas`. An ending that comes early (an error, a cancellation, a drain
that timed out) also calls the producer's `stop`, so it stops costing compute.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any, Generic, Protocol, TypeVar

from lenbatch.core.errors import LenbatchError
from lenbatch.serving.ledger import Ledger, Ticket
from lenbatch.serving.messages import Delta

__all__ = ["DeltaQueue", "DeltaStreams", "SinkReply", "StreamHandle", "read_deltas"]

DeltaQueue = asyncio.Queue[Delta | LenbatchError]
"""Deltas of one sequence, then its last delta (one with a finish reason) or its error."""


class SinkReply:
    """A `Reply` through a `DeltaQueue`: the last delta or the error goes on the queue after
    the deltas before it; `stop()` is called when the sequence ends without its last delta."""

    __slots__ = ("sink", "stop")

    def __init__(self, sink: DeltaQueue, stop: Callable[[], None]) -> None:
        self.sink = sink
        self.stop = stop

    def give(self, value: Delta) -> None:
        """The last delta."""
        self.sink.put_nowait(value)

    def refuse(self, err: LenbatchError) -> None:
        """The reader raises `err`; the producer stops."""
        self.stop()
        self.sink.put_nowait(err)

    def withdraw(self) -> None:
        """The caller left: the producer stops."""
        self.stop()

    @property
    def abandoned(self) -> bool:
        """Never on its own: a caller that leaves the stream cancels through its service."""
        return False


async def read_deltas(sink: DeltaQueue) -> AsyncIterator[Delta]:
    """The deltas on `sink` up to the one with a finish reason; raises the error that ended
    the sequence instead, if one did."""
    while True:
        item = await sink.get()
        if isinstance(item, LenbatchError):
            raise item
        yield item
        if item.finish_reason is not None:
            return


class StreamHandle(Protocol):
    """A generated sequence as its service keeps it: its delta queue and its ledger ticket
    (None until admitted)."""

    sink: Any  # its `DeltaQueue`
    ticket: Ticket[Delta] | None


H = TypeVar("H", bound=StreamHandle)


class DeltaStreams(Generic[H]):
    """`stream` and `cancel` of a `GenerationService` whose handles carry a delta queue and a
    ledger ticket: the generation engine and the Ray ingress's LM front-end alike."""

    ledger: Ledger[Delta]

    async def stream(self, handle: H) -> AsyncIterator[Delta]:
        """The deltas of one prompt as they are generated; the last has a finish reason.
        Raises the request's `LenbatchError` if it fails. Leaving early (break, cancellation,
        the client gone) cancels it, so it stops costing compute."""
        try:
            async for delta in read_deltas(handle.sink):
                yield delta
        finally:
            self.cancel(handle)

    def cancel(self, handle: H) -> None:
        """The caller is gone (or the stream ended): take the prompt out of its queue, or out
        of its batch at the next step (idempotent)."""
        if handle.ticket is not None:
            self.ledger.cancel(handle.ticket)
