"""A generation's way back to its caller: deltas through its queue, its ending through the ledger.

`open_generation` makes the `Generation` of one queued prompt: its text tracker, timings, event
queue and ledger ticket (whose reply is a `serving.streams.SinkReply` on that queue). The
engine's loop puts every delta but the last on the queue while the request is open; the last
delta, an error or an expiry come through the ledger, which answers each admitted request
exactly once; an early ending takes the generation out of the running batch at the next step.
The caller reads the queue with `serving.streams.read_deltas`, on the event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from lenbatch.core.request import Request
from lenbatch.generate.generation import Generation, Timings
from lenbatch.generate.sampling import TextTracker
from lenbatch.generate.structured import grammars_for
from lenbatch.runners.base import CausalRunner
from lenbatch.serving.ledger import Ticket
from lenbatch.serving.messages import Delta, SamplingParams
from lenbatch.serving.streams import SinkReply

__all__ = ["open_generation", "ticket_of", "token_texts_of"]


def open_generation(
    request: Request[Generation],
    params: SamplingParams,
    runner: CausalRunner,
    timings: Timings,
) -> Generation:
    """The `Generation` of `request`, with its event queue, its (not yet admitted) ticket and,
    where its text is constrained, its grammar matcher."""
    texts = token_texts_of(runner) if params.logprobs is not None else None
    tracker = TextTracker(runner.decode, params.stop, params.include_stop_str_in_output)
    gen = Generation(request, params, tracker, timings, runner.device, texts)
    if params.constraint is not None:
        gen.matcher = grammars_for(runner, runner.info.vocab_size).matcher(params.constraint)
    gen.sink = asyncio.Queue()
    request.handle = gen

    def leave_batch() -> None:
        gen.cancelled = True

    gen.ticket = Ticket(request, SinkReply(gen.sink, leave_batch), arrival=timings.arrival)
    return gen


def token_texts_of(runner: CausalRunner) -> Callable[[list[int]], list[str]]:
    """Each token's own text: the runner's `token_texts` (special tokens included), else its
    `decode` one token at a time (special tokens skipped)."""
    texts: Callable[[list[int]], list[str]] | None = getattr(runner, "token_texts", None)
    return texts or (lambda ids: [runner.decode([i]) for i in ids])


def ticket_of(gen: Generation) -> Ticket[Delta]:
    """The ledger ticket of `gen`; a generation without one was never admitted (a bug)."""
    if gen.ticket is None:
        raise RuntimeError(f"bug: generation of request {gen.request.id} was never admitted")
    return gen.ticket
