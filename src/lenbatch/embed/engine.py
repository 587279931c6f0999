"""The engine: the one asyncio loop that admits, schedules, collates, runs and answers.

    submit ─► tokenize (thread) ─► admission ─► queues ─► schedule() ─► collate ─►
        runner (thread) ─► futures

Every admitted input is a `Request` with one future; it is answered exactly once, with its
vector or an explicit error, through the `Ledger`. The loop sleeps until new work arrives, a
batch finishes, or the scheduler's `wake_at`. Batches beyond the runner's concurrency are
collated ahead of time (prefetch) and wait for a runner slot; cancelled or expired members are
dropped before they cost compute.

When the model fails, `BatchRunner` (`embed/batches.py`) isolates the failure: a poison input
fails alone, an out-of-memory batch is split, a crashed runner turns the engine not-ready.

Shutdown: `begin_drain()` refuses new requests (503) and flushes the queues without waiting for
batches to fill; `stop()` waits for every admitted request up to a timeout and answers whatever
is left with 503. Nothing admitted is dropped silently.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from lenbatch.config import (
    AdaptiveConfig,
    AdmissionConfig,
    BatchingConfig,
    RecoveryConfig,
    Strategy,
)
from lenbatch.core.adaptive import AdaptiveState, build_state
from lenbatch.core.batch import Batch
from lenbatch.core.clock import Clock
from lenbatch.core.costfit import CostCoefficients
from lenbatch.core.errors import (
    BadInput,
    LenbatchError,
)
from lenbatch.core.lanes import resolve_lanes
from lenbatch.core.recovery import BatchCaps
from lenbatch.core.refit import BoundarySwap, Fitter, Refitter, build_refitter, optimal_bounds
from lenbatch.core.request import Request
from lenbatch.core.scheduler import schedule
from lenbatch.embed.batches import BatchRunner
from lenbatch.embed.inputs import Inputs, token_ids, tokenize_checked
from lenbatch.runners.base import EmbeddingRunner
from lenbatch.serving.engine import BaseEngine
from lenbatch.serving.ledger import FutureReply, Ticket
from lenbatch.serving.lengthlog import LengthLog
from lenbatch.serving.lifecycle import EngineState
from lenbatch.serving.messages import Embedded, Vector

__all__ = ["Embedded", "Engine", "EngineState", "Inputs"]

log = logging.getLogger("lenbatch.embed.engine")

_TOKENIZE_THREADS = 2  # one long input tokenizing leaves a thread for everyone else


class Engine(BaseEngine[Vector]):
    """Length-aware dynamic batching in front of an `EmbeddingRunner`."""

    def __init__(
        self,
        runner: EmbeddingRunner,
        batching: BatchingConfig | None = None,
        admission: AdmissionConfig | None = None,
        *,
        recovery: RecoveryConfig | None = None,
        clock: Clock | None = None,
        default_truncate: bool = False,
        length_log: LengthLog | None = None,
        adaptive: AdaptiveConfig | None = None,
        cost_prior: CostCoefficients | None = None,
        fitter: Fitter | None = None,
    ) -> None:
        self.runner = runner
        self.info = runner.info
        self.batching = batching or BatchingConfig()
        self.recovery = recovery or RecoveryConfig()
        self.default_truncate = default_truncate
        lanes = resolve_lanes(self.batching, self.info.max_length)
        super().__init__(
            lanes,
            admission,
            clock,
            metrics_label=lanes.cfg.strategy.value,
            workers=self.batching.max_concurrent_batches,
            name="lenbatch-runner",
            length_log=length_log,
        )
        self.caps = BatchCaps(lanes.cfg, self.recovery.oom_cooldown_s)
        self.metrics.set_batch_caps(self.caps.caps())
        self.batches = BatchRunner(self, self._executor, self.batching.max_concurrent_batches)
        # Tokenization runs here, never on the event loop: HF fast tokenizers release the GIL,
        # so a huge input tokenizing in one thread holds up neither the loop nor a small
        # request tokenizing in the other.
        self._tokenize_pool = ThreadPoolExecutor(
            max_workers=_TOKENIZE_THREADS, thread_name_prefix="lenbatch-tokenize"
        )
        self._batch_tasks: set[asyncio.Task[None]] = set()
        ac = adaptive or AdaptiveConfig()
        self.priority_levels = ac.priority_levels
        # strategy adaptive: what it learns (cost model, arrival rates) lives here, the
        # decisions are `core.adaptive`'s. Raises ValueError for an SLO no batch can meet.
        self.adaptive: AdaptiveState | None = None
        if lanes.cfg.strategy is Strategy.ADAPTIVE:
            self.adaptive = build_state(
                ac,
                cost_prior,
                lanes.cfg,
                longest=self.admission.longest_admissible(),
                concurrency=self.batching.max_concurrent_batches,
            )
        # Online re-fit of the boundaries (adaptive; always on with boundaries = "auto").
        self.refitter: Refitter | None = None
        self._swap: BoundarySwap | None = None
        if self.adaptive is not None and (ac.refit or self.batching.auto_boundaries):
            co = self.adaptive.cost.coefficients
            self.refitter = build_refitter(
                ac, self.info.max_length, co.a, co.b, fitter or optimal_bounds
            )
            self._swap = BoundarySwap(self.refitter)

    # ------------------------------------------------------------------ lifecycle hooks

    def _on_drain(self) -> None:
        if self.adaptive is not None:
            self.adaptive.draining = True  # nobody will join partial batches any more
        self.apply_caps()

    def _release(self) -> None:
        for task in list(self._batch_tasks):
            task.cancel()  # their requests are all answered by now
        self._tokenize_pool.shutdown(wait=False)
        super()._release()

    def refresh_memory(self) -> None:
        """Weights apart from peak activations, read from the runner into the metrics."""
        mem = self.runner.memory()
        self.metrics.set_memory(mem.weights, mem.peak_activations, mem.device)

    def _extra_stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "batch_caps": self.caps.describe(self.clock.now(), self.lane_labels),
            "priority_levels": self.priority_levels,
        }
        if self.adaptive is not None:
            out["adaptive"] = self.adaptive.describe(self.lane_labels, self.clock.now())
        if self.refitter is not None:
            out["refit"] = self.refitter.describe()
        return out

    def prometheus(self) -> bytes:
        """Prometheus exposition (adaptive's gauges are read first, so the scrape shows them)."""
        if self.adaptive is not None:
            self.metrics.set_adaptive(self.adaptive.describe(self.lane_labels, self.clock.now()))
        return super().prometheus()

    # ------------------------------------------------------------------ submitting

    def tokenize(self, texts: Sequence[str], truncate: bool | None = None) -> list[list[int]]:
        """Token ids of `texts` (the caller drops the text afterwards).

        Raises `BadInput` for an empty text, one that is not valid Unicode, or one the
        tokenizer cannot process (the error names the input's index, never its content).
        """
        truncate = self.default_truncate if truncate is None else truncate
        return tokenize_checked(self.runner.tokenize, texts, truncate)

    def _token_ids(self, inputs: Inputs, truncate: bool | None) -> list[list[int]]:
        """Texts tokenized, token arrays checked against the vocabulary; none may be empty."""
        return token_ids(inputs, lambda texts: self.tokenize(texts, truncate), self.info.vocab_size)

    async def embed(
        self,
        inputs: Inputs,
        *,
        truncate: bool | None = None,
        timeout: float | None = None,
        priority: int = 0,
    ) -> list[Vector]:
        """Embed each input (a text, or a token-id array); one vector per input, in order.

        Raises a `LenbatchError` (bad input, too long, overloaded, deadline, model failure,
        unavailable); with several inputs its message starts with the failing input's index.
        If the caller is cancelled, its requests leave the queue before they cost compute.
        """
        done = await self.embed_with_usage(
            inputs, truncate=truncate, timeout=timeout, priority=priority
        )
        return done.vectors

    async def embed_with_usage(
        self,
        inputs: Inputs,
        *,
        truncate: bool | None = None,
        timeout: float | None = None,
        priority: int = 0,
    ) -> Embedded:
        """`embed`, also counting the tokens embedded (OpenAI's `usage.prompt_tokens`).

        The one path from a call's inputs to its answer: tokenize (texts), check the
        vocabulary (token arrays), truncate if asked, admit (length, budget, queue and rate
        limits), queue, and wait for every vector.
        """
        if self.state is not EngineState.RUNNING:
            raise self.refusal()
        if isinstance(priority, bool) or not 0 <= priority < self.priority_levels:
            allowed = (
                "0 (this server has one priority level: start it with --priority-levels N for more)"
                if self.priority_levels == 1
                else f"an integer in [0, {self.priority_levels - 1}] (higher runs first)"
            )
            raise BadInput(f"priority must be {allowed}; got {priority!r}", code="invalid_priority")
        loop = asyncio.get_running_loop()
        if inputs and isinstance(inputs[0], str):
            # One batch-encode call per request, in a worker thread (see __init__).
            ids = await loop.run_in_executor(self._tokenize_pool, self._token_ids, inputs, truncate)
            if self.state is not EngineState.RUNNING:
                raise self.refusal()  # drained while this request was tokenizing
        else:
            ids = self._token_ids(inputs, truncate)  # token arrays: only a range check
        truncate = self.default_truncate if truncate is None else truncate
        limit = self.info.max_length
        # Too long for the model: cut here if asked; otherwise admission refuses it (413).
        seqs = [x[:limit] for x in ids] if truncate else ids
        now = self.clock.now()
        refusal = self.admission.check([len(s) for s in seqs], self.queues, now)
        if refusal is not None:
            self.metrics.record_rejection(refusal.code)
            raise refusal
        timeout = timeout if timeout is not None else self.request_timeout
        deadline = None if timeout is None else now + timeout
        ad = self.adaptive
        due = None
        if ad is not None:
            due = ad.due_of(now, priority, timeout)
            shed = ad.admit([len(s) for s in seqs], due, self.queues, self.cfg, now)
            if shed is not None:
                self.metrics.record_rejection(shed.code)
                self.metrics.record_shed("admission")
                raise shed
        requests: list[Request[Ticket[Vector]]] = []
        for x in seqs:
            r: Request[Ticket[Vector]] = Request(
                len(x), now, x, deadline=deadline, priority=priority
            )
            r.handle = Ticket(r, FutureReply(loop.create_future()))
            r.due = due
            lane = self.queues.push(r)
            if ad is not None:
                ad.on_arrival(lane, r.length, now)
            if self.refitter is not None:
                self.refitter.observe(r.length)
            requests.append(r)
        self.metrics.record_priority(priority, len(requests))
        self.ledger.admit(r.handle for r in requests)
        self._kick()
        try:
            vectors = list(await asyncio.gather(*(_future(r) for r in requests)))
            return Embedded(vectors, sum(len(x) for x in seqs))
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

    # ------------------------------------------------------------------ the loop

    def apply_caps(self) -> None:
        """Run the scheduler with the batch caps as they are now (and no waiting once draining)."""
        self.cfg = self.caps.config(draining=self.state is not EngineState.RUNNING)
        self.metrics.set_batch_caps(self.caps.caps())

    async def _loop(self) -> None:
        assert self._wakeup is not None
        while True:
            self._wakeup.clear()
            now = self.clock.now()
            restored = self.caps.expire(now)
            if restored:
                for lane in restored:
                    log.info("batch cap of bucket %s restored", self.lane_labels[lane])
                self.apply_caps()
            if self.refitter is not None:
                self._maybe_refit(now)
            decision = schedule(self.queues, now, self.cfg, self.adaptive)
            for r in decision.expired:
                self.ledger.expire(r.handle)
            if self.adaptive is not None:
                for r in decision.shed:
                    self.metrics.record_shed("queue")
                    self.ledger.shed(r.handle, self.adaptive.shed_error(r, now))
                for src, dst in decision.merges:
                    self.metrics.record_merge(src, dst)
            for batch in decision.batches:
                task = asyncio.create_task(self._run_batch(batch))
                self._batch_tasks.add(task)
                task.add_done_callback(self._batch_tasks.discard)
            self.metrics.set_depths(self.queues.depths(), self.queues.inflight_total)
            await self._sleep_until_woken(decision.wake_at)

    def _maybe_refit(self, now: float) -> None:
        """Ask the re-fitter; once new boundaries are pending, hold new batches until the
        runner is idle, then swap the lanes atomically (queued requests re-bucketed)."""
        assert self._swap is not None and self.adaptive is not None
        old = self.cfg.boundaries
        new = self._swap.step(
            now, old, self.queues.inflight_total, self.state is EngineState.RUNNING
        )
        self.adaptive.hold = self._swap.holding
        if new is None:
            return
        assert self.refitter is not None
        batching = self.batching.model_copy(update={"boundaries": new, "auto_boundaries": False})
        lanes = resolve_lanes(batching, self.info.max_length)
        self.batching = batching
        self.queues.rebucket(lanes.cfg)
        self.caps = BatchCaps(lanes.cfg, self.recovery.oom_cooldown_s)
        self.lane_labels[:] = lanes.labels
        self.ledger.lane_labels = self.lane_labels
        self.admission.sched = lanes.cfg
        self.uses_default_boundaries = False
        self.metrics.record_refit(self.lane_labels)
        self.adaptive.reset_lanes(lanes.cfg)
        self.adaptive.hold = False
        self.apply_caps()
        ev = self.refitter.events[-1]
        log.info(
            "re-fit: boundaries %s -> %s (drift KS %s, predicted saving %.1f%%, %d queued "
            "requests re-bucketed)",
            list(old),
            list(new),
            "n/a" if ev.ks is None else f"{ev.ks:.3f}",
            100 * ev.saving,
            self.queues.size,
        )

    async def _run_batch(self, batch: Batch) -> None:
        try:
            await self.batches.run(batch)
        finally:
            self.queues.batch_done(batch.lane)
            if self.adaptive is not None:
                self._observe(batch)
            self._kick()

    def _observe(self, batch: Batch) -> None:
        """Feed the model calls this batch made (one, or more if it was split) to the online
        cost model: members that ran together share their start and execution time."""
        assert self.adaptive is not None
        calls: dict[tuple[float, float], list[int]] = {}
        for r in batch.requests:
            t = r.handle
            if t.started is not None and t.exec_s is not None:
                calls.setdefault((t.started, t.exec_s), []).append(r.length)
        for (_, exec_s), lengths in calls.items():
            self.adaptive.observe_batch(batch.lane, len(lengths), max(lengths), exec_s)

    def crash(self, lane: int, reason: str) -> None:
        """Declare the runner unusable: not ready, every queued request answered 503."""
        self.metrics.record_failure(lane, "crash")
        if not self._declare_failed(reason):
            return
        waiting = self.queues.drain()
        log.error("runner crashed: %s; answering %d queued requests with 503", reason, len(waiting))
        err = self.refusal()
        for r in waiting:
            self.ledger.fail(r.handle, err)
        self._kick()


def _future(r: Request[Ticket[Vector]]) -> asyncio.Future[Vector]:
    reply = r.handle.reply
    assert isinstance(reply, FutureReply)
    return reply.future


def _failed_with(r: Request[Ticket[Vector]], err: BaseException) -> bool:
    fut = _future(r)
    return fut.done() and not fut.cancelled() and fut.exception() is err
