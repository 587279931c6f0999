"""The generation engine's schedule step: admit the prefill batches the decode policy has room
for, and pick the next unit.

`ScheduleStep` is the part of `GenerationEngine` (`generate.engine`) that runs first in each
turn of its loop (`_schedule`, named as in vLLM's `EngineCore.step()`): it asks the
embeddings' scheduler (`core.scheduler.schedule`: length buckets, max wait, token budget) for
batches within the room the policy gives, with the lanes' max wait cut by the time to the next
unit boundary, hands them to the `Decoder` as prefill jobs, and (under strategy adaptive) sheds
the queued requests that can no longer make their first token in time. It runs on the event
loop only; the engine inherits it and supplies the state it reads.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from lenbatch.core.clock import Clock
from lenbatch.core.lanes import SchedulerConfig
from lenbatch.core.queues import Queues
from lenbatch.core.scheduler import schedule
from lenbatch.generate.adaptive import AdaptiveGenPolicy, delivered, queued_requests
from lenbatch.generate.decode import Decoder
from lenbatch.generate.policy import DecodePolicy, Unit
from lenbatch.generate.streams import ticket_of
from lenbatch.serving.ledger import Ledger
from lenbatch.serving.messages import Delta
from lenbatch.serving.metrics import Metrics

__all__ = ["ScheduleStep", "Scheduled"]


@dataclass(frozen=True, slots=True)
class Scheduled:
    """What `_schedule` decided: the unit to run now (None: nothing to run), and when the
    scheduler wants to be asked again (None: only when woken)."""

    unit: Unit | None
    wake_at: float | None


class ScheduleStep:
    """`_schedule` of `GenerationEngine`: admission into prefill jobs and the next unit.

    The engine supplies the attributes below (its lanes, queues, ledger and metrics from
    `serving.engine.BaseEngine`; its decode policy, decoder and decode mode)."""

    cfg: SchedulerConfig
    clock: Clock
    queues: Queues
    ledger: Ledger[Delta]
    metrics: Metrics
    policy: DecodePolicy
    adaptive: AdaptiveGenPolicy | None
    decoder: Decoder
    mode: str
    _unit_s: float  # wall seconds of the last unit (the admission horizon)

    def _schedule(self, last: str | None) -> Scheduled:
        """Admit prefill batches if the decode policy has room; pick the next unit.

        Where one forward can carry several jobs' chunks (`Decoder.mixer`, continuous mode),
        every batch the scheduler has ready is admitted, one at a time while the room lasts:
        the policy packs them into a unit together. Elsewhere one batch is in flight at a
        time (jobs would run one after another anyway)."""
        wake_at = None
        room = self.policy.capacity(self.decoder)
        if self.adaptive is not None and self.queues.size > 0:
            self._shed_overdue(self.clock.now())
        if room > 0 and self.queues.size > 0:
            now = self.clock.now()
            horizon = self._horizon()
            while True:
                cfg = self._admission_config(room, horizon)
                if self._several_jobs:
                    cfg = dataclasses.replace(cfg, slots=self.queues.inflight_total + 1)
                decision = schedule(self.queues, now, cfg)
                for r in decision.expired:
                    self.ledger.expire(ticket_of(r.handle))
                for batch in decision.batches:
                    gens = [r.handle for r in batch.requests]
                    for g in gens:
                        g.timings.admitted = now
                        self.ledger.start(ticket_of(g), now)
                    self.decoder.add_job(batch.lane, gens, cfg.lanes[batch.lane].pad_to)
                wake_at = decision.wake_at
                room = self.policy.capacity(self.decoder)
                if not (self._several_jobs and decision.batches and room > 0 and self.queues.size):
                    break
            self.metrics.set_depths(self.queues.depths(), self.queues.inflight_total)
        if self.adaptive is not None:  # the stall each running row can take (chunk sizing)
            self.adaptive.observe_rows(self.clock.now(), delivered(self.decoder.rows))
        return Scheduled(self.policy.next_unit(self.decoder, last), wake_at)

    @property
    def _several_jobs(self) -> bool:
        """True when several admitted batches may wait for prefill at once (see _schedule)."""
        return (
            self.mode == "continuous" and self.adaptive is None and self.decoder.mixer is not None
        )

    def _horizon(self) -> float:
        """Seconds to the next chance to admit (see `_admission_config`): none for lockstep,
        unbounded for an idle engine, else the last unit's."""
        if self.mode != "continuous":
            return 0.0
        return math.inf if self.decoder.idle else self._unit_s

    def _admission_config(self, room: int, horizon: float) -> SchedulerConfig:
        """The scheduler's lanes for this turn: batches of at most `room` rows and, decoding
        continuously, a max wait cut by the time to the next chance to admit.

        Prompts can only join at a unit boundary. An idle engine admits at once (waiting for
        batch-mates gains nothing when there is no other work: the next arrivals join the
        running batch a unit later anyway); a busy one admits now the lanes whose max wait would
        run out before the next boundary, the next unit timed as the last. Without the cut, a
        prompt could wait its max wait plus a whole unit (10 ms + a 20-150 ms step) before it
        is admitted. Lockstep batches keep the plain max wait: nobody joins them later.
        """
        cfg = self.cfg
        if not any(p.max_batch > room or (horizon > 0 and p.max_wait > 0) for p in cfg.lanes):
            return cfg
        lanes = tuple(
            dataclasses.replace(
                p, max_batch=min(p.max_batch, room), max_wait=max(0.0, p.max_wait - horizon)
            )
            for p in cfg.lanes
        )
        return dataclasses.replace(cfg, lanes=lanes)

    def _shed_overdue(self, now: float) -> None:
        """adaptive: end the queued requests that can no longer make their first token in time
        (429/503 with Retry-After, through the ledger), so those behind them can."""
        assert self.adaptive is not None
        for r in self.adaptive.overdue(queued_requests(self.queues.lanes), now):
            self.queues.remove(r)
            late_by = now - (r.arrival + self.adaptive.slo.ttft(r.priority))
            err = self.adaptive.overloaded(max(late_by, 0.0), 0.0, now - r.arrival)
            self.metrics.record_shed("queue")
            self.ledger.shed(ticket_of(r.handle), err)
