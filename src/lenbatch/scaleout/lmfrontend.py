"""The ingress's generation-engine stand-in: completions and chat on Ray, relayed by stream.

`create_llm_app` (the OpenAI completions API of `lenbatch serve --model <causal LM>`) is served
unchanged over an `LMFrontend`, as the embeddings app is over a `Frontend`: same validation,
defaults, chat template, SSE framing and error shape. What the app's engine calls do here:

    prompt_ids / chat_prompt ─► tokenize once at the ingress (an unstarted local
                                 GenerationEngine does it exactly as the single server)
    submit_all ─► `GenerationEngine.check_prompt` (the single server's checks), then one
                  `RemoteSequence` per prompt, owned by the group whose range holds its length
    stream     ─► a streaming handle call `LMReplica.generate(..., group=owner)` to a replica
                  of that group (`LengthRangeRouter`), its deltas relayed as they come

Faults: a replica that dies before the first token reached the app (queued, prefilling) gets
the prompt sent again, to another replica; once tokens have been relayed, the stream ends with
an explicit 503 `replica_failed` (an SSE error event when streaming), never silence. A client
that leaves cancels the replica's sequence.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from lenbatch.generate.engine import GenerationEngine
from lenbatch.scaleout.board import RoutingBoard
from lenbatch.scaleout.frontend import Frontend, RelayedError, is_replica_failure, own_call_id
from lenbatch.serving.messages import Delta, SamplingParams

__all__ = ["LMFrontend", "RemoteSequence"]


class _RequestRef:
    """The part of a `core.Request` the app reads: its id."""

    __slots__ = ("id",)

    def __init__(self) -> None:
        self.id = uuid.uuid4().hex[:24]


class RelayedTimings:
    """The replica's TTFT breakdown of a sequence, once it has finished."""

    def __init__(self) -> None:
        self.summary: dict[str, Any] = {}

    def summary_ms(self) -> dict[str, Any]:
        """As `generate.sequence.Timings.summary_ms`, measured on the replica."""
        return dict(self.summary)


class RemoteSequence:
    """A prompt generated on a replica, as the generation app sees a `Sequence`."""

    def __init__(
        self,
        prompt: list[int],
        params: SamplingParams,
        owner: int,
        timeout: float | None,
        priority: int,
    ) -> None:
        self.request = _RequestRef()
        self.prompt = prompt
        self.params = params
        self.owner = owner
        self.timeout = timeout
        self.priority = priority
        self.generated: list[int] = []
        self.timings = RelayedTimings()
        self.started = time.perf_counter()
        self.open = True
        self.call: Any = None  # the streaming handle call in flight

    @property
    def prompt_tokens(self) -> int:
        """Tokens in the prompt."""
        return len(self.prompt)


class LMFrontend(Frontend):
    """The `GenerationEngine` stand-in of the ingress: routes prompts to LM replicas."""

    def __init__(
        self,
        handle: Any,
        board: RoutingBoard,
        local: GenerationEngine,
        boundaries: list[int],
        *,
        routing: str = "length",
        request_timeout: float | None = None,
        attempts: int = 3,
    ) -> None:
        super().__init__(
            handle,
            board,
            local.runner,
            local.info,
            boundaries,
            routing=routing,
            request_timeout=request_timeout,
            attempts=attempts,
        )
        # Never started: it tokenizes and applies the chat template exactly as the single
        # server's engine does, and answers the app's questions about limits and defaults.
        self.local = local
        self.clock = local.clock
        self.generation = local.generation
        self._stream_handle = handle.options(stream=True)

    # ---------------------------------------------------------------- the app's engine calls

    async def prompt_ids(
        self, raw: str | list[str] | list[int] | list[list[int]]
    ) -> list[list[int]]:
        """Token ids of a call's prompts (texts tokenized here, off the event loop, then
        dropped)."""
        return await self.local.prompt_ids(raw)

    @property
    def has_chat_template(self) -> bool:
        """True if the tokenizer can format chat messages."""
        return self.local.has_chat_template

    async def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of chat `messages` through the tokenizer's chat template."""
        return await self.local.chat_prompt(messages)

    def context_left(self, prompt_len: int) -> int:
        """Most tokens a prompt of `prompt_len` tokens may generate."""
        return self.local.context_left(prompt_len)

    def submit_all(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        *,
        arrival: float | None = None,
        timeout: float | None = None,
        priority: int = 0,
    ) -> list[RemoteSequence]:
        """One `RemoteSequence` per prompt, each owned by the group of its length; nothing is
        sent until the app streams it."""
        self.check_running()
        for p in prompts:
            # The single server's checks, here so a bad prompt is refused with its status
            # before a stream starts; the replica's engine makes them again, and its
            # admission (queue limits) answers the rest.
            self.local.prompts.check(p, params)
        lengths = [len(p) for p in prompts]
        self.ranges.observe(lengths)
        timeout = timeout if timeout is not None else self.request_timeout
        seqs = []
        for p in prompts:
            seqs.append(RemoteSequence(p, params, self.ranges.owner(len(p)), timeout, priority))
            self.call_admitted()
        return seqs

    async def stream(self, seq: RemoteSequence) -> AsyncIterator[Delta]:
        """The deltas of `seq` from its replica; sent again to another replica if its replica
        dies before the first token; an explicit 503 if it dies after."""
        owner = seq.owner if self.routing == "length" else None
        last: BaseException | None = None
        try:
            for attempt in range(self.attempts):
                if attempt:
                    self.count_retry()
                own_call_id()
                seq.call = self._stream_handle.generate.remote(
                    seq.prompt,
                    seq.params,
                    seq.timeout,
                    seq.priority,
                    group=owner,
                    cost=self.cost_of([len(seq.prompt)]),  # the prefill's
                )
                try:
                    async for item in seq.call:
                        if "error" in item:
                            raise RelayedError(item["error"])
                        if "admitted" in item:
                            continue
                        delta = Delta(tuple(item["ids"]), item["text"], item["finish_reason"])
                        seq.generated.extend(delta.token_ids)
                        if "timings" in item:
                            seq.timings.summary = item["timings"]
                        yield delta
                        if delta.finish_reason is not None:
                            self._close(seq, ok=True)
                            return
                    last = RuntimeError("the replica's stream ended without a finish")
                except Exception as exc:
                    if not is_replica_failure(exc):
                        raise
                    last = exc
                if seq.generated:  # tokens went out: they cannot be taken back
                    raise self.replica_failed(f"{len(seq.generated)} tokens were sent", last)
            raise self.replica_failed(f"{self.attempts} attempts failed", last)
        finally:
            self.cancel(seq)

    def cancel(self, seq: RemoteSequence) -> None:
        """The caller is gone (or the stream ended): stop the replica's sequence if it still
        runs, and count the request answered."""
        self._close(seq, ok=False)

    def _close(self, seq: RemoteSequence, *, ok: bool) -> None:
        if not seq.open:
            return
        seq.open = False
        call, seq.call = seq.call, None
        if call is not None and not ok:
            call.cancel()
        self.call_ended(time.perf_counter() - seq.started if ok else None)
