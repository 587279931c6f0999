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
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from lenbatch.config import AdmissionConfig, BatchingConfig, DecodeMode, GenerationConfig
from lenbatch.core.clock import Clock
from lenbatch.core.errors import (
    InputTooLong,
    LenbatchError,
    ModelFailed,
    OutOfMemory,
    is_out_of_memory,
)
from lenbatch.core.lanes import resolve_lanes
from lenbatch.core.request import Request
from lenbatch.core.scheduler import schedule
from lenbatch.generate.core import DecodeCore, UnitResult
from lenbatch.generate.metrics import LMMetrics
from lenbatch.generate.policy import Unit, make_policy
from lenbatch.generate.prompts import Prompts
from lenbatch.generate.sampling import TextTracker
from lenbatch.generate.sequence import Sequence, Timings
from lenbatch.generate.static import make_static
from lenbatch.runners.base import CausalRunner
from lenbatch.serving.engine import BaseEngine
from lenbatch.serving.ledger import Ticket
from lenbatch.serving.lengthlog import LengthLog
from lenbatch.serving.messages import Delta, SamplingParams

__all__ = ["GenerationEngine", "StreamReply"]

log = logging.getLogger("lenbatch.generate")


class StreamReply:
    """A `Reply` through a sequence's event queue: the stream reads deltas, then its ending.

    Only the last delta goes through the ledger (`answer`); the ones before it are put on the
    queue directly while the request is open. An error or a cancellation also takes the
    sequence out of the running batch at the next step."""

    __slots__ = ("seq",)

    def __init__(self, seq: Sequence) -> None:
        self.seq = seq

    def give(self, value: Delta) -> None:
        """The last delta."""
        self.seq.sink.put_nowait(value)

    def refuse(self, err: LenbatchError) -> None:
        """The stream raises `err`; the sequence leaves its batch."""
        self.seq.cancelled = True
        self.seq.sink.put_nowait(err)

    def withdraw(self) -> None:
        """The caller left: the sequence leaves its batch."""
        self.seq.cancelled = True

    @property
    def abandoned(self) -> bool:
        """Never on its own: a caller that leaves the stream cancels through the engine."""
        return False


