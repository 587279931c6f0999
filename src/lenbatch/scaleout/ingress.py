"""What the two Ray front-ends share: the lifecycle and ledger of the calls they admit, the
length ranges that place each input, the cost of a request, and the replicas' figures.

The ingress is lenbatch's own HTTP app (`create_app`, `create_llm_app`) over a `RayFrontend`
instead of a local engine, so the Ray app speaks exactly the protocol of `lenbatch serve`. A
`RayFrontend` is to the app what an engine is to the single server: a `Lifecycle` whose
admitted calls are tickets of its `Ledger` (a drain waits for them, a drain that times out
answers what is left 503, a caller that goes away cancels its call's work on the replicas, and
each call ends exactly once), and a `Service` of `lenbatch.serving.services`. What it does not
have is a model: the tokenizer is loaded alone, and the model's facts come from the replicas.

`/stats` and `/metrics` aggregate every replica's figures with the routing board's counters;
`refresh()` fetches them (every `refresh_s`, and just before those routes answer, see
`scaleout.figures.FreshFigures`), and `stats()`/`prometheus()` answer from the last fetch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Coroutine, Iterable
from typing import Any, TypedDict, TypeVar, Unpack

from prometheus_client import CollectorRegistry, Gauge, generate_latest

from lenbatch.core.clock import Clock, MonotonicClock
from lenbatch.core.costfit import OnlineCostModel
from lenbatch.core.errors import LenbatchError
from lenbatch.core.ranges import LengthRanges, RequestCost
from lenbatch.core.request import Request
from lenbatch.runners.base import ModelInfo
from lenbatch.scaleout.board import RoutingBoard
from lenbatch.scaleout.calls import ReplicaCalls
from lenbatch.scaleout.figures import ReplicaFigures, aggregate_replicas, merge_expositions
from lenbatch.serving.ledger import FutureReply, Ledger, Reply, Ticket
from lenbatch.serving.lifecycle import Lifecycle
from lenbatch.serving.metrics import percentile

__all__ = ["IngressLatencies", "IngressSettings", "RayFrontend"]

log = logging.getLogger("lenbatch.scaleout")

T = TypeVar("T")


class IngressLatencies:
    """The ledger's recorder at the ingress: the latency of every call answered, as the
    ingress measured it (the replicas count statuses and buckets themselves)."""

    def __init__(self, window: int = 20_000) -> None:
        self.samples: deque[float] = deque(maxlen=window)

    def record_request(self, lane: int, latency: float, status: str) -> None:
        """One admitted call ended; its latency counts if it was answered."""
        if status == "ok":
            self.samples.append(latency)

    def percentiles_ms(self) -> dict[str, float | None]:
        """p50, p95 and p99 in milliseconds (None before the first answer)."""
        lat = list(self.samples)
        return {f"p{q}_ms": 1000 * percentile(lat, q) if lat else None for q in (50, 95, 99)}


class IngressSettings(TypedDict, total=False):
    """How a Ray front-end routes and keeps its figures (each may be left out).

    `routing`: `length` (each call to the group owning its lengths, the default) or `pow2`
    (Ray's default policy); `request_timeout`: seconds an input may wait on its replica before
    it runs, for calls that give none (None: no limit); `attempts`: how many replicas a call
    tries when its replica dies (3); `refresh_s`: seconds between fetches of the replicas'
    figures (2; 0: only when `/stats` or `/metrics` asks); `clock`: what latencies are measured
    with (the monotonic clock).
    """

    routing: str
    request_timeout: float | None
    attempts: int
    refresh_s: float
    clock: Clock | None


class RayFrontend(Lifecycle[T]):
    """The ingress's service over one engine deployment; `T` is what one admitted call is
    answered with. Subclasses add the service's own calls (`Frontend`, `LMFrontend`)."""

    def __init__(
        self,
        handle: Any,
        board: RoutingBoard,
        info: ModelInfo,
        boundaries: Iterable[int],
        **settings: Unpack[IngressSettings],
    ) -> None:
        self.clock: Clock = settings.get("clock") or MonotonicClock()
        self.latencies = IngressLatencies()
        super().__init__(Ledger(self.clock, self.latencies))
        self.handle = handle
        self.board = board
        self.info = info
        self.request_timeout = settings.get("request_timeout")
        self.refresh_s = settings.get("refresh_s", 2.0)
        self.registry = CollectorRegistry()
        self.calls = ReplicaCalls(
            self.registry,
            routing=settings.get("routing", "length"),
            attempts=settings.get("attempts", 3),
        )
        self.ranges = LengthRanges(list(boundaries), info.max_length, board.groups_count)
        # The replicas' batch timings, fitted here (every refresh adds what each bucket ran
        # since the last): what a request costs, for the ranges and the expected queue waits.
        # A short window: one observation per bucket and replica per refresh, so it fills in
        # tens of seconds and the generic prior fades as fast.
        self.cost_model = OnlineCostModel(window=64)
        self.request_cost = RequestCost(self.cost_model.coefficients)
        self.figures = ReplicaFigures(handle, board, self.cost_model)
        self._ticker: asyncio.Task[None] | None = None
        self._series = _RoutingSeries(self.registry)

    # ------------------------------------------------------------------ lifecycle

    @property
    def routing(self) -> str:
        """`length` (each call to the group owning its lengths) or `pow2` (Ray's default)."""
        return self.calls.routing

    @property
    def ready(self) -> bool:
        """Accepting work: running and at least one replica known."""
        return super().ready and bool(self.board.replicas())

    def _started(self) -> None:
        if self.refresh_s > 0:
            self._ticker = asyncio.create_task(self._tick())

    async def _halt(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            try:
                await self.refresh()
            except Exception as exc:  # figures are best effort; routing goes on without them
                log.warning("figures refresh failed (%s)", type(exc).__name__)

    # ------------------------------------------------------------------ admitted calls

    def _admit(self, length: int, reply: Reply[T], arrival: float) -> Ticket[T]:
        """A ticket for one admitted call, running from now on: the replicas' engines keep
        its deadline, so the ingress only ends it (answer, error, cancel, drain timeout)."""
        ticket = Ticket(Request(length, arrival), reply)
        self.ledger.admit([ticket])
        self.ledger.start(ticket, self.clock.now())
        return ticket

    async def _answered(self, length: int, arrival: float, work: Coroutine[Any, Any, T]) -> T:
        """Run `work` as one admitted call of `length` tokens and return its answer; its error,
        or the 503 of a drain that timed out, is raised. A caller that goes away cancels
        `work` (and with it the calls in flight on the replicas)."""
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        ticket = self._admit(length, FutureReply(future), arrival)
        task = asyncio.create_task(self._settle(ticket, work))
        try:
            return await future
        finally:
            task.cancel()  # the answer is in, or nobody waits for it any more
            self.ledger.cancel(ticket)

    async def _settle(self, ticket: Ticket[T], work: Coroutine[Any, Any, T]) -> None:
        """End `ticket` with what `work` comes to: its value, its error, or a cancellation."""
        try:
            value = await work
        except asyncio.CancelledError:
            self.ledger.cancel(ticket)
            raise
        except LenbatchError as err:
            self.ledger.fail(ticket, err)
        except Exception as exc:  # a bug at the ingress: answer it rather than hang
            log.exception("bug: a call failed at the ingress")
            msg = f"internal error at the ingress ({type(exc).__name__})"
            self.ledger.fail(ticket, LenbatchError(msg))
        else:
            self.ledger.answer(ticket, value)

    # ------------------------------------------------------------------ placing calls

    def place(self, lengths: list[int]) -> list[int]:
        """The group owning each length (the ranges learn from every call's lengths)."""
        if self.ranges.observe(lengths):
            log.info("length ranges re-planned: %s", self.ranges.plan.describe())
        return [self.ranges.owner(n) for n in lengths]

    def cost_of(self, lengths: Iterable[int]) -> float:
        """Estimated model seconds of inputs of these lengths (the fitted cost model)."""
        b, m = self.ranges.boundaries, self.ranges.max_length
        return sum(self.request_cost.of(n, b, m) for n in lengths)

    # ------------------------------------------------------------------ figures

    async def refresh(self) -> None:
        """Fetch every replica's figures; new work fits the cost model, which re-weighs the
        length ranges by model time."""
        if not await self.figures.refresh():
            return
        lanes = len(self.ranges.boundaries) + 1
        self.request_cost = RequestCost(
            self.cost_model.coefficients, self.figures.lane_batches(lanes)
        )
        if self.ranges.set_cost(self.request_cost):
            log.info("length ranges re-planned by model time: %s", self.ranges.plan.describe())

    def describe(self) -> str:
        """One line for the start-up log."""
        rows = ", ".join(
            f"group {r['group']}: {r['min_len']}..{r['max_len'] or self.info.max_length}"
            for r in self.ranges.plan.describe()
        )
        groups = self.board.groups_count
        return f"ray scale-out over {groups} groups, routing {self.routing} ({rows})"

    def stats(self) -> dict[str, Any]:
        """Aggregated figures (sums over replicas; latency as the ingress measured it), each
        replica's own, the length ranges and the routing counters."""
        out = aggregate_replicas(self.figures.reachable())
        out.update(
            {
                "strategy": f"ray:{self.routing}",
                "state": self.state.value,
                "unanswered": self.unanswered,
                **self.latencies.percentiles_ms(),
                "boundaries": list(self.ranges.boundaries),
                "cost_model": self.cost_model.describe(),
                "routing": {
                    "policy": self.routing,
                    "ranges": self.ranges.plan.describe(),
                    "rebalances": self.ranges.rebalances,
                    "retries": self.calls.retries,
                    "failed_calls": self.calls.failed,
                    **self.board.snapshot(),
                },
                "per_replica": self.figures.per_replica(),
            }
        )
        return out

    def prometheus(self) -> bytes:
        """The routing series, then every replica's series labelled `replica` and `group`."""
        self._series.update(self.board.snapshot(), self.ranges.rebalances)
        return generate_latest(self.registry) + merge_expositions(self.figures.expositions)


class _RoutingSeries:
    """The routing board's counters as Prometheus gauges, set at each scrape."""

    def __init__(self, registry: CollectorRegistry) -> None:
        def gauge(name: str, doc: str, *labels: str) -> Gauge:
            return Gauge(f"lenbatch_ray_{name}", doc, labels, registry=registry)

        by_owner = ("owner_group", "replica")
        self.rebalances = gauge("rebalances", "Times the length ranges were re-planned")
        self.routed = gauge(
            "routed_calls",
            "Data calls routed, by the group owning their lengths and the replica chosen",
            *by_owner,
        )
        self.inputs = gauge(
            "routed_inputs", "Inputs routed, by owning group and replica", *by_owner
        )
        self.spills = gauge(
            "spills",
            "Calls placed outside their owning group (it was saturated or had no replica)",
            "owner_group",
        )
        self.inflight = gauge("in_flight", "Calls in flight per replica", "replica", "group")

    def update(self, snap: dict[str, Any], rebalances: int) -> None:
        """Set every gauge from a board snapshot."""
        self.rebalances.set(rebalances)
        for row in snap["routed"]:
            labels = (str(row["owner_group"]), row["replica"])
            self.routed.labels(*labels).set(row["calls"])
            self.inputs.labels(*labels).set(row["inputs"])
        for g, n in snap["spills"].items():
            self.spills.labels(g).set(n)
        for row in snap["replicas"]:
            self.inflight.labels(row["replica"], str(row["group"])).set(row["in_flight"])
