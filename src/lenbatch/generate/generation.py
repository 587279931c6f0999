"""One generation request in flight: its tokens, text, options and the times of its stages.

A `Generation` is created when a tokenized prompt is queued and lives until it has finished. The
engine's worker thread appends tokens and text to it; the event loop delivers each `Delta` to the
caller. `Timings` holds clock stamps from which the TTFT breakdown is derived so that the stages
add up to the measured time to first token exactly.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from lenbatch.core.request import Request
from lenbatch.generate.sampling import TextTracker, make_generator
from lenbatch.generate.structured import Matcher
from lenbatch.serving.ledger import Ticket
from lenbatch.serving.messages import Delta, SamplingParams, TokenLogprob

__all__ = ["STAGES", "Generation", "Timings"]

# TTFT stages, in pipeline order. Their sum is the time to first token.
STAGES = ("tokenize", "queue", "schedule", "prefill", "first_token")

_NAN = float("nan")

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Timings:
    """Clock stamps (seconds) of one request's way to its first token and beyond.

    * `arrival`: the server has the request (before tokenization);
    * `queued`: tokenized and queued;
    * `admitted`: the scheduler put it into a prefill batch;
    * `prefill_start` / `prefill_end`: first and last prefill forward pass of its batch
      (`prefill_compute` is the time spent in its own batch's forward passes; in between, with
      chunked prefill, other work such as decode steps may run);
    * `first_token`: its first token was handed to the caller's stream.
    """

    arrival: float
    queued: float = _NAN
    admitted: float = _NAN
    prefill_start: float = _NAN
    prefill_end: float = _NAN
    prefill_compute: float = 0.0
    first_token: float = _NAN
    token_times: list[float] = field(default_factory=list)
    finished: float = _NAN

    @property
    def ttft(self) -> float:
        """Arrival to first token, seconds (NaN before the first token)."""
        return self.first_token - self.arrival

    def stages(self) -> dict[str, float]:
        """The TTFT breakdown in seconds; the values sum to `ttft`.

        tokenize = queued - arrival; queue = admitted - queued (waiting for a batch);
        schedule = time from admission to the end of prefill not spent in its own prefill
        passes (collation, waiting for the running step, decode steps between prefill chunks);
        prefill = its batch's forward passes; first_token = end of prefill to delivery
        (sampling, detokenizing, handing the token to the event loop; its rows join the decode
        batch after that, `Decoder.publish`).
        """
        waited = (self.prefill_end - self.admitted) - self.prefill_compute
        return {
            "tokenize": self.queued - self.arrival,
            "queue": self.admitted - self.queued,
            "schedule": waited,
            "prefill": self.prefill_compute,
            "first_token": self.first_token - self.prefill_end,
        }

    def inter_token(self) -> list[float]:
        """Gaps between consecutive token deliveries, seconds."""
        t = self.token_times
        return [b - a for a, b in itertools.pairwise(t)]

    def summary_ms(self) -> dict[str, Any]:
        """JSON-ready timings in milliseconds (per-request breakdown in API responses)."""
        itl = self.inter_token()
        out: dict[str, Any] = {
            "ttft_ms": _ms(self.ttft),
            "stages_ms": {k: _ms(v) for k, v in self.stages().items()},
            "e2e_ms": _ms(self.finished - self.arrival),
            "mean_itl_ms": _ms(sum(itl) / len(itl)) if itl else None,
        }
        return out


def _ms(seconds: float) -> float | None:
    return None if math.isnan(seconds) else round(1000 * seconds, 3)


class Generation:
    """A request being generated. Mutated only by the engine (worker thread between steps,
    event loop for delivery), never concurrently."""

    __slots__ = (
        "cached_tokens",
        "cancelled",
        "finish_reason",
        "generated",
        "generator",
        "matcher",
        "params",
        "request",
        "sink",
        "step_logprob",
        "ticket",
        "timings",
        "token_texts",
        "tracker",
    )

    def __init__(
        self,
        request: Request[Generation],
        params: SamplingParams,
        tracker: TextTracker,
        timings: Timings,
        device: torch.device,
        token_texts: Callable[[list[int]], list[str]] | None = None,
    ) -> None:
        self.request = request
        self.params = params
        self.tracker = tracker
        self.timings = timings
        self.generator = make_generator(params, device)
        self.generated: list[int] = []
        self.finish_reason: str | None = None
        self.cancelled = False
        self.sink: Any = None  # the engine's per-request event queue
        self.ticket: Ticket[Delta] | None = None  # the engine's ledger entry, once admitted
        # With `params.logprobs`: each token's text (special tokens included), and the last
        # chosen token's (log-probability, top (id, log-probability)s) from `choose_next`.
        self.token_texts = token_texts
        self.step_logprob: tuple[float, list[tuple[int, float]]] | None = None
        # Where `params.constraint` is set: the grammar's matcher (`generate.structured`),
        # advanced by every token added.
        self.matcher: Matcher | None = None
        # Prompt tokens whose keys and values came from the prefix cache (OpenAI's
        # `usage.prompt_tokens_details.cached_tokens`).
        self.cached_tokens = 0

    @property
    def request_id(self) -> str:
        """The request's anonymous id."""
        return self.request.id

    @property
    def prompt_tokens(self) -> int:
        """Tokens in the prompt."""
        return self.request.length

    @property
    def completion_tokens(self) -> int:
        """Tokens generated so far."""
        return len(self.generated)

    def timings_ms(self) -> dict[str, Any]:
        """The TTFT breakdown, inter-token and end-to-end times, in milliseconds."""
        return self.timings.summary_ms()

    @property
    def done(self) -> bool:
        """Finished, or cancelled by its caller."""
        return self.finish_reason is not None or self.cancelled

    def add_token(self, token: int, eos_ids: frozenset[int]) -> Delta:
        """Append one generated token; returns the new text and, if it ended, why."""
        self.generated.append(token)
        p = self.params
        is_eos = (token in eos_ids and not p.ignore_eos) or token in p.stop_token_ids
        m = self.matcher
        if m is not None:
            if not m.consume(token):
                # The sampler masks what the grammar refuses, so this is a bug; the text before
                # the token is all the caller gets, ended as by a stop (no text in the log).
                log.warning("request %s: grammar refused token %d", self.request.id, token)
                is_eos = True
            elif m.stopped and token in eos_ids:
                is_eos = True  # the grammar is complete: its end ends the text, ignore_eos or not
        ids = self.generated[:-1] if is_eos else self.generated
        text = self.tracker.push(ids)
        if self.tracker.stopped or is_eos:
            self.finish_reason = "stop"
        elif len(self.generated) >= self.params.max_tokens:
            self.finish_reason = "length"
        if self.finish_reason is not None:
            text += self.tracker.flush()
        return Delta((token,), text, self.finish_reason, self._logprobs(token))

    def _logprobs(self, token: int) -> tuple[TokenLogprob, ...] | None:
        """The chosen `token`'s log-probability record, where the request asked for one."""
        step, self.step_logprob = self.step_logprob, None
        if step is None or self.token_texts is None:
            return None
        own, top = step
        texts = self.token_texts([token, *(i for i, _ in top)])
        alternatives = tuple((i, text, lp) for (i, lp), text in zip(top, texts[1:], strict=True))
        return (TokenLogprob(token, texts[0], own, alternatives),)
