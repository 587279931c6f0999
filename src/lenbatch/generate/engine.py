"""The generation engine: one asyncio loop that admits, schedules and steps a causal LM.

    submit ─► admission ─► queues ─► _schedule ─► _execute ─► _update ─► token streams
                                     (scheduler     (one unit   (deltas, endings,
                                      + policy)      in worker)  figures)

Each turn of the loop is one step, named as in vLLM's `EngineCore.step()`:

* `_schedule` (`generate.schedule_step`): admit the prefill batches the decode policy has room
  for, through `core.scheduler.schedule` (the embeddings' scheduler: length buckets, max wait,
  token budget, the same in both decode modes), and pick the next unit: a prefill chunk, a
  decode step, or (on the lean path) a decode step with the chunks of one or more prefill jobs
  in one forward;
* `_execute`: run that unit in the worker thread; a unit that raises is recovered from
  (`generate.failures`: bisect, split, preempt, or fail with an explicit error);
* `_update` (`generate.update_step`): hand the new tokens to their streams, end finished
  generations through the ledger, free scheduler slots, record. A unit that ends a prefill
  hands its tokens over earlier, from the worker (`Decoder.publish`), before the new rows' keys
  and values are copied into the running batch: no first token waits for that copy.

Queues and streams are only touched on the event loop; the running batch only in the worker, one
unit at a time. Every admitted request gets exactly one ending: its finish reason, or an explicit
error (`serving.ledger`). Submitting and streaming are `generate.streams`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import Any

from lenbatch.config import (
    AdaptiveConfig,
    AdmissionConfig,
    BatchingConfig,
    DecodeMode,
    GenerationConfig,
    Strategy,
)
from lenbatch.core.clock import Clock
from lenbatch.core.errors import BadInput, InputTooLong, LenbatchError
from lenbatch.core.lanes import resolve_lanes
from lenbatch.core.request import Request
from lenbatch.generate.adaptive import AdaptiveGenPolicy, door_state, queued_requests
from lenbatch.generate.costs import GenCosts
from lenbatch.generate.decode import Decoder
from lenbatch.generate.failures import Recovery, recover
from lenbatch.generate.generation import Generation, Timings
from lenbatch.generate.jobs import UnitResult
from lenbatch.generate.metrics import LMMetrics
from lenbatch.generate.policy import DecodePolicy, Unit, make_policy
from lenbatch.generate.prefixcache import PrefixCache
from lenbatch.generate.prompts import PromptCalls, Prompts
from lenbatch.generate.sampling import step_logprobs
from lenbatch.generate.schedule_step import ScheduleStep
from lenbatch.generate.shapes import make_fixed_shapes
from lenbatch.generate.streams import open_generation, ticket_of, token_texts_of
from lenbatch.generate.update_step import UpdateStep
from lenbatch.runners.base import CausalRunner
from lenbatch.serving.engine import BaseEngine
from lenbatch.serving.lengthlog import LengthLog
from lenbatch.serving.messages import Delta, SamplingParams, TokenLogprob
from lenbatch.serving.services import params_per_prompt
from lenbatch.serving.streams import DeltaStreams
from lenbatch.serving.workers import run_in_worker

__all__ = ["GenerationEngine"]

log = logging.getLogger("lenbatch.generate")


class GenerationEngine(
    ScheduleStep, UpdateStep, PromptCalls, DeltaStreams[Generation], BaseEngine[Delta]
):
    """Length-bucketed admission and lockstep or continuous decoding in front of a causal LM."""

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
        fixed_shapes: bool | None = None,
        adaptive: AdaptiveConfig | None = None,
    ) -> None:
        self.runner = runner
        self.info = runner.info
        self.batching = batching or BatchingConfig()
        self.generation = generation or GenerationConfig()
        # A prompt leaves room for at least one generated token.
        self.prompt_limit = self.info.max_length - 1
        lanes = resolve_lanes(self.batching, self.prompt_limit)
        # One prefill batch in flight at a time, unless one forward can carry several jobs'
        # chunks (`_schedule` then admits one more at a time while the room lasts).
        lanes = dataclasses.replace(lanes, cfg=dataclasses.replace(lanes.cfg, slots=1))
        label = lanes.cfg.strategy.value
        is_adaptive = lanes.cfg.strategy is Strategy.ADAPTIVE
        self.adaptive: AdaptiveGenPolicy | None = None
        if is_adaptive:
            # generate.adaptive decides admission; the queues and the scheduler run bucketed.
            lanes = dataclasses.replace(
                lanes, cfg=dataclasses.replace(lanes.cfg, strategy=Strategy.BUCKETED)
            )
        # adaptive decodes continuously whatever `generation.mode` says
        self.mode = "continuous" if is_adaptive else self.generation.mode.value
        super().__init__(
            lanes,
            admission,
            clock,
            metrics_label=f"{label}+{self.mode}",
            workers=1,
            name="lenbatch-decode",
            # one unit at a time on every torch thread: on the thread the model was loaded on
            torch_thread=True,
            length_log=length_log,
        )
        self.policy: DecodePolicy = make_policy(self.generation, self.batching.max_batch)
        if is_adaptive:
            acfg = adaptive or AdaptiveConfig()
            # Priced by real prompt tokens where padding runs through no product; fixed
            # shapes run whole padded prompts, as transformers' forward does.
            real = bool(getattr(runner, "prefill_skips_padding", False))
            fixed = self.generation.compile or bool(fixed_shapes)
            costs = GenCosts(self.info.name, acfg.cost_window, real_tokens=real and not fixed)
            self.adaptive = AdaptiveGenPolicy(self.generation, acfg, costs)
            self.policy = self.adaptive
        self.prompts = Prompts(runner, self.info, self.generation)
        self.lm = LMMetrics()
        # Fixed shapes follow `generation.compile`; `fixed_shapes=True` runs them eager (to
        # check or measure the padding alone).
        shapes = None
        if self.generation.compile or fixed_shapes:
            shapes = make_fixed_shapes(
                runner,
                tuple(p.upper for p in lanes.cfg.lanes),
                self._max_rows(),
                self.generation.compile_max_width,
                compile=self.generation.compile,
            )
        mb = self.generation.prefix_cache_mb
        self.decoder = Decoder(
            runner,
            self.clock.now,
            self.policy.release_on_merge,
            shapes,
            self._max_rows(),
            PrefixCache(mb << 20) if mb else None,
        )
        self._unit_s = 0.0  # wall seconds of the last unit (the admission horizon)

    def _max_rows(self) -> int:
        """Most generations decoding at once: the running cap, or one scheduler batch."""
        if self.generation.mode is DecodeMode.CONTINUOUS:
            return self.generation.max_running
        return self.batching.max_batch

    # ------------------------------------------------------------------ lifecycle hooks

    async def _warm_up(self) -> None:
        warm_up = getattr(self.runner, "warm_up", None)
        if callable(warm_up):
            started = time.monotonic()
            await asyncio.get_running_loop().run_in_executor(self._executor, warm_up)
            log.info("model warmed up in %.2f s", time.monotonic() - started)
        shapes = self.decoder.shapes
        if shapes is not None and shapes.graphs.stats.compiled:
            started = time.monotonic()
            n = await asyncio.get_running_loop().run_in_executor(self._executor, shapes.warm_up)
            log.info("compiled %d fixed shapes in %.1f s", n, time.monotonic() - started)

    def _release(self) -> None:
        self.prompts.close()
        super()._release()

    def _on_drain(self) -> None:
        # Nobody will join partial batches any more: flush them now.
        lanes = tuple(dataclasses.replace(p, max_wait=0.0) for p in self.cfg.lanes)
        self.cfg = dataclasses.replace(self.cfg, lanes=lanes)

    def describe(self) -> str:
        """One line for the start-up log: strategy, decode mode, prefix cache and lanes."""
        prefixes = self.decoder.prefixes
        cache = f"prefix cache {prefixes.max_bytes >> 20} MiB" if prefixes else "no prefix cache"
        line = f"decode {self.mode}, {cache}, {super().describe()}"
        if self.adaptive is not None:
            # the lanes run bucketed; adaptive decides room, chunks and admission
            slo = self.adaptive.slo
            ttft = "/".join(f"{t * 1000:g}" for t in slo.ttft_s)
            line = line.replace("strategy bucketed", "strategy adaptive (lanes bucketed)", 1)
            line += f"; adaptive: TTFT {ttft} ms, inter-token {slo.itl_s * 1000:g} ms"
        return line

    def _extra_stats(self) -> dict[str, Any]:
        out = self.lm.stats()
        out["decode_mode"] = self.mode
        out["preempted_rows"] = self.decoder.preempted
        if self.decoder.prefixes is None:
            out["prefix_cache"] = {"enabled": False}
        shapes = self.decoder.shapes
        out["compile"] = shapes.graphs.stats.as_dict() if shapes else {"enabled": False}
        if self.adaptive is not None:
            out["adaptive"] = self.adaptive.describe(self.clock.now())
        return out

    def _extra_prometheus(self) -> bytes:
        return self.lm.prometheus()

    def refresh_memory(self) -> None:
        """Weights, activations and KV cache, kept apart (activations = peak above weights
        minus the KV cache's peak, an estimate on CPU where only the process RSS is known)."""
        mem = self.runner.memory()
        activations = max(0, mem.peak_activations - self.decoder.kv_peak_bytes)
        self.metrics.set_memory(mem.weights, activations, mem.device)

    # ------------------------------------------------------------------ submitting

    def submit_all(
        self,
        prompts: list[list[int]],
        params: SamplingParams | Sequence[SamplingParams],
        *,
        arrival: float | None = None,
        timeout: float | None = None,
        priority: int = 0,
    ) -> list[Generation]:
        """Queue every prompt of one call (`params`: one for all, or one per prompt); if one
        is refused, withdraw the others."""
        levels = self.adaptive.slo.levels if self.adaptive is not None else 1
        if isinstance(priority, bool) or not 0 <= priority < levels:
            allowed = (
                "0 (this server has one priority level: strategy adaptive with "
                "--priority-levels N has more)"
                if levels == 1
                else f"an integer in [0, {levels - 1}] (higher runs first)"
            )
            raise BadInput(f"priority must be {allowed}; got {priority!r}", code="invalid_priority")
        gens: list[Generation] = []
        try:
            for p, sp in zip(prompts, params_per_prompt(prompts, params), strict=True):
                gen = self.submit(p, sp, arrival=arrival, timeout=timeout, priority=priority)
                gens.append(gen)
        except LenbatchError:
            for g in gens:
                self.cancel(g)
            raise
        return gens

    async def prompt_logprobs(self, prompt: list[int], top: int) -> list[TokenLogprob]:
        """Each token of a checked `prompt` with its log-probability given the tokens before
        it and its `top` most likely alternatives (the first: None), for `echo`: one
        transformers forward of the prompt in the worker thread, between units."""
        return await run_in_worker(self._executor, self._prompt_logprobs, prompt, top)

    def _prompt_logprobs(self, prompt: list[int], top: int) -> list[TokenLogprob]:
        scorer = getattr(self.runner, "prompt_logits", None)
        if scorer is None:
            raise BadInput(f"model {self.info.name} cannot give a prompt's log-probabilities")
        steps = step_logprobs(scorer(prompt), prompt[1:], [top] * (len(prompt) - 1))
        texts = token_texts_of(self.runner)
        out = [TokenLogprob(prompt[0], texts([prompt[0]])[0], None)]
        for token, (own, alternatives) in zip(prompt[1:], steps, strict=True):
            names = texts([token, *(i for i, _ in alternatives)])
            tops = tuple((i, n, lp) for (i, lp), n in zip(alternatives, names[1:], strict=True))
            out.append(TokenLogprob(token, names[0], own, tops))
        return out

    def submit(
        self,
        prompt: list[int],
        params: SamplingParams,
        *,
        arrival: float | None = None,
        timeout: float | None = None,
        priority: int = 0,
    ) -> Generation:
        """Queue one tokenized prompt; returns its `Generation` to pass to `stream()`.

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
        cached = 0
        if refusal is None and self.adaptive is not None:
            waited = 0.0 if arrival is None else now - arrival
            prefixes = self.decoder.prefixes
            cached = prefixes.peek(prompt) if prefixes is not None else 0
            refusal = self._priced_refusal(len(prompt), priority, waited, cached)
            if refusal is not None:
                self.metrics.record_shed("admission")
        if refusal is not None:
            self.metrics.record_rejection(refusal.code)
            raise refusal
        timeout = timeout if timeout is not None else self.request_timeout
        deadline = None if timeout is None else now + timeout
        request: Request[Generation] = Request(
            len(prompt), now, list(prompt), deadline=deadline, priority=priority
        )
        timings = Timings(arrival=now if arrival is None else min(arrival, now), queued=now)
        gen = open_generation(request, params, self.runner, timings)
        gen.cached_tokens = cached  # adaptive prices its queue by it; its job says for sure
        self.queues.push(request)
        self.ledger.admit([ticket_of(gen)])
        self._kick()
        return gen

    def _priced_refusal(
        self, length: int, priority: int, waited: float, cached: int = 0
    ) -> LenbatchError | None:
        """adaptive: the refusal of a prompt of `length` tokens (`cached` of them in the prefix
        cache) predicted to miss its TTFT objective, or None."""
        assert self.adaptive is not None
        d = self.decoder
        rows, pending_tokens, pending_rows = door_state(d.rows, d.jobs)
        queued = queued_requests(self.queues.lanes)
        return self.adaptive.refusal(
            length - cached,
            priority,
            max(0.0, waited),
            queued,
            pending_tokens,
            rows,
            pending_rows,
            now=self.clock.now(),
            lane=self.queues.lane_of(length),
        )

    # ------------------------------------------------------------------ the loop

    async def _loop(self) -> None:
        assert self._wakeup is not None
        loop = asyncio.get_running_loop()

        def publish(deltas: list[tuple[Generation, Delta]]) -> None:
            # worker thread: the callback runs before the unit's own result is handed over
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits
                loop.call_soon_threadsafe(self._deliver_deltas, deltas)

        self.decoder.publish = publish
        last: str | None = None  # the kind of the unit run last
        # the last unit: when it started and its forward's seconds (None: idle since, or failed)
        previous: tuple[float, float] | None = None
        while True:
            self._wakeup.clear()
            scheduled = self._schedule(last)
            if scheduled.unit is None:
                last, previous = None, None
                self._publish_state()
                await self._sleep_until_woken(scheduled.wake_at)
                continue
            started = self.clock.now()
            if previous is not None and last is not None:
                self.lm.record_turn(last, started - previous[0], previous[1])
            executed = await self._execute(scheduled.unit)
            self._unit_s = self.clock.now() - started
            last = executed.kind if isinstance(executed, UnitResult) else None
            previous = (started, executed.compute_s) if isinstance(executed, UnitResult) else None
            self._update(executed)
            if self.adaptive is not None and isinstance(executed, UnitResult):
                # the whole turn (thread hand-off, delivery, HTTP on the same cores) is what a
                # stream sees between tokens: it keeps the cost models honest
                self.adaptive.costs.observe(executed, self.clock.now() - started)

    async def _execute(self, unit: Unit) -> UnitResult | Recovery:
        """Run `unit` in the worker thread; if it raises, recover (on the event loop, the
        worker being idle then)."""
        budget = self.budget  # several models in one process: take a turn on the CPU
        turn = None if budget is None else await budget.acquire(0, 0.0, self.budget_owner)
        try:
            return await run_in_worker(self._executor, self._run, unit)
        except Exception as exc:
            return recover(self.decoder, unit, exc)
        finally:
            if budget is not None and turn is not None:
                budget.release(turn)

    def _run(self, unit: Unit) -> UnitResult:
        """Worker thread: run one unit."""
        if unit.kind == "decode":
            return self.decoder.decode()
        assert unit.job is not None
        if unit.kind == "mixed":
            return self.decoder.mixed(unit.job, unit.cols, unit.more)
        return self.decoder.prefill(unit.job, unit.cols, unit.more)
