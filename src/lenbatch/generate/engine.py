"""The generation engine: one asyncio loop that admits, schedules and steps a causal LM.

    submit ─► admission ─► queues ─► schedule() ─► prefill jobs ─► decode batch ─► token streams
                                     (same scheduler as embeddings: length buckets, max wait,
                                      token budget; the decode policy says how many rows fit)

Each loop iteration admits what the decode policy has room for (through `schedule`, so length
bucketing works the same in both decode modes), runs one unit (a prefill chunk or a decode step)
in a worker thread, and delivers the new tokens to each request's stream. Queues and streams are
only touched on the event loop; the running batch only in the worker, one unit at a time.
Every admitted request gets exactly one ending: its finish reason, or an explicit error.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from enum import StrEnum

from lenbatch.config import (
    AdmissionConfig,
    BatchingConfig,
    GenerationConfig,
    SchedulerConfig,
    Strategy,
)
from lenbatch.core.admission import Admission
from lenbatch.core.buckets import BucketSet, default_boundaries
from lenbatch.core.clock import Clock, MonotonicClock
from lenbatch.core.errors import (
    BadInput,
    DeadlineExceeded,
    InputTooLong,
    LenbatchError,
    ModelFailed,
    Unavailable,
    drain_timed_out,
    draining,
)
from lenbatch.core.queues import Queues
from lenbatch.core.request import Request, RequestStatus
from lenbatch.core.scheduler import schedule
from lenbatch.generate.core import DecodeCore, UnitResult
from lenbatch.generate.metrics import LMMetrics
from lenbatch.generate.policy import Unit, make_policy
from lenbatch.generate.sampling import SamplingParams, TextTracker
from lenbatch.generate.sequence import Delta, Sequence, Timings
from lenbatch.runners.base import CausalRunner
from lenbatch.serving.lengthlog import LengthLog
from lenbatch.serving.metrics import Metrics

__all__ = ["GenState", "GenerationEngine"]

log = logging.getLogger("lenbatch.generate")


class GenState(StrEnum):
    """Lifecycle of a generation engine."""

    NEW = "new"
    RUNNING = "running"
    DRAINING = "draining"
    STOPPED = "stopped"


class GenerationEngine:
    """Length-bucketed admission and static or continuous decoding in front of a causal LM."""

    def __init__(
        self,
        runner: CausalRunner,
        batching: BatchingConfig | None = None,
        admission: AdmissionConfig | None = None,
        generation: GenerationConfig | None = None,
        *,
        clock: Clock | None = None,
        length_log: LengthLog | None = None,
    ) -> None:
        self.runner = runner
        self.info = runner.info
        self.batching = batching or BatchingConfig()
        self.generation = generation or GenerationConfig()
        self.clock: Clock = clock or MonotonicClock()
        self.length_log = length_log
        # A prompt leaves room for at least one generated token.
        self.prompt_limit = self.info.max_length - 1
        self.uses_default_boundaries = (
            self.batching.strategy is Strategy.BUCKETED and self.batching.boundaries is None
        )
        resolved = self.batching.resolve(self.prompt_limit, default_boundaries(self.prompt_limit))
        # One prefill batch in flight at a time: prefill jobs run one after another anyway.
        self.cfg: SchedulerConfig = dataclasses.replace(resolved, slots=1)
        if self.cfg.strategy is Strategy.BUCKETED:
            self.lane_labels = BucketSet(self.cfg.boundaries, self.prompt_limit).labels()
        else:
            self.lane_labels = ["all"]
        self.queues = Queues(self.cfg)
        self.policy = make_policy(self.generation, self.batching.max_batch)
        self.mode = self.generation.mode.value
        self.metrics = Metrics(self.lane_labels, f"{self.cfg.strategy.value}+{self.mode}")
        self.lm = LMMetrics()
        self.admission = Admission(admission or AdmissionConfig(), self.cfg, self.clock.now())
        self.request_timeout = (admission or AdmissionConfig()).request_timeout_s
        self.core = DecodeCore(runner, self.clock.now, self.policy.release_on_merge)
        self.state = GenState.NEW
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lenbatch-decode")
        self._wakeup: asyncio.Event | None = None
        self._loop_task: asyncio.Task[None] | None = None
        self._open: dict[str, Sequence] = {}  # admitted, not yet ended
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._wake_at: float | None = None

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Start the loop on the running event loop."""
        if self.state is not GenState.NEW:
            raise RuntimeError(f"engine already {self.state.value}")
        warm_up = getattr(self.runner, "warm_up", None)
        if callable(warm_up):
            started = time.monotonic()
            await asyncio.get_running_loop().run_in_executor(self._executor, warm_up)
            log.info("model warmed up in %.2f s", time.monotonic() - started)
        self._wakeup = asyncio.Event()
        self.state = GenState.RUNNING
        self._loop_task = asyncio.create_task(self._loop(), name="lenbatch-generate")
        self.refresh_memory()

    async def drain(self, timeout: float | None = 30.0) -> None:
        """Refuse new requests and wait up to `timeout` seconds for every admitted one to end;
        end whatever is left with 503. The loop keeps running."""
        if self.state is GenState.RUNNING:
            self.state = GenState.DRAINING
            # Nobody will join partial batches any more: flush them now.
            lanes = tuple(dataclasses.replace(p, max_wait=0.0) for p in self.cfg.lanes)
            self.cfg = dataclasses.replace(self.cfg, lanes=lanes)
            self._kick()
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._open and (deadline is None or time.monotonic() < deadline):
            await asyncio.sleep(0.01)
        if not self._open:
            return
        log.warning("drain timeout of %s s passed: ending %d with 503", timeout, len(self._open))
        self.queues.drain()
        err = drain_timed_out(timeout)
        for seq in list(self._open.values()):
            self._fail(seq, err)

    async def stop(self, timeout: float | None = 30.0) -> None:
        """`drain(timeout)`, then stop the loop and the worker thread. Nothing admitted is
        dropped silently."""
        if self.state in (GenState.NEW, GenState.STOPPED):
            self.state = GenState.STOPPED
            self._executor.shutdown(wait=False)
            return
        await self.drain(timeout)
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        self.state = GenState.STOPPED
        self._executor.shutdown(wait=True)
        if self.length_log is not None:
            self.length_log.close()

    @property
    def unanswered(self) -> int:
        """Admitted requests that have not ended yet (queued, prefilling or decoding)."""
        return len(self._open)

    @property
    def ready(self) -> bool:
        """True while the engine accepts work."""
        return self.state is GenState.RUNNING

    # ------------------------------------------------------------------ submitting

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each prompt (the caller drops the text afterwards)."""
        return self.runner.tokenize(texts, False)

    def submit(
        self,
        prompt: list[int],
        params: SamplingParams,
        *,
        arrival: float | None = None,
        timeout: float | None = None,
        priority: int = 0,
    ) -> Sequence:
        """Queue one tokenized prompt; returns its `Sequence` to pass to `stream()`.

        `arrival` is when the caller received the request (before tokenizing), for the TTFT
        breakdown. Raises a `LenbatchError` when the request cannot be admitted.
        """
        if self.state is GenState.DRAINING:
            raise draining()
        if self.state is not GenState.RUNNING:
            raise Unavailable(f"server is {self.state.value}; not accepting requests")
        if not prompt:
            raise BadInput("the prompt is empty (0 tokens)")
        lo, hi = min(prompt), max(prompt)
        if lo < 0 or hi >= self.info.vocab_size:
            raise BadInput(f"prompt has token ids outside [0, {self.info.vocab_size})")
        limit = self.generation.max_tokens_limit
        if limit is not None and params.max_tokens > limit:
            raise BadInput(f"max_tokens={params.max_tokens} exceeds this server's limit {limit}")
        context = self.info.max_length
        if len(prompt) + params.max_tokens > context:
            self.metrics.record_rejection("too_long")
            raise InputTooLong(
                f"the prompt has {len(prompt)} tokens and max_tokens is {params.max_tokens}; "
                f"together they exceed the model's context of {context} tokens"
            )
        now = self.clock.now()
        refusal = self.admission.check([len(prompt)], self.queues, now)
        if refusal is not None:
            self.metrics.record_rejection(refusal.code)
            raise refusal
        timeout = timeout if timeout is not None else self.request_timeout
        deadline = None if timeout is None else now + timeout
        request = Request(len(prompt), now, list(prompt), deadline=deadline, priority=priority)
        timings = Timings(arrival=now if arrival is None else min(arrival, now), queued=now)
        seq = Sequence(
            request,
            params,
            TextTracker(self.runner.decode, params.stop),
            timings,
            self.runner.device,
        )
        seq.sink = asyncio.Queue()
        request.handle = seq
        self.queues.push(request)
        self._open[request.id] = seq
        if timeout is not None:
            loop = asyncio.get_running_loop()
            self._timers[request.id] = loop.call_later(timeout, self._on_deadline, seq)
        self._kick()
        return seq

    async def stream(self, seq: Sequence) -> AsyncIterator[Delta]:
        """The deltas of `seq` as they are generated; the last one has a finish reason.

        Raises the request's `LenbatchError` if it fails. Leaving early (break, cancellation,
        client gone) cancels the request so it stops costing compute.
        """
        try:
            while True:
                item = await seq.sink.get()
                if isinstance(item, LenbatchError):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            if seq.request.id in self._open:
                self.cancel(seq)

    def cancel(self, seq: Sequence) -> None:
        """The caller is gone: leave the queue, or leave the batch at the next step."""
        if seq.request.id not in self._open:
            return
        self.queues.remove(seq.request)
        seq.cancelled = True
        self._close(seq, RequestStatus.CANCELLED)
        self._kick()

    # ------------------------------------------------------------------ the loop

    def _kick(self) -> None:
        if self._wakeup is not None:
            self._wakeup.set()

    async def _loop(self) -> None:
        assert self._wakeup is not None
        loop = asyncio.get_running_loop()
        last: str | None = None
        while True:
            self._wakeup.clear()
            self._admit()
            unit = self.policy.next_unit(self.core, last)
            if unit is None:
                last = None
                self._publish_state()
                timer = None
                if self._wake_at is not None:
                    delay = max(0.0, self._wake_at - self.clock.now())
                    timer = loop.call_later(delay, self._wakeup.set)
                await self._wakeup.wait()
                if timer is not None:
                    timer.cancel()
                continue
            try:
                result = await loop.run_in_executor(self._executor, self._run, unit)
            except Exception as exc:
                self._on_unit_error(unit, exc)
                last = None
                continue
            last = unit.kind
            self._deliver(result)

    def _admit(self) -> None:
        """Ask the scheduler for prefill batches if the decode policy has room."""
        self._wake_at = None
        room = self.policy.capacity(self.core)
        if room <= 0 or self.queues.size == 0:
            return
        cfg = self.cfg
        if any(p.max_batch > room for p in cfg.lanes):
            lanes = tuple(
                dataclasses.replace(p, max_batch=min(p.max_batch, room)) for p in cfg.lanes
            )
            cfg = dataclasses.replace(cfg, lanes=lanes)
        now = self.clock.now()
        decision = schedule(self.queues, now, cfg)
        for r in decision.expired:
            self._fail(r.handle, self._expired_error(r))
        for batch in decision.batches:
            seqs = [r.handle for r in batch.requests]
            for s in seqs:
                s.timings.admitted = now
            self.core.add_job(batch.lane, seqs, cfg.lanes[batch.lane].pad_to)
        self._wake_at = decision.wake_at
        self.metrics.set_depths(self.queues.depths(), self.queues.inflight_total)

    def _run(self, unit: Unit) -> UnitResult:
        """Worker thread: run one unit."""
        if unit.kind == "prefill":
            assert unit.job is not None
            return self.core.prefill(unit.job, unit.cols)
        return self.core.decode()

    def _deliver(self, result: UnitResult) -> None:
        """Event loop: hand new tokens to their streams, end finished sequences, record."""
        now = self.clock.now()
        for seq, delta in result.deltas:
            if seq.request.id not in self._open:
                continue  # cancelled while the unit ran
            t = seq.timings
            gaps = []
            if not t.token_times:
                t.first_token = now
                self.lm.record_first_token(t.ttft, t.stages())
            else:
                gaps.append(now - t.token_times[-1])
            t.token_times.append(now)
            self.lm.record_tokens(len(delta.token_ids), gaps)
            seq.sink.put_nowait(delta)
            if delta.finish_reason is not None:
                t.finished = now
                self.lm.record_finished(t.finished - t.arrival, seq.prompt_tokens)
                self._close(seq, RequestStatus.OK)
        for lane in result.released_lanes:
            self.queues.batch_done(lane)
        self.lm.record_step(
            result.kind, result.compute_s, result.rows, result.tokens, result.padded
        )
        job = result.job
        if result.finished_job and job is not None:
            b = job.batch
            self.metrics.record_batch(
                job.lane,
                job.rows,
                b.real_tokens,
                b.padded_tokens,
                job.seqs[0].timings.prefill_compute,
                [s.timings.admitted - s.timings.queued for s in job.seqs],
            )
        self._publish_state()

    def _publish_state(self) -> None:
        core = self.core
        self.lm.set_state(
            core.kv_bytes(),
            core.kv_real_bytes(),
            core.kv_peak_bytes,
            core.running_rows,
            core.pending_rows,
        )

    def refresh_memory(self) -> None:
        """Weights, activations and KV cache, kept apart (activations = peak above weights
        minus the KV cache's peak, an estimate on CPU where only the process RSS is known)."""
        mem = self.runner.memory()
        activations = max(0, mem.peak_activations - self.core.kv_peak_bytes)
        self.metrics.set_memory(mem.weights, activations, mem.device)

    # ------------------------------------------------------------------ failures and endings

    def _on_unit_error(self, unit: Unit, exc: Exception) -> None:
        name = type(exc).__name__
        if unit.kind == "prefill" and unit.job is not None:
            log.warning("prefill of %d prompts failed (%s); bisecting", unit.job.rows, name)
            failed, lanes = self.core.fail_job(unit.job)
            msg = f"the model failed on this prompt ({name}); others are unaffected"
        else:
            log.warning("decode step of %d rows failed (%s)", self.core.running_rows, name)
            failed, lanes = self.core.fail_running()
            msg = f"the model failed during decoding ({name})"
        for seq in failed:
            self._fail(seq, ModelFailed(msg))
        for lane in lanes:
            self.queues.batch_done(lane)

    def _fail(self, seq: Sequence, err: LenbatchError) -> None:
        if seq.request.id not in self._open:
            return
        seq.cancelled = True  # leaves the batch at the next step if it is in one
        seq.sink.put_nowait(err)
        status = RequestStatus.EXPIRED if isinstance(err, DeadlineExceeded) else RequestStatus.ERROR
        self._close(seq, status)

    def _close(self, seq: Sequence, status: RequestStatus) -> None:
        """The one place a request ends: exactly once per admitted request."""
        r = seq.request
        if self._open.pop(r.id, None) is None:
            return
        timer = self._timers.pop(r.id, None)
        if timer is not None:
            timer.cancel()
        now = self.clock.now()
        self.metrics.record_request(r.lane, now - seq.timings.arrival, status.value)
        if self.length_log is not None:
            t = seq.timings
            self.length_log.write(
                id=r.id,
                arrival=time.time() - (now - t.arrival),
                length=r.length,
                bucket=self.lane_labels[r.lane] if r.lane >= 0 else "none",
                queue_wait_ms=None if math.isnan(t.admitted) else (t.admitted - t.queued) * 1000,
                exec_ms=t.prefill_compute * 1000 if t.prefill_compute else None,
                status=status.value,
            )

    def _on_deadline(self, seq: Sequence) -> None:
        self._timers.pop(seq.request.id, None)
        if seq.request.id not in self._open or not math.isnan(seq.timings.admitted):
            return  # answered, or already admitted: let it finish
        self.queues.remove(seq.request)
        self._fail(seq, self._expired_error(seq.request))
        self._kick()

    def _expired_error(self, r: Request) -> DeadlineExceeded:
        assert r.deadline is not None
        waited = self.clock.now() - r.arrival
        return DeadlineExceeded(
            f"deadline of {r.deadline - r.arrival:.3f} s passed after {waited:.3f} s in the queue"
        )
