"""What the server measures: per-bucket batch size, real and padded tokens, padding waste, queue
wait, execution time, end-to-end latency, queue depths, memory.

`Metrics` keeps Prometheus series in a private registry (for `/metrics`) and a bounded window of
recent samples (for `/stats` percentiles). Padding waste is token-weighted:
`1 - sum(real) / sum(padded)`. Nothing here ever sees request text.

`Series` (a recorder's own registry, one call per series) and the window and percentile helpers
are how every recorder declares and reads its figures: `Metrics` here, the generation figures
(`lenbatch.generate.metrics`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from lenbatch.core.totals import percentile
from lenbatch.runners.allocator import allocator_in_use
from lenbatch.runners.memory import current_rss, peak_rss

__all__ = [
    "BATCH_BUCKETS",
    "LATENCY_BUCKETS",
    "BucketWork",
    "Metrics",
    "Series",
    "bucket_totals",
    "bucket_work",
    "mean_ms",
    "percentile",
    "percentiles_ms",
    "window",
]

LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75,
    1.0, 1.5, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_WASTE_BUCKETS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9, 1.0)
_WINDOW = 10_000


def window() -> deque[float]:
    """A bounded window of recent samples (seconds) for the `/stats` percentiles."""
    return deque(maxlen=_WINDOW)


def percentiles_ms(
    values: Sequence[float], qs: Iterable[float] = (50, 95, 99), key: str = "p{}"
) -> dict[str, float | None]:
    """Percentiles `qs` of `values` (seconds) in milliseconds, keyed `key.format(q)`; None
    when there are no values."""
    return {key.format(q): 1000 * percentile(values, q) if values else None for q in qs}


def mean_ms(values: Sequence[float]) -> float | None:
    """Mean of `values` (seconds) in milliseconds; None when there are none."""
    return 1000 * sum(values) / len(values) if values else None


class Series:
    """A recorder's Prometheus series, in a registry of its own (so one engine's figures never
    mix with another's); each series is declared by one call."""

    def __init__(self, seconds: Sequence[float] = LATENCY_BUCKETS) -> None:
        self.registry = CollectorRegistry()
        self.seconds = tuple(seconds)  # a histogram's buckets unless it is given its own
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}

    def counter(self, name: str, doc: str, *labels: str) -> Counter:
        """A counter, labelled by `labels`."""
        return Counter(name, doc, labels, registry=self.registry)

    def gauge(self, name: str, doc: str, *labels: str) -> Gauge:
        """A gauge, labelled by `labels`."""
        return Gauge(name, doc, labels, registry=self.registry)

    def histogram(
        self, name: str, doc: str, *labels: str, buckets: Sequence[float] | None = None
    ) -> Histogram:
        """A histogram of `buckets` (by default `seconds`), labelled by `labels`."""
        bounds = self.seconds if buckets is None else buckets
        return Histogram(name, doc, labels, buckets=bounds, registry=self.registry)

    def child(self, series: Counter | Gauge | Histogram, *values: str) -> Any:
        """`series.labels(*values)`, looked up once: prometheus_client's `labels()` checks and
        locks on every call (about 20 per request on the hot path before), and the label
        values are few (buckets, statuses), so the children are kept."""
        key = (id(series), values)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = series.labels(*values)
        return found

    def prometheus(self) -> bytes:
        """The Prometheus text exposition of every series."""
        return generate_latest(self.registry)


@dataclass
class _LaneStats:
    batches: int = 0
    requests: int = 0
    real_tokens: int = 0
    padded_tokens: int = 0
    exec_s: float = 0.0
    waits: deque[float] = field(default_factory=window)
    latencies: deque[float] = field(default_factory=window)


