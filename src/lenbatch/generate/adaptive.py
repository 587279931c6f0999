"""Strategy `adaptive` for causal LMs: deadlines on TTFT and inter-token latency, admission into
the running batch priced by a cost model, and shedding (429/503 + Retry-After) as a last resort.

Continuous batching with a fixed running cap has to be tuned to the load: a large cap lets the
decode step (and the prefill chunks between steps) grow past the inter-token budget, a small one
queues prompts until their first token is seconds late; past capacity either way the queue grows
without bound and every request misses its TTFT. This policy instead reads two online cost
models (`generate.costs.GenCosts`: one for prefill chunks, one for decode steps, in the house's
`WorkKind` terms) and decides each step:

* **room** (`AdaptiveGenPolicy.capacity`): the most rows whose decode step, plus the prefill chunk
  that may run between two steps, fits the inter-token SLO (never above `max_running`);
* **chunk** (`next_unit`): prefill columns sized so that chunk + decode step fit the same budget
  while rows are decoding, the whole prompt when nothing is; where the runner can, the chunk
  runs in one forward with the decode step (a mixed unit, as in `continuous`). The objective is
  each stream's *mean* inter-token latency, so the budget is the larger of one gap's and the
  stall every running row can still take with its mean kept within the objective even were its
  next token its last (`observe_rows`: rows that decoded faster than the objective have earned
  that time; a long prompt then reaches its first token in fewer, larger chunks);
* **admission at the door** (`refusal`): the request's predicted first-token time (prefill work
  ahead of it at its priority or above, interleaved with decode steps, plus the wait for a row
  when the batch is full) against its TTFT deadline; a prompt's prefill work is its tokens less
  those the prefix cache held for it when it arrived (`prefill_tokens`); refused with 429/503
  and `Retry-After` only when it cannot make it even so (with `ADMIT_SHARE` of margin);
* **shedding in the queue** (`overdue`): a queued request that can no longer reach its first token
  in time is ended (through the ledger) rather than served late at the expense of those behind it.

Every prediction is multiplied by `drift`, the recent ratio of the loop's measured turn time
(model call plus the event loop's delivery, the thread hand-off and the HTTP work sharing the
cores) to the cost models' prediction for that unit, so a slowdown counts at once. Pure: no
clock, no torch; the engine passes times in.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from lenbatch.config import AdaptiveConfig, GenerationConfig, ShedMode
from lenbatch.core.decisions import DecisionLog, ShedDecision
from lenbatch.core.errors import LenbatchError, Overloaded, Unavailable
from lenbatch.core.request import Request
from lenbatch.generate.costs import GenCosts
from lenbatch.generate.policy import Unit

__all__ = [
    "ADMIT_SHARE",
    "AdaptiveGenPolicy",
    "GenSLO",
    "RunningRow",
    "delivered",
    "prefill_tokens",
]

# TTFT objective when `adaptive.slo_ms` is unset (the goodput bar of the generation issue).
DEFAULT_TTFT_S = 1.0
# Share of the inter-token budget the decode step may take alone; the rest is for a prefill chunk.
DECODE_SHARE = 0.6
# Admit only when the predicted first token takes at most this share of the time left: the
# prediction leaves out the padding inside a prefill job and the wait for the job in flight,
# and `plan.gensim` finds it optimistic by about that much past capacity (goodput at 2x
# capacity 3.45/s with 0.7 against 2.5/s with 1.0; equal at 0.5x, no more shed at 0.8x).
ADMIT_SHARE = 0.7
# Smallest prefill chunk worth running (a smaller one pays the weights' pass for little work).
MIN_CHUNK = 16


class _Core(Protocol):
    """What the policy reads from the decoder (`generate.decode.Decoder`)."""

    @property
    def running_rows(self) -> int: ...

    @property
    def pending_rows(self) -> int: ...

    @property
    def jobs(self) -> Any: ...

    @property
    def mixer(self) -> Any: ...


@dataclass(frozen=True, slots=True)
class GenSLO:
    """Per-request objectives: time to first token (one per priority level, lowest first) and
    mean inter-token latency."""

    ttft_s: tuple[float, ...]
    itl_s: float

    @property
    def levels(self) -> int:
        """Priority levels (0 .. levels - 1)."""
        return len(self.ttft_s)

    def ttft(self, priority: int) -> float:
        """The TTFT objective of priority level `priority` (clamped to the levels)."""
        return self.ttft_s[max(0, min(priority, len(self.ttft_s) - 1))]

    @classmethod
    def from_config(cls, cfg: AdaptiveConfig) -> GenSLO:
        """`slo_ms` (or `priority_slo_ms`) as the TTFT objective, `itl_slo_ms` per token."""
        base = cfg.slo_ms / 1000 if cfg.slo_ms is not None else DEFAULT_TTFT_S
        levels = cfg.priority_slo_ms or (base * 1000,) * cfg.priority_levels
        return cls(tuple(v / 1000 for v in levels), cfg.itl_slo_ms / 1000)


@dataclass(frozen=True, slots=True)
class RunningRow:
    """A generation the batch is decoding or will decode: tokens it may still produce."""

    remaining: int


class AdaptiveGenPolicy:
    """Continuous batching whose running cap, chunk size, admission and shedding follow the
    cost models and the SLOs (see the module docstring). Satisfies `DecodePolicy`."""

    release_on_merge = True

    def __init__(
        self,
        generation: GenerationConfig,
        adaptive: AdaptiveConfig,
        costs: GenCosts,
    ) -> None:
        self.max_running = generation.max_running
        self.step_tokens = generation.step_tokens
        self.slo = GenSLO.from_config(adaptive)
        self.shed_mode = adaptive.shed
        self.costs = costs
        self.refused = 0  # at the door
        self.shed = 0  # from the queue
        # Why each refusal and shed happened: predicted first token (`finish_in`), the wait for
        # a row (`start_in`, `running_s`), the prefill ahead, the prefill cost model then.
        self.log = DecisionLog()
        self._ahead: tuple[float, int, int] = (0.0, 0, 0)
        self.unit_allowance = 0.0  # seconds the next unit may take (`observe_rows`)
        self._queued_seen = 0

    # ------------------------------------------------------------------ DecodePolicy

    def row_cap(self) -> int:
        """Most rows whose decode step takes at most `DECODE_SHARE` of the inter-token SLO
        (at least 1, at most `max_running`)."""
        budget = self.slo.itl_s * DECODE_SHARE
        lo, hi = 1, self.max_running
        while lo < hi:  # decode cost grows with rows: the largest that fits
            mid = (lo + hi + 1) // 2
            if self.costs.decode_s(mid) <= budget:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def capacity(self, decoder: _Core) -> int:
        """Free rows under `row_cap`, counting rows already waiting for prefill."""
        return max(0, self.row_cap() - decoder.running_rows - decoder.pending_rows)

    def observe_rows(self, now: float, rows: Iterable[tuple[int, float]]) -> None:
        """The running rows as of `now`: each one's tokens delivered and its first token's
        time. The next unit may take as long as every row can stall with its mean inter-token
        latency still within the objective even were its next token its last:
        `itl x tokens - (now - first)` for each (a row with no token yet counts as none)."""
        itl = self.slo.itl_s
        slack = [itl * n - (now - first) if n > 0 else 0.0 for n, first in rows]
        self.unit_allowance = max(0.0, min(slack, default=0.0))

    def chunk_cols(self, rows: int, running: int) -> int:
        """Prefill columns for a job of `rows` rows while `running` rows decode: what fits
        beside one decode step in the inter-token SLO, or in the stall the running rows can
        take (`observe_rows`), whichever is longer (at least `MIN_CHUNK`)."""
        budget = max(self.slo.itl_s, self.unit_allowance) - self.costs.decode_s(running)
        co = self.costs.prefill.coefficients
        d = self.costs.drift
        per_col = d * (co.b * rows)  # c (quadratic) is ignored: small at chunk sizes
        if per_col <= 0:
            return self.step_tokens
        cols = int((budget - d * co.a) / per_col)
        return max(MIN_CHUNK, cols)

    def next_unit(self, decoder: _Core, last: str | None) -> Unit | None:
        """Priced prefill chunks, each in one forward with the decode step where the runner
        can (else chunks and decode steps in turn); a prompt with nothing decoding is
        prefilled whole."""
        running = decoder.running_rows
        if decoder.jobs:
            job = decoder.jobs[0]
            mixed = bool(running) and decoder.mixer is not None and not job.alone
            if mixed or not running or last != "prefill":
                cols = job.remaining if not running else self.chunk_cols(job.rows, running)
                if job.max_cols is not None:
                    cols = min(cols, job.max_cols)
                kind: Literal["prefill", "mixed"] = "mixed" if mixed else "prefill"
                return Unit(kind, job, max(1, min(cols, job.remaining)))
        if running:
            return Unit("decode")
        return None

    # ------------------------------------------------------------------ prediction

    def predict_first_token(
        self,
        prompt_len: int,
        priority: int,
        queued: Iterable[Request],
        pending_tokens: int,
        rows: list[RunningRow],
        pending_rows: int,
        lane: int | None = None,
    ) -> float:
        """Seconds from now until a prompt of `prompt_len` tokens at `priority` gets its first
        token: the prefill tokens ahead of it (pending jobs, queued requests at its priority or
        above, and every request already queued in its own `lane`, which is FIFO whatever the
        levels) plus its own, in chunks interleaved with decode steps, after waiting for a free
        row when the batch is full."""
        ahead_tokens, ahead_rows, self._queued_seen = pending_tokens, pending_rows, 0
        for r in queued:
            self._queued_seen += 1
            if r.priority >= priority or (lane is not None and r.lane == lane):
                ahead_tokens += prefill_tokens(r)
                ahead_rows += 1
        cap = self.row_cap()
        running = len(rows)
        decode = self.costs.decode_s(min(running, cap))
        # Wait for a row: the k-th soonest a running row can end (each row's remaining tokens
        # as decode steps; the rows still ahead in the queue take a mean row's length each).
        wait = 0.0
        need = running + ahead_rows + 1 - cap
        if need > 0:
            left = sorted(r.remaining for r in rows) or [1]
            mean = sum(left) / len(left)
            if need <= len(left):
                steps = left[need - 1]
            else:
                rounds = math.ceil((need - len(left)) / cap)
                steps = int(left[-1] + rounds * mean)
            wait = steps * self.costs.decode_s(cap)
        tokens = ahead_tokens + prompt_len
        self._ahead = (wait, ahead_rows, ahead_tokens)
        if running == 0 and wait == 0.0:
            return self.costs.prefill_s(1, tokens)
        cols = self.chunk_cols(1, min(running, cap))
        chunks = math.ceil(tokens / max(cols, 1))
        return wait + chunks * (self.costs.prefill_s(1, min(cols, tokens)) + decode)

    def refusal(
        self,
        prompt_len: int,
        priority: int,
        waited: float,
        queued: Iterable[Request],
        pending_tokens: int,
        rows: list[RunningRow],
        pending_rows: int,
        *,
        now: float = 0.0,
        lane: int | None = None,
    ) -> LenbatchError | None:
        """The 429/503 (with Retry-After) for a request predicted to miss its TTFT objective
        even so, else None; `waited` is the time it has already spent since arrival, `now`
        the clock time for the decision log, `lane` the queue it will wait in (None: not
        known). Never refuses with shed mode `late`."""
        if self.shed_mode is ShedMode.LATE:
            return None
        due = self.slo.ttft(priority) - waited
        eta = self.predict_first_token(
            prompt_len, priority, queued, pending_tokens, rows, pending_rows, lane
        )
        if eta <= due * ADMIT_SHARE:
            return None
        self.refused += 1
        self._record(now, "admission", prompt_len, priority, due, self._ahead[0], eta, len(rows))
        return self.overloaded(eta - due, due, eta)

    def overdue(self, queued: Iterable[Request], now: float) -> list[Request]:
        """Queued requests that cannot reach their first token by their TTFT objective even
        if prefilled alone now (to be shed; none with shed mode `late`)."""
        if self.shed_mode is ShedMode.LATE:
            return []
        out = [
            r
            for r in queued
            if now + self.costs.prefill_s(1, prefill_tokens(r))
            > r.arrival + self.slo.ttft(r.priority)
        ]
        self.shed += len(out)
        self._queued_seen = 0
        self._ahead = (0.0, 0, 0)
        for r in out:
            due = r.arrival + self.slo.ttft(r.priority) - now
            self._record(now, "queue", r.length, r.priority, due, 0.0,
                         self.costs.prefill_s(1, prefill_tokens(r)), 0)  # fmt: skip
        return out

    def _record(
        self,
        now: float,
        where: str,
        length: int,
        priority: int,
        due: float,
        start: float,
        eta: float,
        running: int,
    ) -> None:
        """Log one refusal or shed with what was predicted (lengths and times only)."""
        wait, ahead_rows, _ = self._ahead
        co = self.costs.prefill.coefficients
        self.log.record(
            ShedDecision(
                at=now,
                where=where,
                length=length,
                inputs=1,
                lane=-1,  # admission prices the whole queue, not one lane
                priority=priority,
                due_in=due,
                start_in=start,
                finish_in=eta,
                running_s=wait,
                queued_s=max(0.0, eta - start - self.costs.prefill_s(1, length)),
                queue_ahead=ahead_rows,
                queued=self._queued_seen,
                inflight=running,
                cost_a_s=co.a,
                cost_b_s=co.b,
                cost_c_s=co.c,
                observed_batches=self.costs.prefill.observed + self.costs.decode.observed,
                drift=self.costs.drift,
                queue_drift=self.costs.drift,  # one drift scales all of a prompt's wait
            )
        )

    def overloaded(self, late_by: float, due: float, eta: float) -> LenbatchError:
        """The refusal: 429 or 503 per the shed mode, Retry-After the predicted excess (>= 1 s)."""
        retry = max(1.0, math.ceil(late_by))
        msg = (
            f"overloaded: first token predicted in {eta * 1000:.0f} ms, over the "
            f"{max(due, 0) * 1000:.0f} ms left of this request's TTFT objective"
        )
        if self.shed_mode is ShedMode.REJECT_503:
            return Unavailable(msg, retry_after=retry, code="overloaded")
        return Overloaded(msg, retry_after=retry, code="overloaded")

    def describe(self, now: float = 0.0) -> dict[str, Any]:
        """What `/stats` shows under `adaptive` (`now`: the clock, for the decision log)."""
        return {
            "ttft_slo_ms": [round(s * 1000, 1) for s in self.slo.ttft_s],
            "itl_slo_ms": round(self.slo.itl_s * 1000, 1),
            "row_cap": self.row_cap(),
            "unit_allowance_ms": round(self.unit_allowance * 1000, 1),
            "refused": self.refused,
            "shed_from_queue": self.shed,
            "costs": self.costs.describe(),
            "decisions": self.log.summary(now),
        }


class _Gen(Protocol):
    @property
    def done(self) -> bool: ...

    @property
    def params(self) -> Any: ...

    @property
    def generated(self) -> list[int]: ...


class _Job(Protocol):
    @property
    def gens(self) -> list[Any]: ...

    @property
    def rows(self) -> int: ...

    @property
    def remaining(self) -> int: ...


def door_state(rows: Iterable[_Gen], jobs: Iterable[_Job]) -> tuple[list[RunningRow], int, int]:
    """What admission reads from the decoder: the running rows' tokens left, the prefill tokens
    still to run and the rows they carry."""
    running = [
        RunningRow(max(1, g.params.max_tokens - len(g.generated))) for g in rows if not g.done
    ]
    pending_tokens = pending_rows = 0
    for job in jobs:
        pending_tokens += job.rows * job.remaining
        pending_rows += job.rows
    return running, pending_tokens, pending_rows


def delivered(rows: Iterable[Any]) -> list[tuple[int, float]]:
    """What `observe_rows` reads from the decoder's running generations: each one's tokens
    delivered so far and when its first one was (NaN before it)."""
    out = []
    for g in rows:
        if g.done:
            continue
        times = g.timings.token_times
        out.append((len(times), times[0] if times else math.nan))
    return out


def prefill_tokens(r: Request) -> int:
    """The prompt tokens `r` still has to prefill: its length less those its generation was
    told the prefix cache holds (`cached_tokens`: an estimate at the door, the match once it
    is a prefill job's); at least one."""
    return max(1, r.length - int(getattr(r.handle, "cached_tokens", 0) or 0))


def queued_requests(lanes: Iterable[Iterable[Request]]) -> list[Request]:
    """Every request waiting in the queues' lanes."""
    return [r for q in lanes for r in q]
