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

from lenbatch.core.errors import LenbatchError
from lenbatch.serving.messages import Delta

__all__ = ["DeltaQueue", "SinkReply", "read_deltas"]

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
