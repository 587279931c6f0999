"""The ingress's generation service: completions and chat on Ray, relayed by stream.

`create_llm_app` (the OpenAI completions API of `lenbatch serve --model <causal LM>`) is served
unchanged over an `LMFrontend`, as the embeddings app is over a `Frontend`: same validation,
defaults, chat template, SSE framing and error shape. What the app's calls do here:

    prompt_ids / chat_prompt ─► tokenize once at the ingress, in a worker thread (`Prompts`
                                 over the model's tokenizer alone: no weights are loaded)
    submit_all ─► the single server's prompt checks (`Prompts.check`), then one ledger ticket
                  and one `RemoteSequence` per prompt, owned by the group whose range holds
                  its length; a task relays it from `LMReplica.generate(..., group=owner)`
                  (a streaming handle call, `LengthRangeRouter`) onto its delta queue
    stream     ─► the deltas from that queue as they come

Faults: a replica that dies before a token went out (queued, prefilling) gets the prompt sent
again, to another replica; once tokens have been relayed, the stream ends with an explicit 503
`replica_failed` (an SSE error event when streaming), never silence. A client that leaves
cancels the replica's sequence; a drain that times out ends the stream with a 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Iterable, Sequence
from typing import Any, Unpack

from lenbatch.generate.prompts import PromptCalls, Prompts
from lenbatch.scaleout.board import RoutingBoard
from lenbatch.scaleout.calls import RelayedError, StreamCut
from lenbatch.scaleout.ingress import IngressSettings, RayFrontend
from lenbatch.serving.ledger import Ticket
from lenbatch.serving.messages import Delta, SamplingParams, SubmitOptions, TokenLogprob
from lenbatch.serving.services import params_per_prompt
from lenbatch.serving.streams import DeltaQueue, DeltaStreams, SinkReply

__all__ = ["LMFrontend", "RemoteSequence"]

log = logging.getLogger("lenbatch.scaleout")


class RemoteSequence:
    """A prompt generated on a replica, as the routes see it (a `GenerationHandle`)."""

    def __init__(
        self,
        prompt: list[int],
        params: SamplingParams,
        owner: int,
        timeout: float | None,
        priority: int,
    ) -> None:
        self.request_id = uuid.uuid4().hex[:24]
        self.prompt = prompt
        self.params = params
        self.owner = owner  # the group whose length range holds the prompt
        self.timeout = timeout
        self.priority = priority
        self.generated: list[int] = []  # token ids relayed so far
        self.timings: dict[str, Any] = {}  # the replica's, once the sequence has finished
        self.cached_tokens = 0  # prompt tokens from the replica's prefix cache (at the end)
        self.sink: DeltaQueue = asyncio.Queue()
        self.ticket: Ticket[Delta] | None = None
        self.relay: asyncio.Task[None] | None = None  # the task relaying it from a replica

    @property
    def prompt_tokens(self) -> int:
        """Tokens in the prompt."""
        return len(self.prompt)

    @property
    def completion_tokens(self) -> int:
        """Tokens generated so far."""
        return len(self.generated)

    def timings_ms(self) -> dict[str, Any]:
        """The replica's TTFT breakdown, inter-token and end-to-end times (once finished)."""
        return dict(self.timings)

    def stop(self) -> None:
        """Stop relaying (cancelling the replica's sequence), unless the relay is what ended."""
        relay = self.relay
        if relay is not None and relay is not asyncio.current_task():
            relay.cancel()


