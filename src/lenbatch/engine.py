"""The engine: the one asyncio loop that admits, schedules, collates, runs and answers.

    submit ─► admission ─► queues ─► schedule() ─► collate ─► runner (worker thread) ─► futures

Every admitted input is a `Request` with one future; it is answered exactly once, with its
vector or an explicit error. The loop sleeps until new work arrives, a batch finishes, or the
scheduler's `wake_at`. Batches beyond the runner's concurrency are collated ahead of time
(prefetch) and wait for a runner slot; cancelled or expired members are dropped before they
cost compute. A failing batch is bisected so one poison input fails alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from enum import StrEnum

import numpy as np
import numpy.typing as npt

from lenbatch.admission import Admission
from lenbatch.buckets import BucketSet, default_boundaries
from lenbatch.clock import Clock, MonotonicClock
from lenbatch.collate import Collated, collate
from lenbatch.config import AdmissionConfig, BatchingConfig, SchedulerConfig, Strategy
from lenbatch.errors import (
    BadInput,
    DeadlineExceeded,
    InputTooLong,
    LenbatchError,
    ModelFailed,
    Unavailable,
)
from lenbatch.lengthlog import LengthLog
from lenbatch.metrics import Metrics
from lenbatch.queues import Queues
from lenbatch.request import Request, RequestStatus
from lenbatch.runners.base import EmbeddingRunner
from lenbatch.scheduler import Batch, schedule

__all__ = ["Engine", "EngineState"]

log = logging.getLogger("lenbatch.engine")

Vector = npt.NDArray[np.float32]


class EngineState(StrEnum):
    """Lifecycle of an engine."""

    NEW = "new"
    RUNNING = "running"
    DRAINING = "draining"
    STOPPED = "stopped"


@dataclass(slots=True)
class _Ticket:
    """The engine's handle on one request: its future and its deadline timer."""

    future: asyncio.Future[Vector]
    timer: asyncio.TimerHandle | None = None
    started: float | None = None  # clock time its batch started executing
    exec_s: float | None = None
    answered: bool = False  # counted, logged and metered exactly once


