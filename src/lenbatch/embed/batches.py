"""How one scheduled batch runs, and how a model failure is kept to the inputs that caused it.

`BatchRunner.run` collates a batch as soon as the scheduler emits it (prefetch): padded to its
longest member, or packed end to end when the runner runs padding-free batches
(`PackedEmbeddingRunner`, e.g. `runners.packed`); then it waits for one of the engine's runner
slots, drops members cancelled or expired meanwhile (they cost nothing),
runs the rest in a worker thread and answers each through the engine's `Ledger`.

When the model fails:

* a batch that raises is bisected, so a poison input fails alone (500 `model_error`) and the
  rest of its batch succeeds;
* a batch that runs out of memory (`MemoryError`, torch's `OutOfMemoryError`) is split and the
  halves retried, and its lane's batch cap is halved for a cool-down (`BatchCaps`); an input
  that runs out of memory alone is answered 503 `out_of_memory`;
* a runner that raises `RunnerCrashed`, that keeps failing and then fails a known-good probe
  input, or whose batch runs past `batch_timeout_s`, is declared crashed (`Engine.crash`): the
  engine turns not-ready and answers every waiting request 503.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from lenbatch.core.batch import Batch
from lenbatch.core.collate import Collated, Packed, collate, pack
from lenbatch.core.errors import ModelFailed, OutOfMemory, RunnerCrashed, is_out_of_memory
from lenbatch.core.request import Request
from lenbatch.runners.base import PackedEmbeddingRunner
from lenbatch.serving.ledger import Ticket
from lenbatch.serving.lifecycle import EngineState
from lenbatch.serving.messages import Vector

if TYPE_CHECKING:
    from lenbatch.embed.engine import Engine

__all__ = ["BatchRunner", "Prepared"]

Prepared = Collated | Packed  # a batch ready for the runner: padded or packed

log = logging.getLogger("lenbatch.embed.batches")

_PROBE_TEXT = "lenbatch probe"  # a fixed, known-good input for checking a failing runner


class BatchRunner:
    """Runs the batches of one `Engine` on its runner, `slots` at a time, isolating failures."""

    def __init__(self, engine: Engine, executor: ThreadPoolExecutor, slots: int) -> None:
        self.engine = engine
        self.executor = executor
        self.slots = asyncio.Semaphore(slots)
        self.failures_in_row = 0  # failed model calls (not out-of-memory) since a success
        runner = engine.runner
        self.packed_runner = runner if isinstance(runner, PackedEmbeddingRunner) else None

    async def run(self, batch: Batch) -> None:
        """Run `batch` once a runner slot is free and answer each of its requests."""
        e = self.engine
        pad_to = e.cfg.lanes[batch.lane].pad_to
        try:
            # Prepared while an earlier batch may still be running (prefetch).
            prepared = self.collate(batch.requests, pad_to)
            async with self.slots:
                if e.state is EngineState.FAILED:
                    for r in batch.requests:
                        e.ledger.fail(r.handle, e.refusal())
                    return
                now = e.clock.now()
                live = []
                for r in batch.requests:
                    if r.handle.finished:
                        continue  # cancelled or expired while waiting: costs nothing
                    if r.deadline is not None and r.deadline <= now:
                        e.ledger.expire(r.handle)
                        continue
                    live.append(r)
                if not live:
                    return
                if len(live) != len(batch.requests):
                    prepared = self.collate(live, pad_to)
                await self._execute(batch.lane, live, prepared, pad_to)
        except Exception:  # a bug above the runner: never leave a request hanging
            log.exception("bug: batch of lane %s failed outside the runner", batch.lane)
            for r in batch.requests:
                e.ledger.fail(r.handle, ModelFailed("internal error while running this batch"))

    def collate(self, requests: Sequence[Request[Ticket[Vector]]], pad_to: int | None) -> Prepared:
        """The batch of `requests` as the runner takes it: packed if it runs padding-free
        (then a lane's fixed length means nothing: a packed batch computes its real tokens
        only), else padded (to `pad_to` if the lane fixes a length)."""
        seqs = [r.token_ids or [] for r in requests]
        if self.packed_runner is not None:
            return pack(seqs)
        return self.pad(seqs, pad_to)

    def pad(self, seqs: Sequence[Sequence[int]], pad_to: int | None) -> Collated:
        """Token-id lists padded for the engine's model."""
        e = self.engine
        return collate(
            seqs,
            e.info.pad_token_id,
            e.info.padding_side,
            pad_to=pad_to,
            position_ids=e.info.needs_position_ids,
        )

    def _model_call(self, batch: Prepared) -> npt.NDArray[np.float32]:
        """Run one prepared batch on the runner (in a worker thread)."""
        if isinstance(batch, Packed):
            assert self.packed_runner is not None
            return self.packed_runner.embed_packed(batch)
        return self.engine.runner.embed(batch)

    async def _execute(
        self, lane: int, live: list[Request[Ticket[Vector]]], batch: Prepared, pad_to: int | None
    ) -> None:
        e = self.engine
        loop = asyncio.get_running_loop()
        start = e.clock.now()
        for r in live:
            e.ledger.start(r.handle, start)
        running = loop.run_in_executor(self.executor, self._model_call, batch)
        limit = e.recovery.batch_timeout_s
        if limit is not None and not (await asyncio.wait({running}, timeout=limit))[0]:
            e.crash(lane, f"a batch of {len(live)} ran longer than {limit:g} s")
            for r in live:
                e.ledger.fail(r.handle, e.refusal())
            return
        try:
            out = await running
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # whatever the model raises, every request gets an answer
            await self._on_batch_error(lane, live, batch, pad_to, exc)
            return
        end = e.clock.now()
        if out.shape[0] != len(live):
            raise RuntimeError(f"bug: runner returned {out.shape[0]} rows for {len(live)} inputs")
        self.failures_in_row = 0
        exec_s = end - start
        e.metrics.record_batch(
            lane,
            len(live),
            batch.real_tokens,
            batch.padded_tokens,
            exec_s,
            [start - r.arrival for r in live],
        )
        log.debug(
            "batch lane=%s size=%d width=%d real=%d packed=%s exec_ms=%.1f",
            e.lane_labels[lane],
            len(live),
            batch.width,
            batch.real_tokens,
            isinstance(batch, Packed),
            exec_s * 1000,
        )
        for r, vec in zip(live, out, strict=True):
            r.handle.exec_s = exec_s
            e.ledger.answer(r.handle, vec)

    # ------------------------------------------------------------------ when the model fails

    async def _on_batch_error(
        self,
        lane: int,
        live: list[Request[Ticket[Vector]]],
        batch: Prepared,
        pad_to: int | None,
        exc: BaseException,
    ) -> None:
        """Isolate a failure: split on out-of-memory, bisect on an error, stop on a crash.

        Only the exception's type is logged: its message may quote the input.
        """
        e = self.engine
        kind = type(exc).__name__
        if isinstance(exc, RunnerCrashed) or not isinstance(exc, Exception):
            e.crash(lane, f"the runner raised {kind}")
            for r in live:
                e.ledger.fail(r.handle, e.refusal())
            return
        width = batch.width
        if is_out_of_memory(exc):
            e.metrics.record_failure(lane, "oom")
            cap = e.caps.lower(lane, len(live), e.clock.now())
            e.apply_caps()
            if len(live) == 1:
                r = live[0]
                log.warning("out of memory on request %s alone (%d tokens)", r.id, r.length)
                msg = (
                    f"out of memory running this input alone ({r.length} tokens, padded to "
                    f"{width}); retry later or send a shorter input"
                )
                e.ledger.fail(r.handle, OutOfMemory(msg, retry_after=max(1.0, e.caps.cooldown_s)))
                return
            log.warning(
                "out of memory on a batch of %d x %d tokens (%s): splitting; bucket %s capped "
                "at %d for %g s",
                len(live),
                width,
                kind,
                e.lane_labels[lane],
                cap,
                e.caps.cooldown_s,
            )
        else:
            e.metrics.record_failure(lane, "error")
            self.failures_in_row += 1
            if self.failures_in_row >= e.recovery.probe_after_failures:
                if not await self._probe_ok():
                    e.crash(
                        lane,
                        f"{self.failures_in_row} model calls failed in a row ({kind}) and a "
                        "known-good probe input failed too",
                    )
                    for r in live:
                        e.ledger.fail(r.handle, e.refusal())
                    return
                self.failures_in_row = 0
            if len(live) == 1:
                r = live[0]
                log.warning("model failed on request %s (%d tokens): %s", r.id, r.length, kind)
                msg = f"the model failed on this input ({kind}); other inputs are unaffected"
                e.ledger.fail(r.handle, ModelFailed(msg))
                return
            log.warning("batch of %d failed (%s); bisecting", len(live), kind)
        mid = len(live) // 2
        for half in (live[:mid], live[mid:]):
            half = [r for r in half if not r.handle.finished]
            if not half:
                continue
            if e.state is EngineState.FAILED:
                for r in half:
                    e.ledger.fail(r.handle, e.refusal())
                continue
            await self._execute(lane, half, self.collate(half, pad_to), pad_to)

    async def _probe_ok(self) -> bool:
        """Run one fixed, known-good input: does the runner still work at all?"""
        e = self.engine
        ids = e.runner.tokenize([_PROBE_TEXT], True)[0]
        probe = self.pad([ids], None)
        try:
            await asyncio.get_running_loop().run_in_executor(self.executor, e.runner.embed, probe)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            log.error("probe input failed too (%s)", type(exc).__name__)
            return False
        log.info("probe input succeeded: the failures were the inputs', not the runner's")
        return True