class Metrics(Series):
    """Recorder for one engine: call `record_batch` per batch and `record_request` per answer."""

    def __init__(self, lane_labels: Sequence[str], strategy: str) -> None:
        super().__init__()
        self.labels = list(lane_labels)
        self.strategy = strategy
        self.started = time.time()
        b, h, c, g = "bucket", self.histogram, self.counter, self.gauge
        self.batch_size = h("lenbatch_batch_size", "Requests per batch", b, buckets=BATCH_BUCKETS)
        self.real_tokens = c("lenbatch_real_tokens", "Input tokens computed", b)
        self.padded_tokens = c("lenbatch_padded_tokens", "Tokens computed including padding", b)
        self.batch_waste = h(
            "lenbatch_batch_padding_waste",
            "Padding waste per batch (1 - real/padded)",
            b,
            buckets=_WASTE_BUCKETS,
        )
        self.waste = g("lenbatch_padding_waste", "Token-weighted padding waste since start", b)
        self.queue_wait = h("lenbatch_queue_wait_seconds", "Time from arrival to batch start", b)
        self.exec_time = h("lenbatch_batch_exec_seconds", "Model execution time per batch", b)
        self.latency = h("lenbatch_request_latency_seconds", "Arrival to answer, per input", b)
        self.intake = h(
            "lenbatch_intake_seconds",
            "First bytes read to admission (event-loop backlog, parsing, tokenizing)",
        )
        self._intakes = window()
        self.depth = g("lenbatch_queue_depth", "Requests waiting", b)
        self.requests = c("lenbatch_requests", "Answered inputs by outcome", b, "status")
        self.rejected = c("lenbatch_rejected", "Calls refused at admission", "reason")
        self.inflight = g("lenbatch_batches_in_flight", "Batches running or prepared")
        self.failures = c(
            "lenbatch_model_failures", "Failed model calls by kind (error, oom, crash)", b, "kind"
        )
        self.batch_cap = g(
            "lenbatch_batch_cap", "Max batch in force (lowered after out-of-memory)", b
        )
        self.ready = g("lenbatch_ready", "1 while the engine accepts requests")
        self.peak_rss = g("lenbatch_peak_rss_bytes", "Process RSS high-water mark")
        self.rss = g("lenbatch_rss_bytes", "Process RSS at the last reading")
        self.weights = g("lenbatch_weights_bytes", "Model parameter bytes")
        self.activations = g("lenbatch_peak_activation_bytes", "Peak memory above weights")
        # strategy adaptive (zero elsewhere): its decisions, model and counters
        self.fill_window = g(
            "lenbatch_adaptive_fill_window_seconds",
            "How long a lane may wait to fill its batch now (adaptive)",
            b,
        )
        self.target_batch = g(
            "lenbatch_adaptive_target_batch", "The batch a lane waits for now (adaptive)", b
        )
        self.arrival_rate = g(
            "lenbatch_adaptive_arrival_rate", "Estimated arrivals per second (adaptive)", b
        )
        self.cost_coef = g(
            "lenbatch_cost_model",
            "Online cost model a + b*B*L + c*B*L^2 seconds: coefficient by term",
            "term",
        )
        self.cost_error = g("lenbatch_cost_model_fit_error", "Relative RMS error of the online fit")
        self.merges = c(
            "lenbatch_merges",
            "Requests that joined a longer lane's batch (adaptive)",
            "from_bucket",
            "into_bucket",
        )
        self.shed = c(
            "lenbatch_shed",
            "Requests answered at once, predicted to miss their deadline (adaptive)",
            "where",
        )
        self.served_late = g(
            "lenbatch_served_late", "Requests run although predicted past their due time (adaptive)"
        )
        self.refits = c("lenbatch_refits", "Online re-fits of the bucket boundaries")
        self.by_priority = c(
            "lenbatch_priority_requests", "Admitted inputs by priority level", "level"
        )
        self._lanes = [_LaneStats() for _ in self.labels]
        self._all_latencies = window()
        self._status_counts: dict[str, int] = {}
        self._rejections: dict[str, int] = {}
        self._failures: dict[str, int] = {}
        self._memory: dict[str, Any] = {}
        self._allocator = allocator_in_use()
        self._last_depths: tuple[tuple[str, ...], tuple[int, ...], int] | None = None

    def record_batch(
        self,
        lane: int,
        size: int,
        real: int,
        padded: int,
        exec_s: float,
        queue_waits: Sequence[float],
    ) -> None:
        """One batch ran: its size, tokens, execution time and each member's queue wait."""
        label = self.labels[lane]
        s = self._lanes[lane]
        s.batches += 1
        s.requests += size
        s.real_tokens += real
        s.padded_tokens += padded
        s.exec_s += exec_s
        s.waits.extend(queue_waits)
        child = self.child
        child(self.batch_size, label).observe(size)
        child(self.real_tokens, label).inc(real)
        child(self.padded_tokens, label).inc(padded)
        child(self.batch_waste, label).observe(1 - real / padded if padded else 0.0)
        child(self.waste, label).set(1 - s.real_tokens / s.padded_tokens if s.padded_tokens else 0)
        child(self.exec_time, label).observe(exec_s)
        hist = child(self.queue_wait, label)
        for w in queue_waits:
            hist.observe(w)

    def record_request(self, lane: int, latency_s: float | None, status: str) -> None:
        """One input was answered (`latency_s` None when it never ran)."""
        label = self.labels[lane] if 0 <= lane < len(self.labels) else "none"
        self.child(self.requests, label, status).inc()
        self._status_counts[status] = self._status_counts.get(status, 0) + 1
        if latency_s is not None and status == "ok":
            self.child(self.latency, label).observe(latency_s)
            self._lanes[lane].latencies.append(latency_s)
            self._all_latencies.append(latency_s)

    def record_rejection(self, reason: str) -> None:
        """A call was refused before queueing."""
        self.rejected.labels(reason).inc()
        self._rejections[reason] = self._rejections.get(reason, 0) + 1

    def record_failure(self, lane: int, kind: str) -> None:
        """A model call of `lane` failed: `error` (raised), `oom` (out of memory) or `crash`."""
        self.failures.labels(self.labels[lane], kind).inc()
        self._failures[kind] = self._failures.get(kind, 0) + 1

    def set_batch_caps(self, caps: Sequence[int]) -> None:
        """The max batch in force for each lane."""
        for label, cap in zip(self.labels, caps, strict=True):
            self.batch_cap.labels(label).set(cap)

    def set_ready(self, ready: bool) -> None:
        """Whether the engine accepts requests."""
        self.ready.set(1 if ready else 0)

    def set_depths(self, depths: Sequence[int], inflight: int) -> None:
        """Current queue depth per lane and batches in flight. Called on every turn of the
        engine's loop, so it writes only what changed since the last call."""
        now = (tuple(self.labels), tuple(depths), inflight)
        last = self._last_depths
        if now == last:
            return
        # A turn usually moves one lane: write only the lanes whose depth changed (all of
        # them after the lanes were re-fitted).
        if last is None or last[0] != now[0]:
            lanes: Sequence[int] = range(len(now[1]))
        else:
            lanes = [i for i, (d, was) in enumerate(zip(now[1], last[1], strict=True)) if d != was]
        for i in lanes:
            self.child(self.depth, self.labels[i]).set(now[1][i])
        if last is None or last[2] != inflight:
            self.inflight.set(inflight)
        self._last_depths = now

    def set_memory(self, weights: int, activations: int, device: str) -> None:
        """Latest memory reading from the runner."""
        peak, now = peak_rss(), current_rss()
        self.peak_rss.set(peak)
        self.rss.set(now)
        self.weights.set(weights)
        self.activations.set(activations)
        self._memory = {
            "device": device,
            "allocator": self._allocator,
            "weights_mb": weights / 2**20,
            "peak_activations_mb": activations / 2**20,
            "peak_rss_mb": peak / 2**20,
            "rss_mb": now / 2**20,
        }

    def record_merge(self, from_lane: int, into_lane: int) -> None:
        """One request of `from_lane` ran in a batch of the longer `into_lane`."""
        self.merges.labels(self.labels[from_lane], self.labels[into_lane]).inc()

    def record_shed(self, where: str) -> None:
        """A request was shed (`admission` or `queue`)."""
        self.shed.labels(where).inc()

    def record_priority(self, level: int, n: int) -> None:
        """`n` inputs of priority `level` were admitted."""
        self.child(self.by_priority, str(level)).inc(n)

    def record_refit(self, lane_labels: Sequence[str]) -> None:
        """The boundaries were re-fitted: count it and label lanes afresh (per-lane windows
        start empty; Prometheus keeps the old lanes' series)."""
        self.refits.inc()
        self.labels = list(lane_labels)
        self._lanes = [_LaneStats() for _ in self.labels]

    def set_adaptive(self, state: dict[str, Any]) -> None:
        """Gauges from `AdaptiveState.describe()` (read at each scrape)."""
        for lane in state["lanes"]:
            b = lane["bucket"]
            self.fill_window.labels(b).set(lane["fill_window_ms"] / 1000)
            self.target_batch.labels(b).set(lane["target_batch"])
            self.arrival_rate.labels(b).set(lane["arrival_rate"])
        cm = state["cost_model"]
        self.cost_coef.labels("a").set(cm["a_s"])
        self.cost_coef.labels("b").set(cm["b_s_per_token"])
        self.cost_coef.labels("c").set(cm["c_s_per_token_sq"])
        if cm["fit_error"] is not None:
            self.cost_error.set(cm["fit_error"])
        self.served_late.set(state["served_late"])

    def record_intake(self, seconds: float) -> None:
        """A call's time from the server reading its first bytes (its route taking it, where
        the protocol does not stamp that) to its admission: the event loop's backlog, parsing,
        tokenizing and waiting for the tokenizer threads."""
        self._intakes.append(seconds)
        self.intake.observe(seconds)

    def stats(self) -> dict[str, Any]:
        """A JSON-ready summary: totals, token-weighted waste, latency percentiles per bucket."""
        per_bucket = []
        real = padded = 0
        for label, s in zip(self.labels, self._lanes, strict=True):
            real += s.real_tokens
            padded += s.padded_tokens
            per_bucket.append(
                {
                    "bucket": label,
                    "batches": s.batches,
                    "requests": s.requests,
                    "mean_batch_size": s.requests / s.batches if s.batches else 0.0,
                    "real_tokens": s.real_tokens,
                    "padded_tokens": s.padded_tokens,
                    "padding_waste": 1 - s.real_tokens / s.padded_tokens
                    if s.padded_tokens
                    else 0.0,
                    "mean_exec_ms": 1000 * s.exec_s / s.batches if s.batches else 0.0,
                    **percentiles_ms(s.waits, (50, 95), "queue_wait_p{}_ms"),
                    **percentiles_ms(s.latencies, key="p{}_ms"),
                }
            )
        waits = [w for s in self._lanes for w in s.waits]  # all lanes: the replay report's split
        batches = sum(s.batches for s in self._lanes)
        requests = sum(s.requests for s in self._lanes)
        return {
            "strategy": self.strategy,
            "uptime_s": time.time() - self.started,
            "requests": dict(self._status_counts),
            "rejected": dict(self._rejections),
            "model_failures": dict(self._failures),
            "batches": batches,
            "mean_batch_size": requests / batches if batches else 0.0,
            "real_tokens": real,
            "padded_tokens": padded,
            "padding_waste": 1 - real / padded if padded else 0.0,
            **percentiles_ms(self._all_latencies, key="p{}_ms"),
            **percentiles_ms(waits, (50, 95), "queue_wait_p{}_ms"),
            **percentiles_ms(self._intakes, (50, 95), "intake_p{}_ms"),
            "memory": dict(self._memory),
            "per_bucket": per_bucket,
        }