class GenerationEngine(BaseEngine[Delta]):
    """Length-bucketed admission and static or continuous decoding in front of a causal LM."""

    _join_workers_on_stop = True  # a unit may still be running on the model

    def __init__(
        self,
        runner: CausalRunner,
        batching: BatchingConfig | None = None,
        admission: AdmissionConfig | None = None,
        generation: GenerationConfig | None = None,
        *,
        clock: Clock | None = None,
        length_log: LengthLog | None = None,
        static_shapes: bool | None = None,
    ) -> None:
        self.runner = runner
        self.info = runner.info
        self.batching = batching or BatchingConfig()
        self.generation = generation or GenerationConfig()
        # A prompt leaves room for at least one generated token.
        self.prompt_limit = self.info.max_length - 1
        lanes = resolve_lanes(self.batching, self.prompt_limit)
        # One prefill batch in flight at a time: prefill jobs run one after another anyway.
        lanes = dataclasses.replace(lanes, cfg=dataclasses.replace(lanes.cfg, slots=1))
        self.mode = self.generation.mode.value
        super().__init__(
            lanes,
            admission,
            clock,
            metrics_label=f"{lanes.cfg.strategy.value}+{self.mode}",
            workers=1,
            name="lenbatch-decode",
            length_log=length_log,
        )
        self.policy = make_policy(self.generation, self.batching.max_batch)
        self.prompts = Prompts(runner, self.info, self.generation)
        self.lm = LMMetrics()
        # Static shapes follow `generation.compile`; `static_shapes=True` runs them eager (to
        # check or measure the padding alone).
        static = None
        if self.generation.compile or static_shapes:
            max_rows = (
                self.generation.max_running
                if self.generation.mode is DecodeMode.CONTINUOUS
                else self.batching.max_batch
            )
            static = make_static(
                runner,
                tuple(p.upper for p in lanes.cfg.lanes),
                max_rows,
                self.generation.compile_max_width,
                compile=self.generation.compile,
            )
        self.core = DecodeCore(runner, self.clock.now, self.policy.release_on_merge, static)
        self._wake_at: float | None = None

    # ------------------------------------------------------------------ lifecycle hooks

    async def _warm_up(self) -> None:
        warm_up = getattr(self.runner, "warm_up", None)
        if callable(warm_up):
            started = time.monotonic()
            await asyncio.get_running_loop().run_in_executor(self._executor, warm_up)
            log.info("model warmed up in %.2f s", time.monotonic() - started)
        static = self.core.static
        if static is not None and static.graphs.stats.compiled:
            started = time.monotonic()
            n = await asyncio.get_running_loop().run_in_executor(self._executor, static.warm_up)
            log.info("compiled %d static shapes in %.1f s", n, time.monotonic() - started)

    def _release(self) -> None:
        self.prompts.close()
        super()._release()

    def _on_drain(self) -> None:
        # Nobody will join partial batches any more: flush them now.
        lanes = tuple(dataclasses.replace(p, max_wait=0.0) for p in self.cfg.lanes)
        self.cfg = dataclasses.replace(self.cfg, lanes=lanes)

    def describe(self) -> str:
        """One line for the start-up log: strategy, decode mode and lanes."""
        return f"decode {self.mode}, {super().describe()}"

    def _extra_stats(self) -> dict[str, Any]:
        out = self.lm.stats()
        out["decode_mode"] = self.mode
        out["preempted_rows"] = self.core.preempted
        static = self.core.static
        out["compile"] = static.graphs.stats.as_dict() if static else {"enabled": False}
        return out

    def _extra_prometheus(self) -> bytes:
        return self.lm.prometheus()

    # ------------------------------------------------------------------ submitting

    async def prompt_ids(
        self, raw: str | list[str] | list[int] | list[list[int]]
    ) -> list[list[int]]:
        """Token ids of a call's prompts: texts tokenized in a worker thread (then dropped),
        token arrays as given (`submit` checks them against the vocabulary)."""
        return await self.prompts.ids(raw)

    @property
    def has_chat_template(self) -> bool:
        """True if the tokenizer can format chat messages."""
        return self.prompts.has_chat_template

    async def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of chat `messages` through the tokenizer's chat template, in a worker
        thread."""
        return await self.prompts.chat(messages)

    def context_left(self, prompt_len: int) -> int:
        """Most tokens a prompt of `prompt_len` tokens may generate (context and limit)."""
        return self.prompts.context_left(prompt_len)

    def submit_all(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        *,
        arrival: float | None = None,
        timeout: float | None = None,
        priority: int = 0,
    ) -> list[Sequence]:
        """Queue every prompt of one call; if one is refused, withdraw the others."""
        seqs: list[Sequence] = []
        try:
            for p in prompts:
                seqs.append(
                    self.submit(p, params, arrival=arrival, timeout=timeout, priority=priority)
                )
        except LenbatchError:
            for s in seqs:
                self.cancel(s)
            raise
        return seqs

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
        self.check_running()
        try:
            self.prompts.check(prompt, params)
        except InputTooLong as err:
            self.metrics.record_rejection(err.code)
            raise
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
        seq.ticket = Ticket(request, StreamReply(seq), arrival=timings.arrival)
        self.queues.push(request)
        self.ledger.admit([seq.ticket])
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
            self.cancel(seq)

    def cancel(self, seq: Sequence) -> None:
        """The caller is gone: leave the queue, or leave the batch at the next step."""
        if seq.ticket is not None:
            self.ledger.cancel(seq.ticket)

    # ------------------------------------------------------------------ the loop

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
                await self._sleep_until_woken(self._wake_at)
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
            self.ledger.expire(_ticket(r.handle))
        for batch in decision.batches:
            seqs = [r.handle for r in batch.requests]
            for s in seqs:
                s.timings.admitted = now
                self.ledger.start(_ticket(s), now)
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
            ticket = _ticket(seq)
            if ticket.finished:
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
            if delta.finish_reason is None:
                seq.sink.put_nowait(delta)
            else:
                t.finished = now
                self.lm.record_finished(t.finished - t.arrival, seq.prompt_tokens)
                self.ledger.answer(ticket, delta)
        for lane in result.released_lanes:
            self.queues.batch_done(lane)
        self.lm.record_step(
            result.kind, result.compute_s, result.rows, result.tokens, result.padded
        )
        job = result.job
        if result.finished_job and job is not None:
            for s in job.seqs:
                _ticket(s).exec_s = s.timings.prefill_compute or None
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
        if core.static is not None:
            self.lm.set_compile(core.static.graphs.stats.as_dict())

    def refresh_memory(self) -> None:
        """Weights, activations and KV cache, kept apart (activations = peak above weights
        minus the KV cache's peak, an estimate on CPU where only the process RSS is known)."""
        mem = self.runner.memory()
        activations = max(0, mem.peak_activations - self.core.kv_peak_bytes)
        self.metrics.set_memory(mem.weights, activations, mem.device)

    # ------------------------------------------------------------------ failures and endings

    def _on_unit_error(self, unit: Unit, exc: Exception) -> None:
        name = type(exc).__name__
        if is_out_of_memory(exc):
            self._on_out_of_memory(unit)
            return
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

    def _on_out_of_memory(self, unit: Unit) -> None:
        """Split and retry: a prefill job is halved (or, one row, chunked finer), a decode
        batch hands its newest half back to prefill. Only a single row that runs out of memory
        at the smallest size fails, with 503 and Retry-After."""
        self.lm.record_oom(unit.kind)
        if unit.kind == "prefill" and unit.job is not None:
            log.warning("prefill of %d prompts ran out of memory; splitting", unit.job.rows)
            failed, lanes = self.core.oom_job(unit.job, unit.cols)
        else:
            log.warning("decode step of %d rows ran out of memory", self.core.running_rows)
            failed, lanes = self.core.oom_running()
        for seq in failed:
            self._fail(seq, OutOfMemory("the model ran out of memory on this prompt alone"))
        for lane in lanes:
            self.queues.batch_done(lane)

    def _fail(self, seq: Sequence, err: LenbatchError) -> None:
        self.ledger.fail(_ticket(seq), err)


def _ticket(seq: Sequence) -> Ticket[Delta]:
    if seq.ticket is None:
        raise RuntimeError(f"bug: sequence of request {seq.request.id} was never admitted")
    return seq.ticket