class LMFrontend(PromptCalls, DeltaStreams[RemoteSequence], RayFrontend[Delta]):
    """The `GenerationService` of the ingress: routes prompts to the LM replicas by length."""

    def __init__(
        self,
        handle: Any,
        board: RoutingBoard,
        prompts: Prompts,
        boundaries: Iterable[int],
        **settings: Unpack[IngressSettings],
    ) -> None:
        """`prompts` tokenizes and checks prompts with the model's tokenizer alone."""
        super().__init__(handle, board, prompts.info, boundaries, **settings)
        # The prompt calls (`PromptCalls`) go through `Prompts`, as the single server's
        # engine makes them: the same ids and the same refusals from either.
        self.prompts = prompts
        self.generation = prompts.generation
        self._stream_handle = handle.options(stream=True)

    def _release(self) -> None:
        self.prompts.close()

    async def prompt_logprobs(self, prompt: list[int], top: int) -> list[TokenLogprob]:
        """A checked prompt's log-probabilities (`echo`) from a replica of its length's group:
        one forward of the prompt there (the ingress holds the tokenizer, not the model)."""
        self.check_running()
        group = self.calls.group(self.place([len(prompt)])[0])
        cost = self.cost_of([len(prompt)])

        async def attempt() -> list[TokenLogprob]:
            out = await self.handle.prompt_logprobs.remote(prompt, top, group=group, cost=cost)
            if "error" in out:
                raise RelayedError(out["error"])
            return list(out["logprobs"])

        return await self.calls.send(attempt)

    def submit_all(
        self,
        prompts: list[list[int]],
        params: SamplingParams | Sequence[SamplingParams],
        **options: Unpack[SubmitOptions],
    ) -> list[RemoteSequence]:
        """Admit every prompt of one call (`params`: one for all, or one per prompt), each
        owned by the group of its length, and start relaying it from a replica; a prompt the
        checks refuse refuses the whole call."""
        self.check_running()
        each = params_per_prompt(prompts, params)
        for p, sp in zip(prompts, each, strict=True):
            # The single server's checks, here so a bad prompt is refused with its status
            # before a stream starts; the replica's engine makes them again, and its
            # admission (queue limits) answers the rest.
            self.prompts.check(p, sp)
        timeout = options.get("timeout")
        if timeout is None:
            timeout = self.request_timeout
        priority = options.get("priority", 0)
        now = self.clock.now()
        seqs = []
        owners = self.place([len(p) for p in prompts])
        for p, sp, owner in zip(prompts, each, owners, strict=True):
            seq = RemoteSequence(p, sp, owner, timeout, priority)
            seq.ticket = self._admit(len(p), SinkReply(seq.sink, seq.stop), now)
            seq.relay = asyncio.create_task(self._settle(seq.ticket, self._relay(seq)))
            seqs.append(seq)
        return seqs

    async def _relay(self, seq: RemoteSequence) -> Delta:
        """Relay `seq` from a replica of its group, again from another replica if its replica
        dies before a token went out; returns the last delta (its ticket's answer)."""
        return await self.calls.send(lambda: self._attempt(seq), lambda: len(seq.generated))

    async def _attempt(self, seq: RemoteSequence) -> Delta:
        """One streaming call to a replica: its deltas onto `seq`'s queue; returns the last
        one (with its finish reason). Raises the replica's error, or `StreamCut` if the
        stream ends without a finish."""
        call = self._stream_handle.generate.remote(
            seq.prompt,
            seq.params,
            seq.timeout,
            seq.priority,
            group=self.calls.group(seq.owner),
            cost=self.cost_of([len(seq.prompt)]),  # the prefill's
        )
        try:
            async for item in call:
                if "error" in item:
                    raise RelayedError(item["error"])
                if "admitted" in item:
                    continue
                delta = Delta(
                    tuple(item["ids"]), item["text"], item["finish_reason"], item.get("logprobs")
                )
                seq.generated.extend(delta.token_ids)
                if delta.finish_reason is not None:
                    seq.timings = item.get("timings", {})
                    seq.cached_tokens = int(item.get("cached_tokens", 0))
                    return delta
                seq.sink.put_nowait(delta)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                call.cancel()  # the caller left: the replica's sequence stops too
            raise
        raise StreamCut("the replica's stream ended without a finish")
