"""Discrete-event simulation of a causal LM's continuous batching, `continuous` or `adaptive`,
under a virtual clock: the engine's own decode policies (`generate.policy.ContinuousPolicy`,
`generate.adaptive.AdaptiveGenPolicy`) decide, unit times come from two cost models.

    requests ─► (adaptive: refusal at the door) ─► FIFO queue ─► one prefill job at a time
             ─► policy.next_unit: prefill chunk | decode step ─► first token, later tokens

What it mirrors from `generate.engine.GenerationEngine`: one prefill job in flight (the engine's
single scheduler slot), formed from the queue's head when the policy has room (at most
`max_batch` rows) and freed once its rows join the decode batch; the policy's room, chunk size and
alternation; adaptive's door refusal (with the same inputs the engine passes) and its queue
shedding before each admission; a decode step costs `decode.seconds(rows, width)` with `width`
the longest row's prompt plus its tokens so far (the right-aligned cache); a chunk costs
`prefill.seconds(rows, real tokens / rows)`, its real prompt tokens, as the lean Llama path
runs it (left padding through no product; `real_tokens=False`: `prefill.seconds(rows, cols)`,
the padded shape transformers' forward runs), and adaptive's cost models learn it on the same
basis, as the engine sets them from its runner. Arrivals during a unit are seen when it ends,
as the engine's event loop sees them.

What it does not: length buckets (the queue is one FIFO), end-of-sequence before `max_tokens`
(every request generates its trace's output length, as `ignore_eos` replays do), client
disconnects, model failures, and the HTTP and tokenization work except as the cost models carry
it. Adaptive's cost models see every unit's shape and time, as in the engine (the turn time
is the unit's, so drift stays 1).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from lenbatch.core.costfit import CostCoefficients
from lenbatch.core.request import Request
from lenbatch.generate.adaptive import AdaptiveGenPolicy, RunningRow
from lenbatch.generate.policy import DecodePolicy

__all__ = ["GenOutcome", "GenRequest", "goodput", "simulate_generation"]


@dataclass(frozen=True, slots=True)
class GenRequest:
    """One completion of a trace: arrival (s), prompt and output tokens, priority."""

    arrival: float
    prompt: int
    output: int
    priority: int = 0


@dataclass(slots=True)
class GenOutcome:
    """What became of one request: refused (at the door or from the queue), or its TTFT and
    mean inter-token latency (seconds; NaN until known)."""

    refused: bool = False
    ttft: float = math.nan
    mean_itl: float = math.nan
    finished: float = math.nan


@dataclass(eq=False)
class _Job:
    gens: list[int]
    width: int
    done_cols: int = 0
    max_cols: int | None = None
    alone: bool = False

    @property
    def rows(self) -> int:
        return len(self.gens)

    @property
    def remaining(self) -> int:
        return self.width - self.done_cols


@dataclass
class _Row:
    index: int
    left: int  # tokens still to generate
    length: int  # prompt + tokens so far
    first: float
    after: int = 0  # tokens after the first


@dataclass
class _Core:
    """The decoder facts a policy reads."""

    jobs: deque[_Job] = field(default_factory=deque)
    rows: list[_Row] = field(default_factory=list)
    # The simulator runs prefill chunks and decode steps as separate units (no mixed forward).
    mixer: None = None

    @property
    def running_rows(self) -> int:
        return len(self.rows)

    @property
    def pending_rows(self) -> int:
        return sum(j.rows for j in self.jobs)

    @property
    def idle(self) -> bool:
        return not self.jobs and not self.rows


def simulate_generation(
    requests: Sequence[GenRequest],
    policy: DecodePolicy,
    prefill: CostCoefficients,
    decode: CostCoefficients,
    *,
    max_batch: int = 32,
    real_tokens: bool = True,
) -> list[GenOutcome]:
    """Run `requests` (sorted by arrival) through `policy`; one outcome per request.
    `real_tokens`: price a prefill chunk by its real prompt tokens (else its padded shape)."""
    out = [GenOutcome() for _ in requests]
    adaptive = policy if isinstance(policy, AdaptiveGenPolicy) else None
    if adaptive is not None:
        adaptive.costs.real_tokens = real_tokens
    queue: deque[int] = deque()
    waiting: dict[int, Request[Any]] = {}
    core = _Core()
    now, nxt, last = 0.0, 0, None
    while nxt < len(requests) or queue or not core.idle:
        # arrivals up to now, each priced at the door as the engine prices it at submit
        while nxt < len(requests) and requests[nxt].arrival <= now:
            r = requests[nxt]
            if adaptive is not None and _refused(adaptive, r, now, queue, waiting, core):
                out[nxt].refused = True
            else:
                queue.append(nxt)
                # one FIFO: every request waits in lane 0
                waiting[nxt] = Request(r.prompt, r.arrival, None, priority=r.priority, lane=0)
            nxt += 1
        if adaptive is not None and queue:
            for req in adaptive.overdue([waiting[i] for i in queue], now):
                i = next(i for i in queue if waiting[i] is req)
                queue.remove(i)
                del waiting[i]
                out[i].refused = True
        room = policy.capacity(core)  # type: ignore[arg-type]
        if room > 0 and queue and not core.jobs:
            take = [queue.popleft() for _ in range(min(room, max_batch, len(queue)))]
            for i in take:
                del waiting[i]
            core.jobs.append(_Job(take, max(requests[i].prompt for i in take)))
        if adaptive is not None:  # as the engine does before each unit
            adaptive.observe_rows(now, [(row.after + 1, row.first) for row in core.rows])
        unit = policy.next_unit(core, last)  # type: ignore[arg-type]
        if unit is None:
            if nxt >= len(requests):
                break
            now, last = max(now, requests[nxt].arrival), None
            continue
        if unit.kind == "prefill":
            job = core.jobs[0]
            cols = min(unit.cols, job.remaining)
            lo, hi = job.done_cols, job.done_cols + cols
            # prompts are left-padded to the job's width: prompt p fills [width - p, width)
            real = sum(max(0, hi - max(lo, job.width - requests[i].prompt)) for i in job.gens)
            if real_tokens:
                took = prefill.seconds(job.rows, real / job.rows) if real else prefill.a
            else:
                took = prefill.seconds(job.rows, cols)
            now += took
            _learn(adaptive, "prefill", job.rows, job.rows * cols, took, real)
            job.done_cols += cols
            if job.remaining <= 0:
                core.jobs.popleft()
                for i in job.gens:
                    out[i].ttft = now - requests[i].arrival
                    row = _Row(i, requests[i].output - 1, requests[i].prompt + 1, now)
                    if row.left <= 0:
                        _finish(out[i], row, now)
                    else:
                        core.rows.append(row)
        else:
            width = max(r.length for r in core.rows)
            took = decode.seconds(len(core.rows), width)
            now += took
            _learn(adaptive, "decode", len(core.rows), len(core.rows) * width, took, 0)
            keep = []
            for row in core.rows:
                row.left -= 1
                row.length += 1
                row.after += 1
                if row.left <= 0:
                    _finish(out[row.index], row, now)
                else:
                    keep.append(row)
            core.rows = keep
        last = unit.kind
    return out


def _refused(
    policy: AdaptiveGenPolicy,
    r: GenRequest,
    now: float,
    queue: deque[int],
    waiting: dict[int, Request[Any]],
    core: _Core,
) -> bool:
    rows = [RunningRow(max(1, row.left)) for row in core.rows]
    pending_tokens = sum(j.rows * j.remaining for j in core.jobs)
    err = policy.refusal(
        r.prompt,
        r.priority,
        now - r.arrival,
        [waiting[i] for i in queue],
        pending_tokens,
        rows,
        core.pending_rows,
        now=now,
        lane=0,
    )
    return err is not None


@dataclass(frozen=True, slots=True)
class _Figures:
    kind: str
    rows: int
    padded: int
    compute_s: float
    tokens: int  # prefill: the chunk's real prompt tokens
    prefill_rows: int = 0  # the simulator runs no mixed units
    prefill_padded: int = 0
    prefill_tokens: int = 0


def _learn(
    policy: AdaptiveGenPolicy | None, kind: str, rows: int, padded: int, s: float, real: int
) -> None:
    """Feed adaptive's cost models what the engine would: the unit's shape, tokens and time."""
    if policy is not None:
        policy.costs.observe(_Figures(kind, rows, padded, s, real), s)


def _finish(o: GenOutcome, row: _Row, now: float) -> None:
    o.finished = now
    o.mean_itl = (now - row.first) / row.after if row.after else 0.0


def goodput(
    outcomes: Sequence[GenOutcome], span_s: float, ttft_s: float = 1.0, itl_s: float = 0.150
) -> float:
    """Requests per second of `span_s` whose TTFT <= `ttft_s` and mean inter-token <= `itl_s`."""
    good = sum(1 for o in outcomes if o.ttft <= ttft_s and o.mean_itl <= itl_s)
    return good / span_s


def requests_of(trace: Any) -> list[GenRequest]:
    """A `plan.trace.Trace` with arrivals and output lengths as simulated requests."""
    if trace.arrivals is None or trace.output_lengths is None:
        raise ValueError("simulating generation needs a trace with arrivals and output lengths")
    return [
        GenRequest(float(a), int(n), int(o))
        for a, n, o in zip(trace.arrivals, trace.input_lengths, trace.output_lengths, strict=True)
    ]


def scaled(requests: Sequence[GenRequest], factor: float) -> list[GenRequest]:
    """The same requests with arrivals compressed `factor` times (a mean rate x `factor`)."""
    return [GenRequest(r.arrival / factor, r.prompt, r.output, r.priority) for r in requests]
