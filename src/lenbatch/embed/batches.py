"""How one scheduled batch runs, and how a model failure is kept to the inputs that caused it.

`BatchRunner.run` collates a batch as soon as the scheduler emits it (prefetch): padded to its
longest member, or packed end to end when the runner runs padding-free batches
(`PackedEmbeddingRunner`, e.g. `runners.packed`); then it waits for one of its runner slots,
drops members cancelled or expired meanwhile (they cost nothing) and runs the rest in a worker
thread. It knows nothing of the engine that owns the requests: what it needs to ask mid-run
(has the runner been declared failed? is this request still wanted?) comes in as callables, and
what happens comes out as plain data, one event at a time (`BatchEvent`), for the engine to
apply through its ledger, metrics, batch caps and cost model. Events are yielded as they
happen, so each model call's requests are answered as soon as that call returns, not when a
bisection ends.

When the model fails:

* a batch that raises is bisected, so a poison input fails alone (500 `model_error`) and the
  rest of its batch succeeds;
* a batch that runs out of memory (`MemoryError`, torch's `OutOfMemoryError`) is split and the
  halves retried, and its lane's batch cap is to be halved for a cool-down (`Failed` with kind
  `oom`); an input that runs out of memory alone is answered 503 `out_of_memory`;
* a runner that raises `RunnerCrashed`, that keeps failing and then fails a known-good probe
  input, or whose batch runs past `batch_timeout_s`, is reported crashed (`Crashed`): the engine
  turns not-ready and answers every waiting request 503.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncGenerator, Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from lenbatch.config import RecoveryConfig
from lenbatch.core.batch import Batch
from lenbatch.core.clock import Clock
from lenbatch.core.collate import Collated, Packed, Rows, collate, pack
from lenbatch.core.errors import (
    LenbatchError,
    ModelFailed,
    OutOfMemory,
    RunnerCrashed,
    is_out_of_memory,
)
from lenbatch.core.request import Request
from lenbatch.runners.base import EmbeddingRunner, ModelInfo, PackedEmbeddingRunner
from lenbatch.serving.budget import ComputeBudget, Turn
from lenbatch.serving.workers import run_in_worker

__all__ = [
    "BatchEvent",
    "BatchRunner",
    "Crashed",
    "Expired",
    "Failed",
    "Prepared",
    "Refused",
    "Returned",
    "Started",
]

Prepared = Collated | Packed  # a batch ready for the runner: padded or packed

log = logging.getLogger("lenbatch.embed.batches")

_PROBE_TEXT = "lenbatch probe"  # a fixed, known-good input for checking a failing runner


def _due(r: Request[Any]) -> float:
    """When a request is due, for the CPU budget's order: its SLO time (`adaptive`), else its
    deadline, else its arrival (first come, first served)."""
    if r.due is not None:
        return r.due
    return r.deadline if r.deadline is not None else r.arrival


# ---------------------------------------------------------------------- what a batch comes to


@dataclass(frozen=True, slots=True)
class Expired:
    """Members whose deadline passed while they waited for a runner slot: they never ran."""

    requests: list[Request[Any]]


@dataclass(frozen=True, slots=True)
class Refused:
    """Members that cannot run: the runner had been declared failed before their turn."""

    requests: list[Request[Any]]


@dataclass(frozen=True, slots=True)
class Started:
    """A model call begins on `requests` at clock time `at`: from now on they are running."""

    requests: list[Request[Any]]
    at: float


@dataclass(frozen=True, slots=True)
class Returned:
    """A model call returned: one vector per request, in order, and the call's figures."""

    lane: int
    requests: list[Request[Any]]
    vectors: npt.NDArray[np.float32]
    started: float  # clock time the call began
    exec_s: float  # seconds it took
    real_tokens: int
    padded_tokens: int  # tokens the model computed (a packed batch computes its real ones)
    width: int  # the longest row, as the runner saw it
    packed: bool

    @property
    def size(self) -> int:
        """Requests in the call."""
        return len(self.requests)

    @property
    def queue_waits(self) -> list[float]:
        """Seconds each request waited from arrival until the call began."""
        return [self.started - r.arrival for r in self.requests]


