"""How a call enters the embedding engine: its inputs tokenized (texts, in worker threads) and
checked, admitted (length, budget, queue and rate limits; `adaptive`'s due time and shedding),
queued by length, and awaited until every row is answered. With several inputs, an error's
message names the failing one; a caller that leaves takes its requests out of the queue.

`EmbeddingIntake` is the base of `Engine` (`embed/engine.py`), split from it: the engine sets
up what these calls use and runs the loop that answers the requests they queue.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Unpack

from lenbatch.core.adaptive import AdaptiveState
from lenbatch.core.errors import BadInput, LenbatchError
from lenbatch.core.request import Request
from lenbatch.embed.inputs import InputReader, tokenize_checked
from lenbatch.embed.refit import LiveRefit
from lenbatch.runners.base import EmbeddingRunner
from lenbatch.serving.engine import BaseEngine
from lenbatch.serving.ledger import FutureReply, Ticket
from lenbatch.serving.messages import CallOptions, Embedded, Inputs, Vector

__all__ = ["EmbeddingIntake"]


class EmbeddingIntake(BaseEngine[Vector]):
    """The calls that put work into an embedding engine (`tokenize`, `embed`,
    `embed_with_usage`, `check_priority`, `submit_ids`); `Engine` sets up what they use."""

    runner: EmbeddingRunner
    default_truncate: bool
    inputs: InputReader  # texts are tokenized in worker threads, never on the event loop
    priority_levels: int
    adaptive: AdaptiveState | None  # strategy adaptive: due times and shedding at admission
    refit: LiveRefit | None  # the online boundary re-fit, which counts each admitted length

    def tokenize(self, texts: Sequence[str], truncate: bool | None = None) -> list[list[int]]:
        """Token ids of `texts` (the caller drops the text afterwards).

        Raises `BadInput` for an empty text, one that is not valid Unicode, or one the
        tokenizer cannot process (the error names the input's index, never its content).
        """
        truncate = self.default_truncate if truncate is None else truncate
        return tokenize_checked(self.runner.tokenize, texts, truncate)

    async def embed(self, inputs: Inputs, **options: Unpack[CallOptions]) -> list[Vector]:
        """Embed each input (a text, or a token-id array); one vector per input, in order.

        Raises a `LenbatchError` (bad input, too long, overloaded, deadline, model failure,
        unavailable); with several inputs its message starts with the failing input's index.
        If the caller is cancelled, its requests leave the queue before they cost compute.
        """
        return (await self.embed_with_usage(inputs, **options)).vectors

    async def embed_with_usage(self, inputs: Inputs, **options: Unpack[CallOptions]) -> Embedded:
        """`embed`, also counting the tokens embedded (OpenAI's `usage.prompt_tokens`).

        The one path from a call's inputs to its answer: tokenize (texts), check the
        vocabulary (token arrays), truncate if asked, admit (length, budget, queue and rate
        limits), queue, and wait for every vector.
        """
        priority = options.get("priority", 0)
        self.check_running()
        self.check_priority(priority)
        # Too long for the model: cut here if asked; otherwise admission refuses it (413).
        seqs = await self.inputs.read(inputs, options.get("truncate"))
        vectors = await self.submit_ids(
            seqs, None, priority, options.get("timeout"), options.get("arrival")
        )
        return Embedded(vectors, sum(len(x) for x in seqs))

    def check_priority(self, priority: int) -> None:
        """Raise `BadInput` unless `priority` is one of this server's levels."""
        if isinstance(priority, bool) or not 0 <= priority < self.priority_levels:
            allowed = (
                "0 (this server has one priority level: start it with --priority-levels N for more)"
                if self.priority_levels == 1
                else f"an integer in [0, {self.priority_levels - 1}] (higher runs first)"
            )
            raise BadInput(f"priority must be {allowed}; got {priority!r}", code="invalid_priority")

    async def submit_ids(
        self,
        seqs: list[list[int]],
        segments: list[list[int]] | None,
        priority: int,
        timeout: float | None,
        arrival: float | None = None,
    ) -> list[Vector]:
        """Admit tokenized inputs (with their segment ids, if pairs), queue each by its length,
        and wait for every row; raises the refusal or the first failure (its message starts
        with the failing input's index when there are several). `arrival`: when the route
        received the call (latency, due time and timeout count from it; None: now)."""
        self.check_running()  # drained while this request was tokenizing
        loop = asyncio.get_running_loop()
        now = self.clock.now()
        # What the call waited since its route took it (tokenizing, the tokenizer threads)
        # counts against its SLO: `adaptive` plans with the time it has left, not a fresh one.
        arrival = now if arrival is None else min(arrival, now)
        self.metrics.record_intake(now - arrival)
        refusal = self.admission.check([len(s) for s in seqs], self.queues, now)
        if refusal is not None:
            self.metrics.record_rejection(refusal.code)
            raise refusal
        timeout = timeout if timeout is not None else self.request_timeout
        deadline = None if timeout is None else arrival + timeout
        ad = self.adaptive
        due = None
        if ad is not None:
            due = ad.due_of(arrival, priority, timeout)
            shed = ad.admit([len(s) for s in seqs], due, self.queues, self.cfg, now, priority)
            if shed is not None:
                self.metrics.record_rejection(shed.code)
                self.metrics.record_shed("admission")
                raise shed
        requests: list[Request[Ticket[Vector]]] = []
        for i, x in enumerate(seqs):
            r: Request[Ticket[Vector]] = Request(
                len(x), arrival, x, deadline=deadline, priority=priority
            )
            if segments is not None:
                r.token_type_ids = segments[i]
            r.handle = Ticket(r, FutureReply(loop.create_future()))
            r.due = due
            lane = self.queues.push(r)
            if ad is not None:
                ad.on_arrival(lane, r.length, now)
            if self.refit is not None:
                self.refit.observe(r.length)
            requests.append(r)
        self.metrics.record_priority(priority, len(requests))
        self.ledger.admit(r.handle for r in requests)
        self._kick()
        try:
            if len(requests) == 1:  # most calls: no gathering future and its callbacks
                return [await _future(requests[0])]
            return list(await asyncio.gather(*(_future(r) for r in requests)))
        except LenbatchError as err:
            culprit = next((i for i, r in enumerate(requests) if _failed_with(r, err)), None)
            if len(requests) == 1 or culprit is None:
                raise
            raise type(err)(
                f"input {culprit}: {err.message}", retry_after=err.retry_after, code=err.code
            ) from None
        finally:
            # On error or cancellation: nobody wants the siblings any more.
            for r in requests:
                self.ledger.cancel(r.handle)


def _future(r: Request[Ticket[Vector]]) -> asyncio.Future[Vector]:
    reply = r.handle.reply
    assert isinstance(reply, FutureReply)
    return reply.future


def _failed_with(r: Request[Ticket[Vector]], err: BaseException) -> bool:
    fut = _future(r)
    return fut.done() and not fut.cancelled() and fut.exception() is err
