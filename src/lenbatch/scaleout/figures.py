"""The app's figures from its replicas' own, and what the ingress learns from them.

`ReplicaFigures` fetches every replica's `/stats` JSON and Prometheus text (calls addressed to
each replica), and feeds what each replica's buckets ran since the previous fetch to the
ingress's cost model (one observation per bucket: its mean batch shape and time), which prices
requests for the length ranges and the router's expected waits. `aggregate_replicas` sums the
replicas' summaries into one engine-shaped summary; `merge_expositions` merges their
Prometheus texts into one exposition labelled by replica and group. `FreshFigures` fetches them
just before `/stats` and `/metrics` are answered.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from starlette.types import ASGIApp, Receive, Scope, Send

from lenbatch.core.costfit import OnlineCostModel
from lenbatch.scaleout.board import RoutingBoard
from lenbatch.scaleout.calls import own_call_id
from lenbatch.serving.metrics import BucketWork, bucket_totals, bucket_work

__all__ = ["FreshFigures", "ReplicaFigures", "aggregate_replicas", "merge_expositions"]

log = logging.getLogger("lenbatch.scaleout")

_CONTROL_TIMEOUT_S = 10.0
# What /stats shows of each replica's own summary.
_REPLICA_KEYS = (
    "replica", "group", "unreachable", "state", "batches", "mean_batch_size", "real_tokens",
    "padded_tokens", "padding_waste", "requests", "p50_ms", "p95_ms", "memory", "per_bucket",
    "generated_tokens", "ttft_ms", "inter_token_ms", "decode_mean_rows",  # causal LMs
)  # fmt: skip


class ReplicaFigures:
    """The last figures fetched from every replica of one engine deployment."""

    def __init__(self, handle: Any, board: RoutingBoard, cost_model: OnlineCostModel) -> None:
        self.handle = handle
        self.board = board
        self.cost_model = cost_model
        self.rows: list[dict[str, Any]] = []  # per replica: its stats, or `unreachable`
        self.expositions: list[tuple[str, int, bytes]] = []  # (replica, group, Prometheus text)
        self._totals: dict[str, dict[str, BucketWork]] = {}  # replica -> last bucket reading

    async def refresh(self) -> int:
        """Fetch every live replica's figures; returns how many bucket readings were new work
        (each one observed by the cost model)."""
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
        self.rows = []
        self.expositions = []
        for rid, stats, text in got:
            row: dict[str, Any] = {"replica": rid, "group": replicas[rid]}
            if stats is None:
                row["unreachable"] = True
            else:
                row.update(stats)
                self.expositions.append((rid, replicas[rid], text))
            self.rows.append(row)
        return self._learn()

    def _learn(self) -> int:
        """Observe what each reachable replica's buckets ran since the last fetch."""
        seen = 0
        for row in self.reachable():
            now = bucket_totals(row)
            prev = self._totals.get(row["replica"], {})
            self._totals[row["replica"]] = now
            for work in bucket_work(prev, now).values():
                if work.padded_tokens <= 0:
                    continue
                self.cost_model.observe(
                    round(work.mean_batch), round(work.mean_padded_len), work.mean_exec_s
                )
                seen += 1
        return seen

    def reachable(self) -> list[dict[str, Any]]:
        """The rows of replicas that answered the last fetch."""
        return [r for r in self.rows if not r.get("unreachable")]

    def lane_batches(self, lanes: int) -> tuple[float, ...]:
        """Each lane's mean batch size over the reachable replicas (1 where it ran nothing);
        empty unless the replicas have `lanes` lanes."""
        per_bucket = aggregate_replicas(self.reachable())["per_bucket"]
        if len(per_bucket) != lanes:
            return ()
        return tuple(float(b["mean_batch_size"]) or 1.0 for b in per_bucket)

    def per_replica(self) -> list[dict[str, Any]]:
        """What `/stats` shows of each replica's own summary."""
        return [{k: r[k] for k in _REPLICA_KEYS if k in r} for r in self.rows]


class FreshFigures:
    """ASGI middleware: before `/stats` and `/metrics`, call `refresh` (the ingress fetches
    every replica's figures; the app's routes read them synchronously)."""

    def __init__(self, app: ASGIApp, refresh: Callable[[], Awaitable[None]]) -> None:
        self.app = app
        self.refresh = refresh

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            # Under a route prefix (an app beside others on one Serve) the path includes it.
            path, root = scope["path"], scope.get("root_path", "")
            if root and path.startswith(root):
                path = path[len(root) :]
            if path in ("/stats", "/metrics"):
                await self.refresh()
        await self.app(scope, receive, send)


def aggregate_replicas(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Sum the replicas' counters into one engine-shaped summary (same bucket labels, since
    every replica runs the same configuration)."""
    buckets: dict[str, dict[str, Any]] = {}
    order: list[str] = []
    real = padded = batches = requests = 0
    status: dict[str, int] = {}
    for r in rows:
        real += int(r.get("real_tokens", 0))
        padded += int(r.get("padded_tokens", 0))
        batches += int(r.get("batches", 0))
        for k, v in (r.get("requests") or {}).items():
            status[k] = status.get(k, 0) + int(v)
        for b in r.get("per_bucket", []):
            label = b["bucket"]
            if label not in buckets:
                order.append(label)
                buckets[label] = {"bucket": label, "batches": 0, "requests": 0,
                                  "real_tokens": 0, "padded_tokens": 0, "exec_s": 0.0}  # fmt: skip
            acc = buckets[label]
            acc["batches"] += b["batches"]
            acc["requests"] += b["requests"]
            requests += b["requests"]
            acc["real_tokens"] += b["real_tokens"]
            acc["padded_tokens"] += b["padded_tokens"]
            acc["exec_s"] += b["mean_exec_ms"] * b["batches"] / 1000
    per_bucket = []
    for label in order:
        acc = buckets[label]
        n = acc["batches"]
        per_bucket.append(
            {
                "bucket": label,
                "batches": n,
                "requests": acc["requests"],
                "mean_batch_size": acc["requests"] / n if n else 0.0,
                "real_tokens": acc["real_tokens"],
                "padded_tokens": acc["padded_tokens"],
                "padding_waste": 1 - acc["real_tokens"] / acc["padded_tokens"]
                if acc["padded_tokens"]
                else 0.0,
                "mean_exec_ms": 1000 * acc["exec_s"] / n if n else 0.0,
            }
        )
    return {
        "requests": status,
        "batches": batches,
        "mean_batch_size": requests / batches if batches else 0.0,
        "real_tokens": real,
        "padded_tokens": padded,
        "padding_waste": 1 - real / padded if padded else 0.0,
        "per_bucket": per_bucket,
    }


def merge_expositions(texts: Sequence[tuple[str, int, bytes]]) -> bytes:
    """Prometheus texts of several replicas as one exposition: each family once, every sample
    labelled with its `replica` and `group` (sum over `replica` for the whole app)."""
    families: dict[str, Metric] = {}
    for rid, group, text in texts:
        for fam in text_string_to_metric_families(text.decode("utf-8")):
            merged = families.get(fam.name)
            if merged is None:
                merged = families[fam.name] = Metric(fam.name, fam.documentation, fam.type)
            for s in fam.samples:
                labels = {**s.labels, "replica": rid, "group": str(group)}
                merged.add_sample(s.name, labels, s.value, s.timestamp, s.exemplar)

    class _Collector:
        def collect(self) -> list[Metric]:
            return list(families.values())

    registry = CollectorRegistry()
    registry.register(_Collector())
    return generate_latest(registry)
