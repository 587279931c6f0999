"""A generation's way back to its caller: deltas through its queue, its ending through the ledger.

`open_generation` makes the `Generation` of one queued prompt: its text tracker, timings, event
queue and ledger ticket (whose reply is a `StreamReply`). The engine's loop puts every delta but
the last on the queue while the request is open; the last delta, an error or an expiry come
through the ledger, which answers each admitted request exactly once. `deltas` reads the queue
for the caller, on the event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from lenbatch.core.errors import LenbatchError
from lenbatch.core.request import Request
from lenbatch.generate.generation import Generation, Timings
from lenbatch.generate.sampling import TextTracker
from lenbatch.runners.base import CausalRunner
from lenbatch.serving.ledger import Ticket
from lenbatch.serving.messages import Delta, SamplingParams

__all__ = ["StreamReply", "deltas", "open_generation", "ticket_of"]


class StreamReply:
    """A `Reply` through a generation's event queue: the stream reads deltas, then its ending.

    Only the last delta goes through the ledger (`answer`); the ones before it are put on the
    queue directly while the request is open. An error or a cancellation also takes the
    generation out of the running batch at the next step."""

    __slots__ = ("gen",)

    def __init__(self, gen: Generation) -> None:
        self.gen = gen

    def give(self, value: Delta) -> None:
        """The last delta."""
        self.gen.sink.put_nowait(value)

    def refuse(self, err: LenbatchError) -> None:
        """The stream raises `err`; the generation leaves its batch."""
        self.gen.cancelled = True
        self.gen.sink.put_nowait(err)

    def withdraw(self) -> None:
        """The caller left: the generation leaves its batch."""
        self.gen.cancelled = True

    @property
    def abandoned(self) -> bool:
        """Never on its own: a caller that leaves the stream cancels through the engine."""
        return False


def open_generation(
    request: Request[Generation],
    params: SamplingParams,
    runner: CausalRunner,
    timings: Timings,
) -> Generation:
    """The `Generation` of `request`, with its event queue and its (not yet admitted) ticket."""
    gen = Generation(
        request, params, TextTracker(runner.decode, params.stop), timings, runner.device
    )
    gen.sink = asyncio.Queue()
    request.handle = gen
    gen.ticket = Ticket(request, StreamReply(gen), arrival=timings.arrival)
    return gen


async def deltas(gen: Generation) -> AsyncIterator[Delta]:
    """The deltas of `gen` as they arrive; the last one has a finish reason. Raises the
    request's `LenbatchError` if it fails."""
    while True:
        item = await gen.sink.get()
        if isinstance(item, LenbatchError):
            raise item
        yield item
        if item.finish_reason is not None:
            return


def ticket_of(gen: Generation) -> Ticket[Delta]:
    """The ledger ticket of `gen`; a generation without one was never admitted (a bug)."""
    if gen.ticket is None:
        raise RuntimeError(f"bug: generation of request {gen.request.id} was never admitted")
    return gen.ticket
