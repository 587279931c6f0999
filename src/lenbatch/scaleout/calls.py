"""Calls from the ingress to the engine replicas: where each goes, and what happens when its
replica dies.

Every data call carries the group that owns its inputs' lengths (`group=`, for the request
router, `scaleout.router`; None when routing ignores length) and its estimated model seconds
(`cost=`, for the router's expected-wait spill). A call whose replica dies is sent again (the
router has dropped the dead replica, so it goes to another one, a spill if it was the group's
only replica), up to `attempts` times, unless what it already sent cannot be taken back (tokens
streamed to the client); then the caller gets an explicit 503 `replica_failed`, never silence.
Ray restarts the replica meanwhile.

An error a replica answers with (the replicas send errors as data, see `scaleout.replica`) is
passed on as it was: `RelayedError`.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Counter

from lenbatch.core.errors import LenbatchError, Unavailable

__all__ = [
    "RelayedError",
    "ReplicaCalls",
    "StreamCut",
    "is_replica_failure",
    "own_call_id",
]

log = logging.getLogger("lenbatch.scaleout")

R = TypeVar("R")


class RelayedError(LenbatchError):
    """An error a replica answered with, passed on to the client as it was."""

    def __init__(self, fields: dict[str, Any]) -> None:
        super().__init__(
            str(fields["message"]), retry_after=fields.get("retry_after"), code=fields["code"]
        )
        self.status = int(fields["status"])
        self.kind = str(fields["kind"])


class StreamCut(Exception):
    """A replica's stream ended without its last item: the replica went away mid-stream."""


def is_replica_failure(exc: BaseException) -> bool:
    """Whether `exc` says the replica (its actor) went away, rather than the request failing."""
    if isinstance(exc, StreamCut):
        return True
    from ray import exceptions as rex

    return isinstance(exc, rex.RayActorError | rex.ActorUnavailableError | rex.ActorDiedError)


def own_call_id() -> None:
    """Give the handle calls made from the current task their own internal request id.

    Ray gives every call made while handling one HTTP request the proxy's internal request id,
    and its base request router keys pending calls by that id: of two calls in flight at once
    (the groups of a multi-input request, or the figures of two replicas) one would never be
    sent. Ray's default router does not notice (its FIFO mixin hands replicas to the oldest
    pending call, whatever its id); a router that places each call on purpose does. Each call
    runs in its own task (so its own copy of the context): setting the id there is local to it.
    """
    import dataclasses
    import uuid

    from ray.serve import context as serve_context

    # Ray has no public call for this: its own request context is private (tested with 2.60).
    current = serve_context._get_serve_request_context()  # noqa: SLF001
    serve_context._serve_request_context.set(  # noqa: SLF001
        dataclasses.replace(current, _internal_request_id=uuid.uuid4().hex)
    )


class ReplicaCalls:
    """Sends calls to the replicas by length group, again on another replica when theirs dies,
    and counts what that took (`retries`; `failed`: calls answered 503 after all)."""

    def __init__(
        self, registry: CollectorRegistry, *, routing: str = "length", attempts: int = 3
    ) -> None:
        self.routing = routing
        self.attempts = attempts
        self.retries = 0
        self.failed = 0
        self._retries = Counter(
            "lenbatch_ray_retries",
            "Calls sent again after their replica died",
            registry=registry,
        )
        self._failed = Counter(
            "lenbatch_ray_failed_calls",
            "Calls answered 503 after every attempt met a dead replica",
            registry=registry,
        )

    def group(self, owner: int) -> int | None:
        """The `group=` a call owned by group `owner` carries (None: routing ignores length)."""
        return owner if self.routing == "length" else None

    async def send(
        self, attempt: Callable[[], Awaitable[R]], sent: Callable[[], int] = lambda: 0
    ) -> R:
        """`attempt()`'s result, calling it again when its replica dies, up to `attempts`
        times; `sent()` counts the tokens an attempt has already delivered (none may be sent
        twice, so then no retry). Raises the 503 `replica_failed` when no attempt is left."""
        last: BaseException | None = None
        for i in range(self.attempts):
            if i:
                self.retries += 1
                self._retries.inc()
                log.warning("replica died with a call in flight; sending it again")
            own_call_id()
            try:
                return await attempt()
            except Exception as exc:
                if not is_replica_failure(exc):
                    raise
                last = exc
            if n := sent():  # tokens went out: they cannot be taken back
                raise self.replica_failed(f"{n} tokens were sent", last)
        raise self.replica_failed(f"{self.attempts} attempts failed", last)

    def replica_failed(self, what: str, last: BaseException | None) -> Unavailable:
        """Count a call that met a dead replica and cannot be retried; the 503 to answer."""
        self.failed += 1
        self._failed.inc()
        return Unavailable(
            f"the replica serving this request died and {what} ({type(last).__name__}); "
            "retry shortly",
            retry_after=2.0,
            code="replica_failed",
        )
