"""The routing board: what the request router and the ingress share inside the ingress process.

Ray builds the request router itself, inside the deployment handle the ingress holds, from a
class path and keyword arguments; the ingress never gets a reference to it. Both live in the
same process, though (the router runs on the handle's event loop, possibly another thread), so
they meet here: a board per engine deployment, found by name. The router writes which replica
belongs to which group, every routing decision and spill, and the calls in flight per replica;
the ingress reads them for `/stats` and `/metrics` and to fan control calls out to each replica.

No Ray import here: the board is plain data behind a lock, tested without a cluster.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable
from typing import Any

from lenbatch.core.ranges import assign_groups, rank_replicas

__all__ = ["RoutingBoard", "board_for"]


class RoutingBoard:
    """Replica groups, in-flight calls and routing counters of one engine deployment."""

    def __init__(self, groups: int) -> None:
        self.groups_count = groups
        self._lock = threading.Lock()
        self._groups: dict[str, int] = {}
        self._inflight: Counter[str] = Counter()
        self._waits: dict[str, float] = {}  # replica -> model seconds in flight (estimated)
        self._calls: dict[str, tuple[str, float]] = {}  # Ray's request id -> (replica, cost)
        self._routed: Counter[tuple[int, str]] = Counter()  # (owner group, replica) -> calls
        self._inputs: Counter[tuple[int, str]] = Counter()  # (owner group, replica) -> inputs
        self._spills: Counter[int] = Counter()  # owner group -> calls placed elsewhere
        self._replaced = 0  # replicas that left the set (died, were replaced or removed)
        self.changed = threading.Event()  # set whenever the replica set changes

    def set_replicas(self, live: Iterable[str]) -> dict[str, int]:
        """The live replica ids (from Ray); keeps each one's group; returns the assignment."""
        with self._lock:
            ids = set(live)
            self._replaced += len(set(self._groups) - ids)
            self._groups = assign_groups(self._groups, ids, self.groups_count)
            for r in list(self._inflight):
                if r not in ids:
                    del self._inflight[r]
            self._waits = {r: w for r, w in self._waits.items() if r in ids}
            out = dict(self._groups)
        self.changed.set()
        return out

    def replicas(self) -> dict[str, int]:
        """Replica id -> group, for every live replica."""
        with self._lock:
            return dict(self._groups)

    def ranks(
        self, owner: int, spill_at: int, spill_wait: float = float("inf")
    ) -> tuple[list[list[str]], bool]:
        """`rank_replicas` over the live replicas, their calls and model seconds in flight."""
        with self._lock:
            return rank_replicas(
                owner, self._groups, self._inflight, spill_at, self._waits, spill_wait
            )

    def routed(
        self, call_id: str, replica: str, owner: int, inputs: int, cost: float = 0.0
    ) -> None:
        """A data call owned by group `owner` went to `replica` (a spill if the replica is in
        another group; `owner` -1: a call routed without regard to length), with `cost`
        estimated model seconds."""
        with self._lock:
            self._calls[call_id] = (replica, cost)
            self._inflight[replica] += 1
            self._waits[replica] = self._waits.get(replica, 0.0) + cost
            self._routed[(owner, replica)] += 1
            self._inputs[(owner, replica)] += inputs
            if owner >= 0 and self._groups.get(replica, owner) != owner:
                self._spills[owner] += 1

    def completed(self, call_id: str) -> None:
        """A call finished (answered, failed or cancelled)."""
        with self._lock:
            call = self._calls.pop(call_id, None)
            if call is None:
                return
            replica, cost = call
            if self._inflight[replica] > 0:
                self._inflight[replica] -= 1
            if replica in self._waits:
                left = self._waits[replica] - cost
                self._waits[replica] = left if self._inflight[replica] > 0 else 0.0

    def snapshot(self) -> dict[str, Any]:
        """Every counter, JSON-ready."""
        with self._lock:
            return {
                "replicas": [
                    {
                        "replica": r,
                        "group": g,
                        "in_flight": self._inflight[r],
                        "expected_wait_s": round(self._waits.get(r, 0.0), 6),
                    }
                    for r, g in sorted(self._groups.items(), key=lambda x: (x[1], x[0]))
                ],
                "routed": [
                    {"owner_group": g, "replica": r, "calls": n, "inputs": self._inputs[(g, r)]}
                    for (g, r), n in sorted(self._routed.items())
                ],
                "spills": {str(g): n for g, n in sorted(self._spills.items())},
                "spills_total": sum(self._spills.values()),
                "routed_total": sum(self._routed.values()),
                "replicas_replaced": self._replaced,
            }


_BOARDS: dict[str, RoutingBoard] = {}
_BOARDS_LOCK = threading.Lock()


def board_for(deployment: str, groups: int = 1) -> RoutingBoard:
    """The process's board for `deployment`, made on first use with `groups` groups."""
    with _BOARDS_LOCK:
        board = _BOARDS.get(deployment)
        if board is None:
            board = _BOARDS[deployment] = RoutingBoard(groups)
        return board