@dataclass(frozen=True, slots=True)
class Failed:
    """A model call of `size` requests failed: out of memory (`oom`: the lane's batch cap is
    to be lowered below `size`) or an error. `errors` are the requests that failed alone, with
    the error each earns; a larger call is split and its halves' events follow."""

    lane: int
    kind: Literal["oom", "error"]
    size: int
    width: int
    errors: list[tuple[Request[Any], LenbatchError]]


@dataclass(frozen=True, slots=True)
class Crashed:
    """The runner is unusable (`reason`, safe to show): every waiting request is answered 503,
    `requests` (the call in flight) among them."""

    lane: int
    reason: str
    requests: list[Request[Any]]


BatchEvent = Expired | Refused | Started | Returned | Failed | Crashed
"""What running a batch comes to, in the order it happens."""


# ---------------------------------------------------------------------- the runner's side


class BatchRunner:
    """Runs batches on one `EmbeddingRunner`, `slots` at a time, isolating failures."""

    def __init__(
        self,
        runner: EmbeddingRunner,
        info: ModelInfo,
        executor: Executor,
        slots: int,
        recovery: RecoveryConfig,
        clock: Clock,
    ) -> None:
        self.runner = runner
        self.info = info
        self.executor = executor
        self.slots = asyncio.Semaphore(slots)
        self.recovery = recovery
        self.clock = clock
        self.failures_in_row = 0  # failed model calls (not out-of-memory) since a success
        self.packed_runner = runner if isinstance(runner, PackedEmbeddingRunner) else None
        # Several models in one process: the CPU budget their model calls take turns on.
        self.budget: ComputeBudget | None = None
        self.budget_owner = info.name  # whose share its turns count to
        self._turn = threading.local()  # the turn of the call a worker thread is running

    @property
    def pausable(self) -> bool:
        """Whether the runner's forward offers pause points between layers (`between_layers`),
        where a call gives its budget turn back to a waiter that outranks it."""
        return hasattr(self.runner, "between_layers")

    def use_budget(self, budget: ComputeBudget, owner: str) -> None:
        """Take turns on `budget` for each model call, counted to `owner`'s share; a runner
        with pause points pauses its call there when another model's waiter outranks it."""
        self.budget = budget
        self.budget_owner = owner
        if self.pausable:
            self.runner.between_layers = self._pause_point  # type: ignore[attr-defined]

    def _pause_point(self) -> None:
        """(Worker thread, between two layers) give the turn back if asked, wait to resume."""
        turn: Turn | None = getattr(self._turn, "turn", None)
        if turn is not None and self.budget is not None:
            self.budget.pause_point(turn)

    async def run(
        self,
        batch: Batch,
        pad_to: int | None,
        *,
        failed: Callable[[], bool],
        wanted: Callable[[Request[Any]], bool],
    ) -> AsyncGenerator[BatchEvent, None]:
        """Run `batch` once a runner slot is free; yields what happens as it happens.

        `failed()` says whether the runner has been declared failed (then nothing more runs);
        `wanted(r)` whether request `r` still awaits its answer (not cancelled, not ended).
        """
        async with self.slots:
            if failed():
                yield Refused(list(batch.requests))
                return
            now = self.clock.now()
            live, expired = [], []
            for r in batch.requests:
                if not wanted(r):
                    continue  # cancelled or expired while waiting: costs nothing
                if r.deadline is not None and r.deadline <= now:
                    expired.append(r)
                else:
                    live.append(r)
            if expired:
                yield Expired(expired)
            if not live:
                return
            rows = self.collate(live, pad_to)
            async for event in self._call(batch.lane, live, rows, pad_to, failed, wanted):
                yield event

    async def warm(self, seqs: Sequence[Sequence[int]], pad_to: int | None) -> None:
        """Run token-id lists as one batch in a runner slot, the vectors discarded: the
        engine's warm-up (`embed/warmup.py`) before it serves."""
        rows = [list(x) for x in seqs]
        lengths = tuple(len(x) for x in rows)
        batch = Rows(rows, None, pad_to, self.packed_runner is not None, lengths)
        async with self.slots:
            await run_in_worker(self.executor, self._model_call, batch)

    def collate(self, requests: Sequence[Request[Any]], pad_to: int | None) -> Rows:
        """The batch of `requests` as the runner will take it (laid out in the worker thread,
        `Rows`): packed if it runs padding-free (then a lane's fixed length means nothing: a
        packed batch computes its real tokens only), else padded (to `pad_to` if the lane
        fixes a length). A pair's segment ids go with its tokens."""
        seqs = [r.token_ids or [] for r in requests]
        types = [r.token_type_ids for r in requests]
        segments = types if any(t is not None for t in types) else None
        lengths = tuple(len(x) for x in seqs)
        return Rows(seqs, segments, pad_to, self.packed_runner is not None, lengths)

    def _lay_out(self, rows: Rows) -> Prepared:
        """(Worker thread) `rows` as the runner takes them: packed, or padded."""
        if rows.packed:
            return pack(rows.seqs, rows.segments)
        return self.pad(rows.seqs, rows.pad_to, rows.segments)

    def pad(
        self,
        seqs: Sequence[Sequence[int]],
        pad_to: int | None,
        segments: Sequence[Sequence[int] | None] | None = None,
    ) -> Collated:
        """Token-id lists (and their segment ids, if any) padded for the model."""
        i = self.info
        return collate(
            seqs,
            i.pad_token_id,
            i.padding_side,
            pad_to=pad_to,
            position_ids=i.needs_position_ids,
            segments=segments,
        )

    def _model_call(
        self, batch: Prepared | Rows, turn: Turn | None = None
    ) -> npt.NDArray[np.float32]:
        """Run one batch on the runner (in a worker thread), on budget `turn`."""
        self._turn.turn = turn
        try:
            if isinstance(batch, Rows):
                batch = self._lay_out(batch)
            if isinstance(batch, Packed):
                assert self.packed_runner is not None
                return self.packed_runner.embed_packed(batch)
            return self.runner.embed(batch)
        finally:
            self._turn.turn = None

    async def _call(
        self,
        lane: int,
        live: list[Request[Any]],
        batch: Rows,
        pad_to: int | None,
        failed: Callable[[], bool],
        wanted: Callable[[Request[Any]], bool],
    ) -> AsyncGenerator[BatchEvent, None]:
        """One model call on `live`, then what its failure leads to (split, bisect, crash)."""
        budget = self.budget
        turn = None
        if budget is not None:
            prio, due = max(r.priority for r in live), min(map(_due, live))
            turn = await budget.acquire(prio, due, self.budget_owner, self.pausable)
        error: BaseException | None = None
        try:
            start = self.clock.now()
            yield Started(live, start)
            running = run_in_worker(self.executor, self._model_call, batch, turn)
            limit = self.recovery.batch_timeout_s
            if limit is not None and not await self._within(running, limit, turn):
                yield Crashed(lane, f"a batch of {len(live)} ran longer than {limit:g} s", live)
                return
            try:
                out = await running
            except asyncio.CancelledError:
                raise
            except BaseException as exc:  # whatever the model raises, every request is answered
                error = exc
        finally:
            if budget is not None and turn is not None:
                budget.release(turn)  # before a split's halves ask for their own turns
        if error is not None:
            events, split = await self._on_error(lane, live, batch.width, error)
            for event in events:
                yield event
            if not split:
                return
            mid = len(live) // 2
            for half in (live[:mid], live[mid:]):
                half = [r for r in half if wanted(r)]  # the first half's run may have taken
                if not half:
                    continue
                if failed():
                    yield Refused(half)
                    continue
                again = self._call(lane, half, self.collate(half, pad_to), pad_to, failed, wanted)
                async for event in again:
                    yield event
            return
        # A call paused for another model's turn took its pauses' seconds less (cost model).
        end = self.clock.now() - (turn.paused_s if turn is not None else 0.0)
        if out.shape[0] != len(live):
            raise RuntimeError(f"bug: runner returned {out.shape[0]} rows for {len(live)} inputs")
        self.failures_in_row = 0
        yield Returned(
            lane,
            live,
            out,
            start,
            end - start,
            batch.real_tokens,
            batch.padded_tokens,
            batch.width,
            batch.packed,
        )

    async def _within(self, running: asyncio.Future[Any], limit: float, turn: Turn | None) -> bool:
        """Whether `running` ends within `limit` seconds of work: time it spent paused for
        another model's turn does not count."""
        start = self.clock.now()
        left = limit
        while not (await asyncio.wait({running}, timeout=left))[0]:
            now = self.clock.now()
            budget = self.budget
            paused = turn.paused_until(budget.clock()) if turn and budget else 0.0
            left = limit - (now - start - paused)
            if left <= 0:
                return False
        return True

    # ------------------------------------------------------------------ when the model fails

    async def _on_error(
        self, lane: int, live: list[Request[Any]], width: int, exc: BaseException
    ) -> tuple[list[BatchEvent], bool]:
        """What a failed call comes to, and whether its halves are to run next (a split on
        out-of-memory, a bisection on an error; a crash ends it). Only the exception's type is
        logged: its message may quote the input."""
        kind = type(exc).__name__
        if isinstance(exc, RunnerCrashed) or not isinstance(exc, Exception):
            return [Crashed(lane, f"the runner raised {kind}", live)], False
        if is_out_of_memory(exc):
            if len(live) > 1:
                return [Failed(lane, "oom", len(live), width, [])], True
            r = live[0]
            log.warning("out of memory on request %s alone (%d tokens)", r.id, r.length)
            msg = (
                f"out of memory running this input alone ({r.length} tokens, padded to "
                f"{width}); retry later or send a shorter input"
            )
            err = OutOfMemory(msg, retry_after=max(1.0, self.recovery.oom_cooldown_s))
            return [Failed(lane, "oom", 1, width, [(r, err)])], False
        self.failures_in_row += 1
        if self.failures_in_row >= self.recovery.probe_after_failures:
            if not await self._probe_ok():
                reason = (
                    f"{self.failures_in_row} model calls failed in a row ({kind}) and a "
                    "known-good probe input failed too"
                )
                return [
                    Failed(lane, "error", len(live), width, []),
                    Crashed(lane, reason, live),
                ], False
            self.failures_in_row = 0
        if len(live) > 1:
            log.warning("batch of %d failed (%s); bisecting", len(live), kind)
            return [Failed(lane, "error", len(live), width, [])], True
        r = live[0]
        log.warning("model failed on request %s (%d tokens): %s", r.id, r.length, kind)
        msg = f"the model failed on this input ({kind}); other inputs are unaffected"
        return [Failed(lane, "error", 1, width, [(r, ModelFailed(msg))])], False

    async def _probe_ok(self) -> bool:
        """Run one fixed, known-good input: does the runner still work at all?"""
        ids = self.runner.tokenize([_PROBE_TEXT], True)[0]
        probe = self.pad([ids], None)
        try:
            await asyncio.get_running_loop().run_in_executor(
                self.executor, self.runner.embed, probe
            )
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            log.error("probe input failed too (%s)", type(exc).__name__)
            return False
        log.info("probe input succeeded: the failures were the inputs', not the runner's")
        return True
