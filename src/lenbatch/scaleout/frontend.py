"""The ingress's engine stand-in: tokenize once, route by length, gather, answer.

`create_app` (the embeddings API of `lenbatch serve`) is served unchanged over a `Frontend`
instead of a local engine, so the Ray app speaks exactly the same protocol (validation, error
shape, API key, base64, `/health`, `/metrics`, `/stats`, `/v1/models`). What `embed_with_usage`
does here:

    texts ─► tokenize (once; the text is dropped) ─► owner group per input (`LengthRanges`)
          ─► one handle call per group, `group=` for the request router ─► replica engines
          ─► vectors back in input order

A call whose replica dies is sent again (the router has dropped the dead replica, so it goes to
another one, a spill if it was the group's only replica), up to `attempts` times; after that
the caller gets an explicit 503, never silence. Ray restarts the replica meanwhile.

`/stats` and `/metrics` aggregate every replica's figures (fetched by calls addressed to each
replica) with the routing board's counters; `refresh()` fetches them, `stats()`/`prometheus()`
answer from the last fetch (the routes call `refresh()` just before, see `FreshFigures`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from starlette.types import ASGIApp, Receive, Scope, Send

from lenbatch.core.costfit import OnlineCostModel
from lenbatch.core.errors import LenbatchError, Unavailable, draining
from lenbatch.core.ranges import LengthRanges, RequestCost
from lenbatch.embed.inputs import Inputs, token_ids, tokenize_checked
from lenbatch.runners.base import EmbeddingRunner, ModelInfo
from lenbatch.scaleout.board import RoutingBoard
from lenbatch.scaleout.figures import aggregate_replicas, merge_expositions
from lenbatch.serving.ledger import wait_set
from lenbatch.serving.lifecycle import EngineState
from lenbatch.serving.messages import Embedded
from lenbatch.serving.metrics import BucketWork, bucket_totals, bucket_work, percentile

__all__ = ["FreshFigures", "Frontend", "RelayedError", "is_replica_failure", "own_call_id"]

log = logging.getLogger("lenbatch.scaleout.frontend")

_CONTROL_TIMEOUT_S = 10.0
# What /stats shows of each replica's own summary.
_REPLICA_KEYS = (
    "replica", "group", "unreachable", "state", "batches", "mean_batch_size", "real_tokens",
    "padded_tokens", "padding_waste", "requests", "p50_ms", "p95_ms", "memory", "per_bucket",
    "generated_tokens", "ttft_ms", "inter_token_ms", "decode_mean_rows",  # causal LMs
)  # fmt: skip


class RelayedError(LenbatchError):
    """An error a replica answered with, passed on to the client as it was."""

    def __init__(self, fields: dict[str, Any]) -> None:
        super().__init__(
            str(fields["message"]), retry_after=fields.get("retry_after"), code=fields["code"]
        )
        self.status = int(fields["status"])
        self.kind = str(fields["kind"])


def is_replica_failure(exc: BaseException) -> bool:
    """Whether `exc` says the replica (its actor) went away, rather than the request failing."""
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

    current = serve_context._get_serve_request_context()
    serve_context._serve_request_context.set(
        dataclasses.replace(current, _internal_request_id=uuid.uuid4().hex)
    )


class Frontend:
    """The `Servable` engine of the ingress: routes to the engine deployment's replicas."""

    def __init__(
        self,
        handle: Any,
        board: RoutingBoard,
        tokenizer: EmbeddingRunner | Any,  # the LM frontend's is a CausalLMRunner
        info: ModelInfo,
        boundaries: Sequence[int],
        *,
        routing: str = "length",
        default_truncate: bool = False,
        request_timeout: float | None = None,
        attempts: int = 3,
        refresh_s: float = 2.0,
    ) -> None:
        self.handle = handle
        self.refresh_s = refresh_s
        self.board = board
        self.tokenizer = tokenizer
        self.info = info
        self.routing = routing
        self.default_truncate = default_truncate
        self.request_timeout = request_timeout
        self.attempts = attempts
        self.ranges = LengthRanges(boundaries, info.max_length, board.groups_count)
        # The replicas' batch timings, fitted here (every refresh adds what each bucket ran
        # since the last): what a request costs, for the ranges and the expected queue waits.
        # A short window: one observation per bucket and replica per refresh, so it fills in
        # tens of seconds and the generic prior fades as fast.
        self.cost_model = OnlineCostModel(window=64)
        self.request_cost = RequestCost(self.cost_model.coefficients)
        self._bucket_totals: dict[str, dict[str, BucketWork]] = {}  # replica -> last reading
        self._ticker: asyncio.Task[None] | None = None
        self._state = EngineState.NEW
        self._unanswered = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._latencies: deque[float] = deque(maxlen=20_000)
        self._per_replica: list[dict[str, Any]] = []
        self._expositions: list[tuple[str, int, bytes]] = []
        self.registry = CollectorRegistry()
        self._retries = Counter(
            "lenbatch_ray_retries",
            "Calls sent again after their replica died",
            registry=self.registry,
        )
        self._failed = Counter(
            "lenbatch_ray_failed_calls",
            "Calls answered 503 after every attempt met a dead replica",
            registry=self.registry,
        )
        self._rebalances = Gauge(
            "lenbatch_ray_rebalances",
            "Times the length ranges were re-planned",
            registry=self.registry,
        )
        self._routed = Gauge(
            "lenbatch_ray_routed_calls",
            "Data calls routed, by the group owning their lengths and the replica chosen",
            ["owner_group", "replica"],
            registry=self.registry,
        )
        self._inputs = Gauge(
            "lenbatch_ray_routed_inputs",
            "Inputs routed, by owning group and replica",
            ["owner_group", "replica"],
            registry=self.registry,
        )
        self._spills = Gauge(
            "lenbatch_ray_spills",
            "Calls placed outside their owning group (it was saturated or had no replica)",
            ["owner_group"],
            registry=self.registry,
        )
        self._inflight = Gauge(
            "lenbatch_ray_in_flight", "Calls in flight per replica", ["replica", "group"],
            registry=self.registry,
        )  # fmt: skip
        self.retries = 0
        self.failed = 0

    # ------------------------------------------------------------------ Servable

    @property
    def state(self) -> EngineState:
        """Where the ingress is in its lifecycle."""
        return self._state

    @property
    def failure(self) -> str | None:
        """Never set: a failed replica is replaced by Ray, the ingress itself does not fail."""
        return None

    @property
    def ready(self) -> bool:
        """Accepting work: running and at least one replica known."""
        return self._state is EngineState.RUNNING and bool(self.board.replicas())

    @property
    def unanswered(self) -> int:
        """Admitted calls not answered yet."""
        return self._unanswered

    async def start(self) -> None:
        """Start accepting requests, and fetching the replicas' figures every `refresh_s`."""
        self._state = EngineState.RUNNING
        if self._ticker is None and self.refresh_s > 0:
            self._ticker = asyncio.create_task(self._tick())

    async def _tick(self) -> None:
        while self._state is not EngineState.STOPPED:
            await asyncio.sleep(self.refresh_s)
            try:
                await self.refresh()
            except Exception as exc:  # figures are best effort; routing goes on without them
                log.warning("figures refresh failed (%s)", type(exc).__name__)

    def begin_drain(self) -> None:
        """Refuse new requests (503 shutting_down) from now on."""
        if self._state is EngineState.RUNNING:
            self._state = EngineState.DRAINING

    async def drain(self, timeout: float | None = 30.0) -> None:
        """Refuse new requests and wait up to `timeout` for the admitted ones (the replicas
        answer them; a call still open at the timeout is answered by its replica's own drain)."""
        self.begin_drain()
        log.info("draining: %d admitted requests unanswered", self._unanswered)
        await wait_set(self._idle, timeout)

    async def stop(self, timeout: float | None = 30.0) -> None:
        """Drain, then stop."""
        await self.drain(timeout)
        self._state = EngineState.STOPPED
        if self._ticker is not None:
            self._ticker.cancel()

    def describe(self) -> str:
        """One line for the start-up log."""
        rows = ", ".join(
            f"group {r['group']}: {r['min_len']}..{r['max_len'] or self.info.max_length}"
            for r in self.ranges.plan.describe()
        )
        groups = self.board.groups_count
        return f"ray scale-out over {groups} groups, routing {self.routing} ({rows})"

    def check_running(self) -> None:
        """Raise the refusal a request gets while the ingress is not running (draining: 503
        `shutting_down`)."""
        if self._state is not EngineState.RUNNING:
            raise (
                draining()
                if self._state is EngineState.DRAINING
                else Unavailable(f"server is {self._state.value}; not accepting requests")
            )

    def call_admitted(self) -> None:
        """One more admitted request to answer before a drain ends."""
        self._unanswered += 1
        self._idle.clear()

    def call_ended(self, latency_s: float | None = None) -> None:
        """An admitted request was answered (its ingress latency recorded, if given)."""
        self._unanswered -= 1
        if self._unanswered == 0:
            self._idle.set()
        if latency_s is not None:
            self._latencies.append(latency_s)

    def count_retry(self) -> None:
        """A call is sent again because its replica died."""
        self.retries += 1
        self._retries.inc()
        log.warning("replica died with a call in flight; sending it again")

    def count_failure(self) -> None:
        """A call is answered 503 because its replica died and no retry was possible."""
        self.failed += 1
        self._failed.inc()

    # ------------------------------------------------------------------ embedding

    def _token_ids(self, inputs: Inputs, truncate: bool) -> list[list[int]]:
        """Tokenize texts / check token arrays exactly as the single server's engine does."""
        ids = token_ids(
            inputs,
            lambda texts: tokenize_checked(self.tokenizer.tokenize, list(texts), truncate),
            self.info.vocab_size,
        )
        if truncate:
            ids = [x[: self.info.max_length] for x in ids]
        return ids

    async def embed_with_usage(
        self,
        inputs: Inputs,
        *,
        truncate: bool | None = None,
        timeout: float | None = None,
        priority: int = 0,
    ) -> Embedded:
        """Embed each input on the replica group owning its length; vectors in input order."""
        self.check_running()
        t0 = time.perf_counter()
        cut = self.default_truncate if truncate is None else truncate
        ids = self._token_ids(inputs, cut)
        lengths = [len(x) for x in ids]
        if self.ranges.observe(lengths):
            log.info("length ranges re-planned: %s", self.ranges.plan.describe())
        by_group: dict[int, list[int]] = {}
        for i, n in enumerate(lengths):
            by_group.setdefault(self.ranges.owner(n), []).append(i)
        timeout = timeout if timeout is not None else self.request_timeout
        self.call_admitted()
        try:
            parts = await asyncio.gather(
                *(
                    self._call(
                        g,
                        [ids[i] for i in idx],
                        cut,
                        timeout,
                        priority,
                        self.cost_of(lengths[i] for i in idx),
                    )
                    for g, idx in by_group.items()
                )
            )
        finally:
            self.call_ended()
        vectors: list[Any] = [None] * len(ids)
        tokens = 0
        for idx, (vecs, used) in zip(by_group.values(), parts, strict=True):
            tokens += used
            for i, v in zip(idx, vecs, strict=True):
                vectors[i] = v
        self._latencies.append(time.perf_counter() - t0)
        return Embedded(vectors, tokens)

    async def _call(
        self,
        group: int,
        ids: list[list[int]],
        truncate: bool,
        timeout: float | None,
        priority: int,
        cost: float = 0.0,
    ) -> tuple[list[Any], int]:
        owner = group if self.routing == "length" else None
        last: BaseException | None = None
        for attempt in range(self.attempts):
            if attempt:
                self.count_retry()
            own_call_id()
            try:
                out = await self.handle.embed.remote(
                    ids, truncate, timeout, priority, group=owner, cost=cost
                )
            except Exception as exc:
                if not is_replica_failure(exc):
                    raise
                last = exc
                continue
            if "error" in out:
                raise RelayedError(out["error"])
            return list(np.asarray(out["vectors"], dtype=np.float32)), int(out["tokens"])
        raise self.replica_failed(f"{self.attempts} attempts failed", last)

    def replica_failed(self, what: str, last: BaseException | None) -> Unavailable:
        """Count a call that met a dead replica and cannot be retried; the 503 to answer."""
        self.count_failure()
        return Unavailable(
            f"the replica serving this request died and {what} ({type(last).__name__}); "
            "retry shortly",
            retry_after=2.0,
            code="replica_failed",
        )

    def cost_of(self, lengths: Any) -> float:
        """Estimated model seconds of inputs of these lengths (the fitted cost model)."""
        b, m = self.ranges.boundaries, self.ranges.max_length
        return sum(self.request_cost.of(n, b, m) for n in lengths)

    # ------------------------------------------------------------------ figures

    async def refresh(self) -> None:
        """Fetch every replica's stats and Prometheus text (calls addressed to each)."""
        replicas = self.board.replicas()

        async def one(rid: str) -> tuple[str, dict[str, Any] | None, bytes]:
            own_call_id()
            try:
                stats, text = await asyncio.wait_for(
                    self.handle.figures.remote(replica=rid), _CONTROL_TIMEOUT_S
                )
            except Exception as exc:  # a replica mid-restart: report it as unreachable
                log.warning("replica %s gave no figures (%s)", rid, type(exc).__name__)
                return rid, None, b""
            return rid, stats, text

        got = await asyncio.gather(*(one(r) for r in replicas))
        self._per_replica = []
        self._expositions = []
        for rid, stats, text in got:
            row: dict[str, Any] = {"replica": rid, "group": replicas[rid]}
            if stats is None:
                row["unreachable"] = True
            else:
                row.update(stats)
                self._expositions.append((rid, replicas[rid], text))
            self._per_replica.append(row)
        self._learn()

    def _learn(self) -> None:
        """Fit the cost model on what each replica's buckets ran since the last refresh (one
        observation per bucket: its mean batch shape and time), then re-weigh the ranges."""
        seen = 0
        for row in self._per_replica:
            if row.get("unreachable"):
                continue
            now = bucket_totals(row)
            prev = self._bucket_totals.get(row["replica"], {})
            self._bucket_totals[row["replica"]] = now
            for work in bucket_work(prev, now).values():
                if work.padded_tokens <= 0:
                    continue
                self.cost_model.observe(
                    round(work.mean_batch), round(work.mean_padded_len), work.mean_exec_s
                )
                seen += 1
        if not seen:
            return
        rows = aggregate_replicas([r for r in self._per_replica if not r.get("unreachable")])
        lanes = rows["per_bucket"]
        batch = (
            tuple(float(b["mean_batch_size"]) or 1.0 for b in lanes)
            if len(lanes) == len(self.ranges.boundaries) + 1
            else ()
        )
        self.request_cost = RequestCost(self.cost_model.coefficients, batch)
        if self.ranges.set_cost(self.request_cost):
            log.info("length ranges re-planned by model time: %s", self.ranges.plan.describe())

    def stats(self) -> dict[str, Any]:
        """Aggregated figures (sums over replicas; latency as the ingress measured it), each
        replica's own, the length ranges and the routing counters."""
        reachable = [r for r in self._per_replica if not r.get("unreachable")]
        out = aggregate_replicas(reachable)
        lat = list(self._latencies)
        out.update(
            {
                "strategy": f"ray:{self.routing}",
                "state": self._state.value,
                "unanswered": self._unanswered,
                "p50_ms": 1000 * percentile(lat, 50) if lat else None,
                "p95_ms": 1000 * percentile(lat, 95) if lat else None,
                "p99_ms": 1000 * percentile(lat, 99) if lat else None,
                "boundaries": list(self.ranges.boundaries),
                "cost_model": self.cost_model.describe(),
                "routing": {
                    "policy": self.routing,
                    "ranges": self.ranges.plan.describe(),
                    "rebalances": self.ranges.rebalances,
                    "retries": self.retries,
                    "failed_calls": self.failed,
                    **self.board.snapshot(),
                },
                "per_replica": [
                    {k: r[k] for k in _REPLICA_KEYS if k in r} for r in self._per_replica
                ],
            }
        )
        return out

    def prometheus(self) -> bytes:
        """The routing series, then every replica's series labelled `replica` and `group`."""
        snap = self.board.snapshot()
        self._rebalances.set(self.ranges.rebalances)
        for row in snap["routed"]:
            labels = (str(row["owner_group"]), row["replica"])
            self._routed.labels(*labels).set(row["calls"])
            self._inputs.labels(*labels).set(row["inputs"])
        for g, n in snap["spills"].items():
            self._spills.labels(g).set(n)
        for row in snap["replicas"]:
            self._inflight.labels(row["replica"], str(row["group"])).set(row["in_flight"])
        return generate_latest(self.registry) + merge_expositions(self._expositions)


class FreshFigures:
    """ASGI middleware: before `/stats` and `/metrics`, fetch every replica's figures (the
    app's routes read them synchronously)."""

    def __init__(self, app: ASGIApp, frontend: Frontend) -> None:
        self.app = app
        self.frontend = frontend

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            # Under a route prefix (an app beside others on one Serve) the path includes it.
            path, root = scope["path"], scope.get("root_path", "")
            if root and path.startswith(root):
                path = path[len(root) :]
            if path in ("/stats", "/metrics"):
                await self.frontend.refresh()
        await self.app(scope, receive, send)
