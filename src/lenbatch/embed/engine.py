"""The engine: the one asyncio loop that admits, schedules, collates, runs and answers.

    submit ─► tokenize (thread) ─► admission ─► queues ─► schedule() ─► collate ─►
        runner (thread) ─► futures

Every admitted input is a `Request` with one future; it is answered exactly once, with its
vector or an explicit error, through the `Ledger`. Each turn of the loop is three steps, as in
vLLM's `EngineCore.step()`:

- `_schedule`: restore expired batch caps, re-fit the boundaries if due, ask the pure scheduler
  for a `Decision`, and end what it drops (expired, shed);
- `_execute`: start the decision's batches on the `BatchRunner` (`embed/batches.py`), each in a
  task of its own: batches beyond the runner's concurrency are collated ahead of time
  (prefetch) and wait for a runner slot, and cancelled or expired members are dropped before
  they cost compute;
- `_update`: apply each `BatchEvent` a batch yields (answers, errors, figures, batch caps, the
  cost model, a crash). It runs in the batch's task as each model call returns, so a call's
  requests are answered then, not at the loop's next turn.

A call's inputs are admitted and queued by `EmbeddingIntake` (`embed/intake.py`), the engine's
base. The loop then sleeps until new work arrives, a batch finishes, or the scheduler's `wake_at`.
When the model fails, `BatchRunner` isolates the failure: a poison input fails alone, an
out-of-memory batch is split, a crashed runner turns the engine not-ready.

Shutdown: `begin_drain()` refuses new requests (503) and flushes the queues without waiting for
batches to fill; `stop()` waits for every admitted request up to a timeout and answers whatever
is left with 503. Nothing admitted is dropped silently.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import Any

from lenbatch.config import (
    AdaptiveConfig,
    AdmissionConfig,
    BatchingConfig,
    RecoveryConfig,
    Strategy,
)
from lenbatch.core.adaptive import AdaptiveState, build_state
from lenbatch.core.batch import Batch, Decision
from lenbatch.core.clock import Clock
from lenbatch.core.costfit import CostCoefficients
from lenbatch.core.errors import ModelFailed
from lenbatch.core.lanes import resolve_lanes
from lenbatch.core.occupancy import SlotGaps
from lenbatch.core.recovery import BatchCaps
from lenbatch.core.refit import Fitter, optimal_bounds
from lenbatch.core.request import Request
from lenbatch.core.scheduler import schedule
from lenbatch.embed.batches import (
    BatchEvent,
    BatchRunner,
    Crashed,
    Expired,
    Failed,
    Refused,
    Returned,
    Started,
)
from lenbatch.embed.inputs import InputReader
from lenbatch.embed.intake import EmbeddingIntake
from lenbatch.embed.refit import LiveRefit
from lenbatch.embed.warmup import warm_up
from lenbatch.runners.base import EmbeddingRunner
from lenbatch.serving.budget import ComputeBudget
from lenbatch.serving.ledger import Ticket
from lenbatch.serving.lengthlog import LengthLog
from lenbatch.serving.lifecycle import EngineState
from lenbatch.serving.messages import Embedded, Inputs, Vector
from lenbatch.serving.servercpu import request_side_cpu_s
from lenbatch.serving.workers import usable_cores

__all__ = ["Embedded", "Engine", "EngineState", "Inputs"]

log = logging.getLogger("lenbatch.embed.engine")


class Engine(EmbeddingIntake):
    """Length-aware dynamic batching in front of an `EmbeddingRunner` (calls: `EmbeddingIntake`)."""

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
        threads = _torch_threads()
        super().__init__(
            lanes,
            admission,
            clock,
            metrics_label=lanes.cfg.strategy.value,
            workers=self.batching.max_concurrent_batches,
            name="lenbatch-runner",
            length_log=length_log,
            pin_workers=self.batching.pin_workers and threads == 1,
        )
        self.workers_info["torch_threads"] = threads
        self.caps = BatchCaps(lanes.cfg, self.recovery.oom_cooldown_s)
        self.metrics.set_batch_caps(self.caps.caps())
        self.batches = BatchRunner(
            runner,
            self.info,
            self._executor,
            self.batching.max_concurrent_batches,
            self.recovery,
            self.clock,
        )
        # Texts are tokenized in worker threads, never on the event loop (see `InputReader`).
        self.inputs = InputReader(
            runner.tokenize,
            self.info.max_length,
            self.info.vocab_size,
            default_truncate=default_truncate,
        )
        self._batch_tasks: set[asyncio.Task[None]] = set()
        # the server's own time per batch around the model call, which the cost model learns
        self.gaps = SlotGaps(self.batching.max_concurrent_batches)
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
                cores=usable_cores(),
            )
        # Online re-fit of the boundaries (adaptive; always on with boundaries = "auto").
        self.refit: LiveRefit | None = None
        if self.adaptive is not None and (ac.refit or self.batching.auto_boundaries):
            self.refit = LiveRefit(
                ac, self.info.max_length, self.adaptive, fitter or optimal_bounds
            )

    def use_budget(self, budget: ComputeBudget, owner: str) -> None:
        """Take turns on `budget` (shared with the other models' engines) for each batch,
        counted to `owner`'s share."""
        super().use_budget(budget, owner)
        self.batches.use_budget(budget, owner)
        if budget.slots <= self.batching.max_concurrent_batches:
            # The budget alone bounds the model calls running at once. A batch formed ahead
            # then waits for its turn at the budget, in its model's place in the budget's
            # order, not behind this engine's own slot: there, the turn its predecessor gave
            # back went to another model before it could ask, so a light model's small
            # batches each waited for one of a heavy model's batches (an embedding call's
            # P95 7x under a rerank burst).
            b = self.batching
            self.batches.slots = asyncio.Semaphore(b.max_concurrent_batches + b.prefetch_batches)

    # ------------------------------------------------------------------ lifecycle hooks

    async def _warm_up(self) -> None:
        """Every bucket's batch shapes once before ready (torch runners; `embed/warmup.py`)."""
        if getattr(self.runner, "needs_warm_up", False):
            slots = self.batching.max_concurrent_batches
            await warm_up(
                self.batches.warm, self.runner.tokenize, self.cfg, self.info.max_length, slots=slots
            )

    def _on_drain(self) -> None:
        if self.adaptive is not None:
            self.adaptive.draining = True  # nobody will join partial batches any more
        self.apply_caps()

    def _release(self) -> None:
        for task in list(self._batch_tasks):
            task.cancel()  # their requests are all answered by now
        self.inputs.close()
        super()._release()

    def refresh_memory(self) -> None:
        """Weights apart from peak activations, read from the runner into the metrics."""
        mem = self.runner.memory()
        self.metrics.set_memory(mem.weights, mem.peak_activations, mem.device)

    def _extra_stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "batch_caps": self.caps.describe(self.clock.now(), self.lane_labels),
            "priority_levels": self.priority_levels,
            "runner_gaps": self.gaps.describe(),
        }
        if self.adaptive is not None:
            out["adaptive"] = self.adaptive.describe(self.lane_labels, self.clock.now())
        if self.refit is not None:
            out["refit"] = self.refit.describe()
        return out

    def prometheus(self) -> bytes:
        """Prometheus exposition (adaptive's gauges are read first, so the scrape shows them)."""
        if self.adaptive is not None:
            self.metrics.set_adaptive(self.adaptive.describe(self.lane_labels, self.clock.now()))
        return super().prometheus()

    # ------------------------------------------------------------------ the loop

    def apply_caps(self) -> None:
        """Run the scheduler with the batch caps as they are now (and no waiting once draining)."""
        self.cfg = self.caps.config(draining=self.state is not EngineState.RUNNING)
        self.metrics.set_batch_caps(self.caps.caps())

    async def _loop(self) -> None:
        assert self._wakeup is not None
        while True:
            self._wakeup.clear()
            decision = self._schedule(self.clock.now())
            self._execute(decision.batches)
            self.metrics.set_depths(self.queues.depths(), self.queues.inflight_total)
            await self._sleep_until_woken(decision.wake_at)

    def _schedule(self, now: float) -> Decision:
        """Step 1: what to run now. Restores batch caps whose cool-down passed, re-fits the
        boundaries if due, asks the scheduler, and ends the requests it drops (expired, or
        shed by `adaptive`); returns its decision (the batches, and when to ask again)."""
        restored = self.caps.expire(now)
        if restored:
            for lane in restored:
                log.info("batch cap of bucket %s restored", self.lane_labels[lane])
            self.apply_caps()
        if self.refit is not None:
            self._maybe_refit(self.refit, now)
        decision = schedule(self.queues, now, self.cfg, self.adaptive)
        for r in decision.expired:
            self.ledger.expire(r.handle)
        if self.adaptive is not None:
            for r in decision.shed:
                self.metrics.record_shed("queue")
                self.ledger.shed(r.handle, self.adaptive.shed_error(r, now))
            for src, dst in decision.merges:
                self.metrics.record_merge(src, dst)
        return decision

    def _execute(self, batches: Sequence[Batch]) -> list[asyncio.Task[None]]:
        """Step 2: start each batch on the runner, in a task of its own (it collates now and
        waits for a runner slot); returns the tasks."""
        tasks = []
        for batch in batches:
            task = asyncio.create_task(self._run_batch(batch, self.clock.now()))
            self._batch_tasks.add(task)
            task.add_done_callback(self._batch_tasks.discard)
            tasks.append(task)
        return tasks

    def _update(self, event: BatchEvent, gap: float = 0.0) -> None:
        """Step 3: apply what a batch came to, as it happens: start, answer or fail its
        requests through the ledger; record the call's figures, feed the cost model, lower a
        batch cap after out-of-memory, or declare the runner crashed. `gap`: the seconds the
        runner slot sat idle before this call (`core.occupancy`), which the cost model learns
        with the call's own time."""
        match event:
            case Started(requests, at):
                for r in requests:
                    self.ledger.start(r.handle, at)
            case Expired(requests):
                for r in requests:
                    self.ledger.expire(r.handle)
            case Refused(requests):
                self._refuse_all(requests)
            case Returned():
                self._returned(event, gap)
            case Failed():
                self._failed(event)
            case Crashed(lane, reason, requests):
                self.crash(lane, reason)
                self._refuse_all(requests)

    def _returned(self, call: Returned, gap: float = 0.0) -> None:
        """Record a model call that returned and answer its requests."""
        lane = call.lane
        self.metrics.record_batch(
            lane, call.size, call.real_tokens, call.padded_tokens, call.exec_s, call.queue_waits
        )
        log.debug(
            "batch lane=%s size=%d width=%d real=%d packed=%s exec_ms=%.1f",
            self.lane_labels[lane],
            call.size,
            call.width,
            call.real_tokens,
            call.packed,
            call.exec_s * 1000,
        )
        if self.adaptive is not None:
            longest = max(r.length for r in call.requests)
            now = self.clock.now()
            meter = self.adaptive.request_cpu
            if meter.due(now):  # the request-side CPU per request (`core.occupancy`)
                meter.observe(now, request_side_cpu_s(), self.adaptive.arrivals)
            self.adaptive.observe_batch(lane, call.size, longest, call.exec_s + gap, now)
        for r, vec in zip(call.requests, call.vectors, strict=True):
            r.handle.exec_s = call.exec_s
            self.ledger.answer(r.handle, vec)

    def _failed(self, call: Failed) -> None:
        """Record a failed model call, lower its lane's cap after out-of-memory, and fail the
        requests that failed alone."""
        lane = call.lane
        self.metrics.record_failure(lane, call.kind)
        if call.kind == "oom":
            cap = self.caps.lower(lane, call.size, self.clock.now())
            self.apply_caps()
            if call.size > 1:
                log.warning(
                    "out of memory on a batch of %d x %d tokens: splitting; bucket %s capped "
                    "at %d for %g s",
                    call.size,
                    call.width,
                    self.lane_labels[lane],
                    cap,
                    self.caps.cooldown_s,
                )
        for r, err in call.errors:
            self.ledger.fail(r.handle, err)

    def _refuse_all(self, requests: Sequence[Request[Ticket[Vector]]]) -> None:
        err = self.refusal()
        for r in requests:
            self.ledger.fail(r.handle, err)

    def _maybe_refit(self, refit: LiveRefit, now: float) -> None:
        """Swap the lanes atomically once the re-fit says so (queued requests re-bucketed)."""
        assert self.adaptive is not None
        accepting = self.state is EngineState.RUNNING
        inflight, queued = self.queues.inflight_total, self.queues.size
        new = refit.step(now, self.cfg.boundaries, inflight, accepting, queued)
        if new is None:
            return
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

    async def _run_batch(self, batch: Batch, emitted: float) -> None:
        pad_to = self.cfg.lanes[batch.lane].pad_to
        events = self.batches.run(batch, pad_to, failed=self._has_failed, wanted=_wanted)
        gap = 0.0
        try:
            async with contextlib.aclosing(events):
                async for event in events:
                    if isinstance(event, Started):
                        gap = self.gaps.started(event.at, emitted)
                    elif isinstance(event, Returned):
                        self.gaps.ended(event.started + event.exec_s)
                    elif isinstance(event, Failed):
                        self.gaps.ended(self.clock.now())
                    self._update(event, gap)
        except Exception:  # a bug above the runner: never leave a request hanging
            log.exception("bug: batch of lane %s failed outside the runner", batch.lane)
            for r in batch.requests:
                self.ledger.fail(r.handle, ModelFailed("internal error while running this batch"))
        finally:
            self.queues.batch_done(batch.lane)
            if self._nothing_to_schedule():
                self.metrics.set_depths(self.queues.depths(), self.queues.inflight_total)
            else:
                self._kick()

    def _nothing_to_schedule(self) -> bool:
        """Whether a scheduling pass now would find no work: nothing queued, the engine
        running (a drain finishes through the loop) and no boundary swap waiting for the
        runner. A batch's end then wakes no pass (on a light load, one pass in two: 1.7 % less
        of the loop's CPU per sequential one-line call, paired `bench/request_cost_ab.py`);
        the next arrival's pass decides."""
        return (
            self.queues.size == 0
            and self.state is EngineState.RUNNING
            and (self.refit is None or not self.refit.swap.holding)
        )

    def _has_failed(self) -> bool:
        return self.state is EngineState.FAILED

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


def _wanted(r: Request[Ticket[Vector]]) -> bool:
    return not r.handle.finished


def _torch_threads() -> int:
    """The torch threads each model call runs (`model.torch_threads`, else torch's default)."""
    import torch  # the runner has loaded it; the engine's own code does not need it

    return int(torch.get_num_threads())
