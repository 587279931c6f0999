"""The app's figures from its replicas' own: `/stats` summed into one engine-shaped summary,
`/metrics` merged into one Prometheus exposition labelled by replica and group.

Pure functions over what the replicas returned; the ingress (`scaleout.frontend`) fetches them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

__all__ = ["aggregate_replicas", "merge_expositions"]


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
