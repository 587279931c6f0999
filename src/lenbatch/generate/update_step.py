"""The generation engine's update step: deliver what a unit produced, or end what its failure
cost.

`UpdateStep` is the part of `GenerationEngine` (`generate.engine`) that runs last in each turn
of its loop (`_update`, named as in vLLM's `EngineCore.step()`): it hands the new tokens to
their streams, ends finished generations through the ledger (`serving.ledger`), frees the
scheduler slots of batches done, and records the generation figures. Tokens a unit publishes
early from the worker (`Decoder.publish`) come through `_deliver_deltas` too. It runs on the
event loop only; the engine inherits it and supplies the state it reads.
"""

from __future__ import annotations

from lenbatch.core.clock import Clock
from lenbatch.core.queues import Queues
from lenbatch.generate.decode import Decoder
from lenbatch.generate.failures import Recovery
from lenbatch.generate.generation import Generation
from lenbatch.generate.jobs import UnitResult
from lenbatch.generate.metrics import LMMetrics
from lenbatch.generate.streams import ticket_of
from lenbatch.serving.ledger import Ledger
from lenbatch.serving.messages import Delta
from lenbatch.serving.metrics import Metrics

__all__ = ["UpdateStep"]


class UpdateStep:
    """`_update` of `GenerationEngine`: tokens to streams, endings to the ledger, figures.

    The engine supplies the attributes below (its queues, ledger and metrics from
    `serving.engine.BaseEngine`; its decoder and generation figures)."""

    clock: Clock
    queues: Queues
    ledger: Ledger[Delta]
    metrics: Metrics
    lm: LMMetrics
    decoder: Decoder

    def _update(self, executed: UnitResult | Recovery) -> None:
        """Event loop: deliver what a unit produced, or end what its failure cost."""
        if isinstance(executed, Recovery):
            self._recovered(executed)
        else:
            self._deliver(executed)
        self._publish_state()

    def _deliver(self, result: UnitResult) -> None:
        """Hand new tokens to their streams, end finished generations, free slots, record."""
        self._deliver_deltas(result.deltas)
        for lane in result.released_lanes:
            self.queues.batch_done(lane)
        prompt = result.prefill_tokens if result.kind == "mixed" else result.tokens
        self.lm.record_step(
            result.kind,
            result.compute_s,
            result.rows,
            result.tokens,
            result.padded,
            jobs=len(result.jobs),
            prompt_tokens=prompt,
        )
        for job in result.finished:
            for g in job.gens:
                ticket_of(g).exec_s = g.timings.prefill_compute or None
            b = job.batch
            self.metrics.record_batch(
                job.lane,
                job.rows,
                b.real_tokens,
                b.padded_tokens,
                job.gens[0].timings.prefill_compute,
                [g.timings.admitted - g.timings.queued for g in job.gens],
            )

    def _deliver_deltas(self, deltas: list[tuple[Generation, Delta]]) -> None:
        """Hand new tokens to their streams and end finished generations (on the event loop:
        at the end of a unit, or earlier for what `Decoder.publish` sent from the worker)."""
        now = self.clock.now()
        for gen, delta in deltas:
            ticket = ticket_of(gen)
            if ticket.finished:
                continue  # cancelled while the unit ran
            t = gen.timings
            gaps = []
            if not t.token_times:
                t.first_token = now
                self.lm.record_first_token(t.ttft, t.stages())
            else:
                gaps.append(now - t.token_times[-1])
            t.token_times.append(now)
            self.lm.record_tokens(len(delta.token_ids), gaps)
            if delta.finish_reason is None:
                gen.sink.put_nowait(delta)
            else:
                t.finished = now
                self.lm.record_finished(t.finished - t.arrival, gen.prompt_tokens)
                self.ledger.answer(ticket, delta)

    def _recovered(self, recovery: Recovery) -> None:
        """End the generations a failed unit cost, each with its error; free their slots."""
        if recovery.out_of_memory:
            self.lm.record_oom(recovery.kind)
        for gen, err in recovery.failed:
            self.ledger.fail(ticket_of(gen), err)
        for lane in recovery.released_lanes:
            self.queues.batch_done(lane)

    def _publish_state(self) -> None:
        d = self.decoder
        self.lm.set_state(
            d.kv_bytes(), d.kv_real_bytes(), d.kv_peak_bytes, d.running_rows, d.pending_rows
        )
        if d.shapes is not None:
            self.lm.set_compile(d.shapes.graphs.stats.as_dict())
        if d.prefixes is not None:
            self.lm.set_prefix_cache(d.prefixes.stats())