@dataclass(frozen=True)
class BucketWork:
    """What one bucket ran: batches, requests, padded tokens and model seconds (cumulative as
    `/stats` reports them, or the difference of two readings, see `bucket_work`)."""

    batches: float
    requests: float
    padded_tokens: float
    exec_s: float

    @property
    def mean_batch(self) -> float:
        """Requests per batch."""
        return self.requests / self.batches

    @property
    def mean_padded_len(self) -> float:
        """Padded tokens per request: the batches' mean padded length."""
        return self.padded_tokens / self.requests

    @property
    def mean_exec_s(self) -> float:
        """Model seconds per batch."""
        return self.exec_s / self.batches


def bucket_totals(stats: Mapping[str, Any]) -> dict[str, BucketWork]:
    """bucket label -> its cumulative `BucketWork`, read from a `/stats` summary."""
    return {
        b["bucket"]: BucketWork(
            float(b["batches"]),
            float(b["requests"]),
            float(b["padded_tokens"]),
            float(b["batches"]) * float(b["mean_exec_ms"]) / 1000.0,
        )
        for b in stats.get("per_bucket", [])
    }


def bucket_work(
    before: Mapping[str, BucketWork], after: Mapping[str, BucketWork]
) -> dict[str, BucketWork]:
    """What each bucket ran between two `bucket_totals` readings; buckets that ran no batch
    (or no request) in between are left out."""
    out = {}
    for bucket, a in after.items():
        b = before.get(bucket, BucketWork(0.0, 0.0, 0.0, 0.0))
        d = BucketWork(
            a.batches - b.batches,
            a.requests - b.requests,
            a.padded_tokens - b.padded_tokens,
            a.exec_s - b.exec_s,
        )
        if d.batches > 0 and d.requests > 0:
            out[bucket] = d
    return out
