"""The Ray Serve request router of the engine replicas: length-aware placement with spill.

Ray Serve's extension point for custom routing (`ray.serve.request_router.RequestRouter`,
configured per deployment with `RequestRouterConfig`) decides, for each call on a handle, which
ranked lists of replicas to try; Ray then probes their queue lengths, takes the least-loaded
replica of the first rank that has room (below `max_ongoing_requests`), and falls back to the
next rank. This router ranks by the call's `group` keyword (the length range the ingress found
for its inputs, see `lenbatch.core.ranges`): the group's replicas first, least loaded first,
then the others; when every owner has `spill_at` calls in flight and another replica has
fewer, or the owners' expected queue wait (the model seconds in flight, from each call's `cost`
keyword, the ingress's estimate) exceeds another replica's by more than `spill_wait`, that
replica goes first (a spill). Every decision and spill is counted on the routing
board the ingress reads.

Two more call kinds: a call with `replica=ID` goes to that replica only (the ingress fans
`stats`/`metrics` out this way), and with `policy="pow2"` data calls go to the less loaded of
two random replicas: Ray's default policy (power of two choices), kept in this class only so the
ingress can still read each replica's figures. Not mixed with Ray's `FIFOMixin` on purpose: that
mixin hands a chosen replica to the *oldest* pending request, not the one it was chosen for,
which would undo routing by length.
"""

from __future__ import annotations

import random
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from lenbatch.scaleout.board import RoutingBoard, board_for

__all__ = ["LengthRangeRouter"]


class LengthRangeRouter(RequestRouter):  # type: ignore[misc]  # Ray is typed Any here
    """Routes each call to the replica group owning its length range; spills when saturated."""

    board: RoutingBoard
    policy: str
    spill_at: int
    spill_wait: float

    def initialize_state(
        self,
        board: str = "engines",
        groups: int = 1,
        policy: str = "length",
        spill_at: int = 64,
        spill_wait: float = float("inf"),
    ) -> None:
        """Called by Ray with `RequestRouterConfig.request_router_kwargs`."""
        if policy not in ("length", "pow2"):
            raise ValueError(f"policy must be 'length' or 'pow2', got {policy!r}")
        self.board = board_for(board, groups)
        self.policy = policy
        self.spill_at = spill_at
        self.spill_wait = spill_wait

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Ray's new replica set: keep it, and let the board keep each replica's group."""
        super().update_replicas(replicas)
        self.board.set_replicas(r.replica_id.unique_id for r in replicas)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        """A replica died: route nothing more to it."""
        super().on_replica_actor_died(replica_id)
        live = self.board.replicas()
        live.pop(replica_id.unique_id, None)
        self.board.set_replicas(live)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        """Ranked replicas for one call (see the module docstring)."""
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        if pending_request is None:
            return [list(by_id.values())]
        # Without this Ray retries at once, without pause, while no replica has room.
        pending_request.routing_context.should_backoff = True
        kwargs = pending_request.kwargs
        target = kwargs.get("replica")
        if target is not None:
            return [[by_id[target]]] if target in by_id else []
        group = kwargs.get("group")
        if self.policy == "pow2" or group is None:
            picked = random.sample(list(by_id.values()), min(2, len(by_id)))
            return [picked] if picked else []
        ranks, _ = self.board.ranks(int(group), self.spill_at, self.spill_wait)
        return [[by_id[r] for r in rank if r in by_id] for rank in ranks]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        """Count where the call went (the board works out whether it was a spill)."""
        method = pending_request.metadata.call_method
        if method not in ("embed", "generate"):
            return  # a control call
        kwargs = pending_request.kwargs
        group = kwargs.get("group")
        owner = -1 if group is None else int(group)
        # An embed call carries a list of inputs; a generate call one prompt.
        args = pending_request.args
        inputs = (len(args[0]) if args else 0) if method == "embed" else 1
        call_id = pending_request.metadata.internal_request_id
        cost = float(kwargs.get("cost", 0.0))
        self.board.routed(call_id, replica_id.unique_id, owner, inputs, cost)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        """The call is over: one fewer in flight on its replica."""
        self.board.completed(internal_request_id)
