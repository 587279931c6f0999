"""The lifecycle every front-end shares: states, the ledger of admitted requests, the refusals,
and the ordered shutdown.

    NEW ─start()─► RUNNING ─begin_drain()─► DRAINING ─stop()─► STOPPED
                      └──── runner crash ───► FAILED ──stop()──┘

`Lifecycle` is what the embedding engine, the generation engine and the Ray ingress have in
common: a state machine; a `Ledger` that ends every admitted request exactly once; refusals
(503 `shutting_down` while draining, 503 `runner_failed` after a crash); and a shutdown that
first refuses new work, then waits for every admitted request to be answered (up to a timeout,
then answers what is left with 503), and only then stops. The engines add their lanes, loop and
worker threads on top (`lenbatch.serving.engine.BaseEngine`); the routes read a front-end
through `lenbatch.serving.services.Service`.
"""

from __future__ import annotations

import logging
from enum import StrEnum
from typing import Generic, TypeVar

from lenbatch.core.errors import Unavailable, drain_timed_out
from lenbatch.core.errors import draining as draining_error
from lenbatch.serving.ledger import Ledger

__all__ = ["EngineState", "Lifecycle"]

log = logging.getLogger("lenbatch.serving.lifecycle")

T = TypeVar("T")


class EngineState(StrEnum):
    """Lifecycle of a front-end (an engine or the Ray ingress)."""

    NEW = "new"
    RUNNING = "running"
    DRAINING = "draining"  # shutting down: no new requests, admitted ones still answered
    FAILED = "failed"  # the runner crashed: nothing more can be served
    STOPPED = "stopped"


class Lifecycle(Generic[T]):
    """State machine, ledger and shutdown of one front-end; `T` is what its ledger answers
    with (a vector, a generated delta, a whole call's answer).

    Subclasses hook in: `_prepare` (before the state turns RUNNING, e.g. a warm-up),
    `_started` (right after), `_on_drain` (draining began), `_on_drain_timeout` (before what is
    left is answered 503), `_halt` (after the drain: stop loops and threads) and `_release`
    (once stopped: close what is left).
    """

    def __init__(self, ledger: Ledger[T]) -> None:
        self.ledger = ledger
        self._state = EngineState.NEW
        self._failure: str | None = None

    # ------------------------------------------------------------------ hooks

    async def _prepare(self) -> None:
        """Before the state turns RUNNING; nothing by default."""

    def _started(self) -> None:
        """Right after the state turned RUNNING; nothing by default."""

    def _on_state(self, state: EngineState) -> None:
        """The state changed (e.g. to publish readiness); nothing by default."""

    def _on_drain(self) -> None:
        """Draining began: nobody will join partial batches any more; nothing by default."""

    def _on_drain_timeout(self) -> None:
        """The drain timed out, before what is left is answered 503; nothing by default."""

    async def _halt(self) -> None:
        """After the drain: stop loops and worker threads; nothing by default."""

    def _release(self) -> None:
        """Stopped, every request answered: release what is left; nothing by default."""

    # ------------------------------------------------------------------ state

    @property
    def state(self) -> EngineState:
        """Where the front-end is in its lifecycle."""
        return self._state

    @property
    def failure(self) -> str | None:
        """Why the runner was declared crashed (None unless FAILED)."""
        return self._failure

    @property
    def ready(self) -> bool:
        """True while the front-end accepts work."""
        return self._state is EngineState.RUNNING

    @property
    def unanswered(self) -> int:
        """Admitted requests not answered yet."""
        return self.ledger.unanswered

    async def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until every admitted request has been answered; False if `timeout` seconds
        passed first."""
        return await self.ledger.wait_idle(timeout)

    def _set_state(self, state: EngineState) -> None:
        self._state = state
        self._on_state(state)

    def refusal(self) -> Unavailable:
        """The 503 for a request this front-end cannot take in its current state."""
        if self._state is EngineState.DRAINING:
            return draining_error()
        if self._state is EngineState.FAILED:
            return Unavailable(
                f"the model runner has failed ({self._failure}); this server must be restarted",
                retry_after=5.0,
                code="runner_failed",
            )
        return Unavailable(f"server is {self._state.value}; not accepting requests")

    def check_running(self) -> None:
        """Raise `refusal()` unless the front-end accepts work now."""
        if self._state is not EngineState.RUNNING:
            raise self.refusal()

    def _declare_failed(self, reason: str) -> bool:
        """Declare the runner crashed; False if the front-end had already failed or stopped."""
        if self._state in (EngineState.FAILED, EngineState.STOPPED):
            return False
        self._failure = reason
        self._set_state(EngineState.FAILED)
        return True

    # ------------------------------------------------------------------ start and shutdown

    async def start(self) -> None:
        """Start serving (on the running event loop)."""
        if self._state is not EngineState.NEW:
            raise RuntimeError(f"already {self._state.value}")
        await self._prepare()
        self._set_state(EngineState.RUNNING)
        self._started()

    def begin_drain(self) -> None:
        """Refuse new requests (503) from now on and run queued ones without waiting for
        their batches to fill. Idempotent; `stop()` finishes the shutdown."""
        if self._state is not EngineState.RUNNING:
            return
        self._set_state(EngineState.DRAINING)
        log.info("draining: %d admitted requests unanswered", self.unanswered)
        self._on_drain()

    async def drain(self, timeout: float | None = 30.0) -> None:
        """Refuse new requests and wait up to `timeout` seconds for every admitted one to be
        answered; answer whatever is left with 503. Loops keep running."""
        self.begin_drain()
        if await self.wait_idle(timeout):
            return
        log.warning("drain timeout of %s s passed: answering %d with 503", timeout, self.unanswered)
        self._on_drain_timeout()
        self.ledger.abandon(drain_timed_out(timeout))

    async def stop(self, timeout: float | None = 30.0) -> None:
        """`drain(timeout)`, then stop loops and threads. Nothing admitted is dropped
        silently."""
        if self._state in (EngineState.NEW, EngineState.STOPPED):
            self._set_state(EngineState.STOPPED)
            self._release()
            self.ledger.close()
            return
        await self.drain(timeout)
        await self._halt()
        self._set_state(EngineState.STOPPED)
        self._release()
        self.ledger.close()
