"""The lifecycle both engines share: states, lanes, the loop and its wake-up, the worker threads,
the ordered shutdown, the refusals and the one deadline error.

    NEW ─start()─► RUNNING ─begin_drain()─► DRAINING ─stop()─► STOPPED
                      └──── runner crash ───► FAILED ──stop()──┘

`BaseEngine` owns what is the same in the embedding and the generation engine: the resolved
lanes with their queues, admission rules and metrics; the state machine; the scheduling loop task
and the event that wakes it; the worker threads the model runs in; and a shutdown that first
refuses new work (503 `shutting_down`), then answers every admitted request, then stops the loop.
A subclass supplies its loop, how to tell it is idle, and how to answer what is left when the
drain times out. `Servable` is what the HTTP shell (`lenbatch.serving.http`) reads of an engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from concurrent.futures import ThreadPoolExecutor
from enum import StrEnum
from typing import Any, Protocol

from lenbatch.config import AdmissionConfig
from lenbatch.core.admission import Admission
from lenbatch.core.clock import Clock, MonotonicClock
from lenbatch.core.errors import DeadlineExceeded, LenbatchError, Unavailable, drain_timed_out
from lenbatch.core.errors import draining as draining_error
from lenbatch.core.lanes import Lanes
from lenbatch.core.queues import Queues
from lenbatch.core.request import Request
from lenbatch.serving.metrics import Metrics

__all__ = ["BaseEngine", "EngineState", "Servable", "wait_set"]

log = logging.getLogger("lenbatch.serving.lifecycle")


async def wait_set(event: asyncio.Event, timeout: float | None) -> bool:
    """Wait until `event` is set; False if `timeout` seconds passed first."""
    if event.is_set():
        return True
    try:
        await asyncio.wait_for(event.wait(), timeout)
    except TimeoutError:
        return False
    return True


class EngineState(StrEnum):
    """Lifecycle of an engine."""

    NEW = "new"
    RUNNING = "running"
    DRAINING = "draining"  # shutting down: no new requests, admitted ones still answered
    FAILED = "failed"  # the runner crashed: nothing more can be served
    STOPPED = "stopped"


class Servable(Protocol):
    """What the HTTP shell needs from an engine (embedding or generation)."""

    @property
    def state(self) -> EngineState:
        """Where the engine is in its lifecycle."""
        ...

    @property
    def failure(self) -> str | None:
        """Why the runner was declared crashed, if it was."""
        ...

    @property
    def ready(self) -> bool:
        """True while the engine accepts work."""
        ...

    @property
    def unanswered(self) -> int:
        """Admitted requests not answered yet."""
        ...

    async def start(self) -> None:
        """Start the loop on the running event loop."""
        ...

    async def drain(self, timeout: float | None = 30.0) -> None:
        """Refuse new requests; answer every admitted one within `timeout` seconds."""
        ...

    async def stop(self, timeout: float | None = 30.0) -> None:
        """Drain, then stop the loop and the worker threads."""
        ...

    def describe(self) -> str:
        """One line for the start-up log: strategy and lanes."""
        ...

    def stats(self) -> dict[str, Any]:
        """The JSON summary `GET /stats` answers with."""
        ...

    def prometheus(self) -> bytes:
        """The Prometheus exposition `GET /metrics` answers with."""
        ...


class BaseEngine:
    """Lanes, state machine, loop task, worker threads and shutdown of one engine."""

    # Join the worker threads on stop (a unit still running in them finishes first).
    _join_workers_on_stop = False

    def __init__(
        self,
        lanes: Lanes,
        admission: AdmissionConfig | None,
        clock: Clock | None,
        *,
        metrics_label: str,
        workers: int,
        name: str,
    ) -> None:
        self.clock: Clock = clock or MonotonicClock()
        self.cfg = lanes.cfg  # what the scheduler runs with now (subclasses may narrow it)
        self.lane_labels = list(lanes.labels)
        self.uses_default_boundaries = lanes.default_boundaries
        self.queues = Queues(lanes.cfg)
        self.metrics = Metrics(self.lane_labels, metrics_label)
        admission = admission or AdmissionConfig()
        self.admission = Admission(admission, lanes.cfg, self.clock.now())
        self.request_timeout = admission.request_timeout_s
        self._state = EngineState.NEW
        self._failure: str | None = None
        self._name = name
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)
        self._wakeup: asyncio.Event | None = None
        self._loop_task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ what subclasses supply

    async def _loop(self) -> None:
        """The scheduling loop; runs until cancelled."""
        raise NotImplementedError

    @property
    def unanswered(self) -> int:
        """Admitted requests not answered yet."""
        raise NotImplementedError

    async def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until every admitted request has been answered; False if `timeout` passed."""
        raise NotImplementedError

    def _abandon(self, err: LenbatchError) -> None:
        """Answer every admitted, unanswered request with `err` (the drain timed out)."""
        raise NotImplementedError

    async def _warm_up(self) -> None:
        """Before the loop starts (e.g. a first forward pass); nothing by default."""

    def _on_drain(self) -> None:
        """Draining began: nobody will join partial batches any more; flush them."""

    def _on_stop(self) -> None:
        """The loop has stopped and every request is answered: release what is left."""

    def refresh_memory(self) -> None:
        """Read the runner's memory into the metrics."""

    def _extra_stats(self) -> dict[str, Any]:
        """Engine-specific keys of `stats()`."""
        return {}

    def _extra_prometheus(self) -> bytes:
        """Engine-specific series after the shared ones."""
        return b""

    # ------------------------------------------------------------------ lifecycle

    @property
    def state(self) -> EngineState:
        """Where the engine is in its lifecycle."""
        return self._state

    @property
    def failure(self) -> str | None:
        """Why the runner was declared crashed (None unless FAILED)."""
        return self._failure

    @property
    def ready(self) -> bool:
        """True while the engine accepts work."""
        return self._state is EngineState.RUNNING

    def _set_state(self, state: EngineState) -> None:
        self._state = state
        self.metrics.set_ready(state is EngineState.RUNNING)

    async def start(self) -> None:
        """Start the scheduling loop on the running event loop."""
        if self._state is not EngineState.NEW:
            raise RuntimeError(f"engine already {self._state.value}")
        await self._warm_up()
        self._wakeup = asyncio.Event()
        self._set_state(EngineState.RUNNING)
        self._loop_task = asyncio.create_task(self._loop(), name=self._name)
        self.refresh_memory()

    def begin_drain(self) -> None:
        """Refuse new requests (503) from now on and run queued ones without waiting for
        their batches to fill. Idempotent; `stop()` finishes the shutdown."""
        if self._state is not EngineState.RUNNING:
            return
        self._set_state(EngineState.DRAINING)
        log.info("draining: %d admitted requests unanswered", self.unanswered)
        self._on_drain()
        self._kick()

    async def drain(self, timeout: float | None = 30.0) -> None:
        """Refuse new requests and wait up to `timeout` seconds for every admitted one to be
        answered; answer whatever is left with 503. The loop keeps running."""
        self.begin_drain()
        if await self.wait_idle(timeout):
            return
        log.warning("drain timeout of %s s passed: answering %d with 503", timeout, self.unanswered)
        self.queues.drain()
        self._abandon(drain_timed_out(timeout))

    async def stop(self, timeout: float | None = 30.0) -> None:
        """`drain(timeout)`, then stop the loop and the worker threads. Nothing admitted is
        dropped silently."""
        if self._state in (EngineState.NEW, EngineState.STOPPED):
            self._set_state(EngineState.STOPPED)
            self._executor.shutdown(wait=False)
            return
        await self.drain(timeout)
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        self._set_state(EngineState.STOPPED)
        self._executor.shutdown(wait=self._join_workers_on_stop)
        self._on_stop()

    def _fail_runner(self, reason: str) -> bool:
        """Declare the runner crashed; False if the engine had already failed or stopped."""
        if self._state in (EngineState.FAILED, EngineState.STOPPED):
            return False
        self._failure = reason
        self._set_state(EngineState.FAILED)
        return True

    def refusal(self) -> Unavailable:
        """The 503 for a request this engine cannot take in its current state."""
        if self._state is EngineState.DRAINING:
            return draining_error()
        if self._state is EngineState.FAILED:
            return Unavailable(
                f"the model runner has failed ({self._failure}); this server must be restarted",
                retry_after=5.0,
                code="runner_failed",
            )
        return Unavailable(f"server is {self._state.value}; not accepting requests")

    def _kick(self) -> None:
        if self._wakeup is not None:
            self._wakeup.set()

    async def _sleep_until_woken(self, wake_at: float | None) -> None:
        """Wait for the wake-up event, or until clock time `wake_at` if given."""
        assert self._wakeup is not None
        timer = None
        if wake_at is not None:
            delay = max(0.0, wake_at - self.clock.now())
            timer = asyncio.get_running_loop().call_later(delay, self._wakeup.set)
        await self._wakeup.wait()
        if timer is not None:
            timer.cancel()

    def expired_error(self, r: Request) -> DeadlineExceeded:
        """The 504 for a request whose deadline passed before it ran (both engines)."""
        assert r.deadline is not None
        waited = self.clock.now() - r.arrival
        return DeadlineExceeded(
            f"request timeout of {r.deadline - r.arrival:.3f} s passed after {waited:.3f} s "
            "waiting; it was dropped before running"
        )

    # ------------------------------------------------------------------ what the routes read

    def describe(self) -> str:
        """One line for the start-up log: strategy and lanes (saying when the boundaries are
        the placeholder default rather than fitted to traffic)."""
        line = f"strategy {self.cfg.strategy.value}"
        if self.cfg.boundaries:
            line += (
                f": boundaries {list(self.cfg.boundaries)} + overlong lane up to "
                f"{self.cfg.max_length}"
            )
        if self.uses_default_boundaries:
            line += (
                " (the default for this model, not fitted to your traffic: run `lenbatch fit` "
                "on a trace or length log and pass --boundaries)"
            )
        return line

    def stats(self) -> dict[str, Any]:
        """JSON summary: waste, latency percentiles, per-bucket figures, state, lanes."""
        self.refresh_memory()
        out = self.metrics.stats()
        out["state"] = self._state.value
        out["boundaries"] = list(self.cfg.boundaries)
        out["default_boundaries"] = self.uses_default_boundaries
        out["queue_depths"] = self.queues.depths()
        out["unanswered"] = self.unanswered
        out.update(self._extra_stats())
        return out

    def prometheus(self) -> bytes:
        """Prometheus exposition: the per-bucket series, then the engine's own."""
        self.refresh_memory()
        return self.metrics.prometheus() + self._extra_prometheus()