class Engine:
    """Length-aware dynamic batching in front of an `EmbeddingRunner`."""

    def __init__(
        self,
        runner: EmbeddingRunner,
        batching: BatchingConfig | None = None,
        admission: AdmissionConfig | None = None,
        *,
        clock: Clock | None = None,
        default_truncate: bool = False,
        length_log: LengthLog | None = None,
    ) -> None:
        self.runner = runner
        self.info = runner.info
        self.batching = batching or BatchingConfig()
        self.clock: Clock = clock or MonotonicClock()
        self.default_truncate = default_truncate
        self.length_log = length_log
        self.uses_default_boundaries = (
            self.batching.strategy is Strategy.BUCKETED and self.batching.boundaries is None
        )
        self.cfg: SchedulerConfig = self.batching.resolve(
            self.info.max_length, default_boundaries(self.info.max_length)
        )
        if self.cfg.strategy is Strategy.BUCKETED:
            labels = BucketSet(self.cfg.boundaries, self.info.max_length).labels()
        else:
            labels = ["all"]
        self.lane_labels = labels
        self.queues = Queues(self.cfg)
        self.metrics = Metrics(labels, self.cfg.strategy.value)
        self.admission = Admission(admission or AdmissionConfig(), self.cfg, self.clock.now())
        self.request_timeout = (admission or AdmissionConfig()).request_timeout_s
        self.state = EngineState.NEW
        self._executor = ThreadPoolExecutor(
            max_workers=self.batching.max_concurrent_batches, thread_name_prefix="lenbatch-runner"
        )
        self._wakeup: asyncio.Event | None = None
        self._slots: asyncio.Semaphore | None = None
        self._loop_task: asyncio.Task[None] | None = None
        self._batch_tasks: set[asyncio.Task[None]] = set()
        self._outstanding = 0  # admitted requests not yet answered

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Start the scheduling loop on the running event loop."""
        if self.state is not EngineState.NEW:
            raise RuntimeError(f"engine already {self.state.value}")
        self._wakeup = asyncio.Event()
        self._slots = asyncio.Semaphore(self.batching.max_concurrent_batches)
        self.state = EngineState.RUNNING
        self._loop_task = asyncio.create_task(self._loop(), name="lenbatch-engine")
        mem = self.runner.memory()
        self.metrics.set_memory(mem.weights, mem.peak_activations, mem.device)

    async def stop(self, timeout: float | None = 30.0) -> None:
        """Stop accepting, let queued and running requests finish for up to `timeout` seconds,
        then answer whatever is left with an error. Nothing admitted is dropped silently."""
        if self.state in (EngineState.NEW, EngineState.STOPPED):
            self.state = EngineState.STOPPED
            self._executor.shutdown(wait=False)
            return
        self.state = EngineState.DRAINING
        # Drain promptly: nobody will join these batches any more.
        self.cfg = dataclasses.replace(
            self.cfg, lanes=tuple(dataclasses.replace(p, max_wait=0.0) for p in self.cfg.lanes)
        )
        self._kick()
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._outstanding > 0 and (deadline is None or time.monotonic() < deadline):
            await asyncio.sleep(0.01)
        leftover = self.queues.drain()
        for r in leftover:
            self._fail(r, Unavailable(f"server shut down; drain timeout of {timeout} s passed"))
        for task in list(self._batch_tasks):
            task.cancel()
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        self.state = EngineState.STOPPED
        self._executor.shutdown(wait=False)
        if self.length_log is not None:
            self.length_log.close()

    @property
    def ready(self) -> bool:
        """True while the engine accepts work."""
        return self.state is EngineState.RUNNING

    # ------------------------------------------------------------------ submitting

    def tokenize(self, texts: Sequence[str], truncate: bool | None = None) -> list[list[int]]:
        """Token ids of `texts` (the caller drops the text afterwards)."""
        return self.runner.tokenize(texts, self.default_truncate if truncate is None else truncate)

    async def embed(
        self,
        inputs: Sequence[Sequence[int]],
        *,
        truncate: bool | None = None,
        timeout: float | None = None,
        priority: int = 0,
    ) -> list[Vector]:
        """Embed each token-id sequence; returns one vector per input, in order.

        Raises a `LenbatchError` (bad input, too long, overloaded, deadline, model failure);
        if the caller is cancelled, its requests leave the queue before they cost compute.
        """
        if self.state is not EngineState.RUNNING:
            raise Unavailable(f"server is {self.state.value}; not accepting requests")
        if not inputs:
            raise BadInput("no inputs given")
        assert self._wakeup is not None
        truncate = self.default_truncate if truncate is None else truncate
        limit = self.info.max_length
        seqs: list[list[int]] = []
        for i, ids in enumerate(inputs):
            if len(ids) == 0:
                raise BadInput(f"input {i} is empty (0 tokens)")
            if len(ids) > limit:
                if not truncate:
                    self.metrics.record_rejection("too_long")
                    raise InputTooLong(
                        f"input {i} has {len(ids)} tokens; the model's limit is {limit}. "
                        "Shorten it or send truncate=true"
                    )
                ids = ids[:limit]
            seqs.append(list(ids))
        now = self.clock.now()
        refusal = self.admission.check([len(s) for s in seqs], self.queues, now)
        if refusal is not None:
            self.metrics.record_rejection(refusal.code)
            raise refusal
        timeout = timeout if timeout is not None else self.request_timeout
        deadline = None if timeout is None else now + timeout
        loop = asyncio.get_running_loop()
        requests = []
        for ids in seqs:
            ticket = _Ticket(loop.create_future())
            r = Request(len(ids), now, ids, deadline=deadline, priority=priority, handle=ticket)
            if timeout is not None:
                ticket.timer = loop.call_later(timeout, self._on_deadline, r)
            self.queues.push(r)
            requests.append(r)
        self._outstanding += len(requests)
        self._kick()
        try:
            return list(await asyncio.gather(*(r.handle.future for r in requests)))
        finally:
            # On error or cancellation (gather cancels the futures itself): nobody wants the
            # unanswered siblings any more; take them out of the queue.
            for r in requests:
                if not r.handle.answered:
                    self._cancel(r)

    # ------------------------------------------------------------------ the loop

    def _kick(self) -> None:
        if self._wakeup is not None:
            self._wakeup.set()

    async def _loop(self) -> None:
        assert self._wakeup is not None
        loop = asyncio.get_running_loop()
        while True:
            self._wakeup.clear()
            decision = schedule(self.queues, self.clock.now(), self.cfg)
            for r in decision.expired:
                self._fail(r, self._expired_error(r))
            for batch in decision.batches:
                task = asyncio.create_task(self._run_batch(batch))
                self._batch_tasks.add(task)
                task.add_done_callback(self._batch_tasks.discard)
            self.metrics.set_depths(self.queues.depths(), self.queues.inflight_total)
            timer = None
            if decision.wake_at is not None:
                delay = max(0.0, decision.wake_at - self.clock.now())
                timer = loop.call_later(delay, self._wakeup.set)
            await self._wakeup.wait()
            if timer is not None:
                timer.cancel()

    async def _run_batch(self, batch: Batch) -> None:
        assert self._slots is not None
        pad_to = self.cfg.lanes[batch.lane].pad_to
        try:
            # Prepared while an earlier batch may still be running (prefetch).
            prepared = self._collate(batch.requests, pad_to)
            async with self._slots:
                now = self.clock.now()
                live = []
                for r in batch.requests:
                    if r.handle.future.done():
                        continue  # cancelled while waiting: costs nothing
                    if r.deadline is not None and r.deadline <= now:
                        self._fail(r, self._expired_error(r))
                        continue
                    live.append(r)
                if not live:
                    return
                if len(live) != len(batch.requests):
                    prepared = self._collate(live, pad_to)
                await self._execute(batch.lane, live, prepared, pad_to)
        except Exception:  # a bug above the runner: never leave a request hanging
            log.exception("bug: batch of lane %s failed outside the runner", batch.lane)
            for r in batch.requests:
                self._fail(r, ModelFailed("internal error while running this batch"))
        finally:
            self.queues.batch_done(batch.lane)
            self._kick()

    def _collate(self, requests: Sequence[Request], pad_to: int | None) -> Collated:
        return collate(
            [r.token_ids or [] for r in requests],
            self.info.pad_token_id,
            self.info.padding_side,
            pad_to=pad_to,
            position_ids=self.info.needs_position_ids,
        )

    async def _execute(
        self, lane: int, live: list[Request], batch: Collated, pad_to: int | None
    ) -> None:
        loop = asyncio.get_running_loop()
        start = self.clock.now()
        for r in live:
            r.handle.started = start
        try:
            out = await loop.run_in_executor(self._executor, self.runner.embed, batch)
        except Exception as exc:
            await self._on_batch_error(lane, live, pad_to, exc)
            return
        end = self.clock.now()
        if out.shape[0] != len(live):
            raise RuntimeError(f"bug: runner returned {out.shape[0]} rows for {len(live)} inputs")
        exec_s = end - start
        self.metrics.record_batch(
            lane,
            len(live),
            batch.real_tokens,
            batch.padded_tokens,
            exec_s,
            [start - r.arrival for r in live],
        )
        log.debug(
            "batch lane=%s size=%d padded_len=%d real=%d exec_ms=%.1f",
            self.lane_labels[lane],
            len(live),
            batch.input_ids.shape[1],
            batch.real_tokens,
            exec_s * 1000,
        )
        for r, vec in zip(live, out, strict=True):
            r.handle.exec_s = exec_s
            self._answer(r, vec)

    async def _on_batch_error(
        self, lane: int, live: list[Request], pad_to: int | None, exc: Exception
    ) -> None:
        """Bisect a failing batch so a poison input fails alone and the rest succeed."""
        if len(live) == 1:
            r = live[0]
            log.warning(
                "model failed on request %s (length %d): %s", r.id, r.length, type(exc).__name__
            )
            msg = f"the model failed on this input ({type(exc).__name__}); others are unaffected"
            self._fail(r, ModelFailed(msg))
            return
        log.warning("batch of %d failed (%s); bisecting", len(live), type(exc).__name__)
        mid = len(live) // 2
        for half in (live[:mid], live[mid:]):
            half = [r for r in half if not r.handle.future.done()]
            if half:
                await self._execute(lane, half, self._collate(half, pad_to), pad_to)

    # ------------------------------------------------------------------ answering

    def _answer(self, r: Request, vec: Vector) -> None:
        t: _Ticket = r.handle
        if t.answered:
            return
        if t.future.done():  # cancelled by its caller while it ran
            self._finish(r, RequestStatus.CANCELLED)
            return
        t.future.set_result(vec)
        self._finish(r, RequestStatus.OK)

    def _fail(self, r: Request, err: LenbatchError) -> None:
        t: _Ticket = r.handle
        if t.answered:
            return
        if t.future.done():  # cancelled by its caller
            self._finish(r, RequestStatus.CANCELLED)
            return
        t.future.set_exception(err)
        # Retrieved by gather; if the caller has gone, do not warn about it.
        t.future.add_done_callback(_consume_exception)
        status = RequestStatus.EXPIRED if isinstance(err, DeadlineExceeded) else RequestStatus.ERROR
        self._finish(r, status)

    def _cancel(self, r: Request) -> None:
        t: _Ticket = r.handle
        self.queues.remove(r)
        if not t.answered:
            t.future.cancel()
            self._finish(r, RequestStatus.CANCELLED)
            self._kick()

    def _finish(self, r: Request, status: RequestStatus) -> None:
        t: _Ticket = r.handle
        t.answered = True
        if t.timer is not None:
            t.timer.cancel()
        self._outstanding -= 1
        now = self.clock.now()
        latency = now - r.arrival
        self.metrics.record_request(r.lane, latency, status.value)
        if self.length_log is not None:
            wait = None if t.started is None else (t.started - r.arrival) * 1000
            self.length_log.write(
                id=r.id,
                arrival=time.time() - latency,
                length=r.length,
                bucket=self.lane_labels[r.lane] if r.lane >= 0 else "none",
                queue_wait_ms=wait,
                exec_ms=None if t.exec_s is None else t.exec_s * 1000,
                status=status.value,
            )

    def _on_deadline(self, r: Request) -> None:
        t: _Ticket = r.handle
        if t.answered or t.started is not None:
            return  # answered, or already running: let it finish
        self.queues.remove(r)
        self._fail(r, self._expired_error(r))
        self._kick()

    def _expired_error(self, r: Request) -> DeadlineExceeded:
        assert r.deadline is not None
        waited = self.clock.now() - r.arrival
        return DeadlineExceeded(
            f"deadline of {r.deadline - r.arrival:.3f} s passed after {waited:.3f} s in the queue"
        )


def _consume_exception(fut: asyncio.Future[Vector]) -> None:
    if not fut.cancelled():
        fut.exception()
