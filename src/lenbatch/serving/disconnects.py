"""Noticing that a waiting caller went away, without a task per request.

A route that waits on the engine must learn that its client disconnected, so the request
leaves the queue before it costs compute. Racing the work against a watcher task costs two
tasks, a wait and a cancellation per request, on the event loop that also parses HTTP. Here
the route awaits its work in its own task, and one sweeper per event loop looks at every
waiting request's connection now and then: it runs the ASGI `receive` one step without
blocking (after the body has been read, the only message left is `http.disconnect`), and
cancels the route's task when the connection is gone. The sweeper runs only while requests
wait, and looks less often the more there are, so its cost stays near 1 ms of CPU per second
whatever the load; a disconnect is noticed within `interval_s` (longer at great depths, where
queue waits are long anyway).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine, MutableMapping
from typing import Any, TypeVar

__all__ = ["DisconnectSweeper", "receive_now"]

T = TypeVar("T")
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]

_PROBE_S = 2e-6  # about what one look at a connection costs, seconds of CPU
_BUDGET = 0.001  # the sweeper's CPU per second of wall time it aims at, at most


def receive_now(receive: Receive) -> MutableMapping[str, Any] | None:
    """The next ASGI message if `receive` has one ready, else None, without blocking: runs
    the receive coroutine one step and closes it if it would wait (the server's waiter is
    removed as it closes)."""
    coro = receive()
    if not isinstance(coro, Coroutine):  # an awaitable that is not a coroutine: cannot peek
        return None
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    coro.close()
    return None


class DisconnectSweeper:
    """One loop's waiting requests, checked for a closed connection every `interval_s`."""

    def __init__(self, interval_s: float = 0.05) -> None:
        self.interval_s = interval_s
        self._waiting: dict[asyncio.Task[Any], Receive] = {}
        self._gone: set[asyncio.Task[Any]] = set()
        self._sweeper: asyncio.Task[None] | None = None

    async def run(self, receive: Receive, work: Coroutine[Any, Any, T]) -> T | None:
        """Await `work` in the calling task unless the client goes away first: then `work` is
        cancelled (its requests leave the queue), the cancellation runs, and None comes back.
        Exceptions of `work` propagate; a cancellation from elsewhere is not swallowed."""
        me = asyncio.current_task()
        assert me is not None, "run() is called from a task"
        self._waiting[me] = receive
        loop = asyncio.get_running_loop()
        if self._sweeper is None or self._sweeper.done() or self._sweeper.get_loop() is not loop:
            self._sweeper = loop.create_task(self._sweep())
        try:
            return await work
        except asyncio.CancelledError:
            if me in self._gone and me.uncancel() == 0:
                return None  # our own cancellation: the client left
            raise
        finally:
            self._waiting.pop(me, None)
            self._gone.discard(me)

    @property
    def waiting(self) -> int:
        """Requests whose connection is being watched."""
        return len(self._waiting)

    async def _sweep(self) -> None:
        try:
            while self._waiting:
                # Fewer looks the more requests wait: their probes stay within the budget.
                n = len(self._waiting)
                await asyncio.sleep(max(self.interval_s, n * _PROBE_S / _BUDGET))
                self.sweep()
        finally:
            if self._sweeper is asyncio.current_task():
                self._sweeper = None

    def sweep(self) -> int:
        """Look at every waiting request's connection once; cancel those whose client left.
        Returns how many were cancelled."""
        cancelled = 0
        for task, receive in list(self._waiting.items()):
            if task in self._gone or task.done():
                continue
            try:
                message = receive_now(receive)
            except Exception:  # a receive that fails is a connection that is gone
                message = {"type": "http.disconnect"}
            if message is not None and message.get("type") == "http.disconnect":
                self._gone.add(task)
                task.cancel()
                cancelled += 1
        return cancelled
