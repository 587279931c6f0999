"""What generation measures, beside the per-bucket prefill figures (`lenbatch.serving.metrics`):
time to first token split into stages, inter-token latency, end-to-end latency, token counts,
decode batch sizes and their KV padding, and KV-cache memory apart from weights and activations.

Prometheus series live in their own registry (the server concatenates both expositions); a
bounded window of recent samples feeds the `/stats` percentiles.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from lenbatch.generate.sequence import STAGES
from lenbatch.serving.metrics import percentile

__all__ = ["LMMetrics"]

_SECONDS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75,
    1.0, 1.5, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip
_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_WINDOW = 10_000


class LMMetrics:
    """Recorder of generation figures for one engine."""

    def __init__(self) -> None:
        self.started = time.time()
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram(
            "lenbatch_llm_ttft_seconds", "Time to first token", buckets=_SECONDS, registry=r
        )
        self.stage = Histogram(
            "lenbatch_llm_ttft_stage_seconds",
            "Time to first token by stage (the stages sum to the TTFT)",
            ["stage"],
            buckets=_SECONDS,
            registry=r,
        )
        self.itl = Histogram(
            "lenbatch_llm_inter_token_seconds",
            "Gap between consecutive tokens of one sequence",
            buckets=_SECONDS,
            registry=r,
        )
        self.e2e = Histogram(
            "lenbatch_llm_e2e_seconds", "Arrival to last token", buckets=_SECONDS, registry=r
        )
        self.prompt_tokens = Counter(
            "lenbatch_llm_prompt_tokens", "Prompt tokens of finished requests", registry=r
        )
        self.generated = Counter("lenbatch_llm_generated_tokens", "Tokens generated", registry=r)
        self.steps = Counter("lenbatch_llm_steps", "Units run, by kind", ["kind"], registry=r)
        self.step_time = Histogram(
            "lenbatch_llm_step_seconds",
            "Forward time of one unit (prefill chunk or decode step)",
            ["kind"],
            buckets=_SECONDS,
            registry=r,
        )
        self.decode_rows = Histogram(
            "lenbatch_llm_decode_batch_size", "Sequences per decode step", buckets=_ROWS, registry=r
        )
        self.kv_real = Counter(
            "lenbatch_llm_decode_kv_real_tokens",
            "Cached tokens attended in decode steps (real)",
            registry=r,
        )
        self.kv_padded = Counter(
            "lenbatch_llm_decode_kv_padded_tokens",
            "Cached columns attended in decode steps (padding included)",
            registry=r,
        )
        self.kv_bytes = Gauge(
            "lenbatch_llm_kv_cache_bytes", "KV-cache bytes held now (padding included)", registry=r
        )
        self.kv_real_bytes = Gauge(
            "lenbatch_llm_kv_cache_real_bytes", "KV-cache bytes holding real tokens", registry=r
        )
        self.kv_peak = Gauge(
            "lenbatch_llm_kv_cache_peak_bytes", "Highest KV-cache bytes held", registry=r
        )
        self.running = Gauge(
            "lenbatch_llm_running_sequences", "Sequences in the decode batch", registry=r
        )
        self.pending = Gauge(
            "lenbatch_llm_prefill_pending_sequences",
            "Admitted sequences waiting for prefill",
            registry=r,
        )
        self.oom = Counter(
            "lenbatch_llm_out_of_memory",
            "Units that ran out of memory (split and retried), by kind",
            ["kind"],
            registry=r,
        )
        self.graphs = Gauge(
            "lenbatch_llm_compiled_graphs", "Static shapes compiled (--compile)", registry=r
        )
        self.compile_s = Gauge(
            "lenbatch_llm_compile_seconds", "Seconds spent compiling static shapes", registry=r
        )
        self.static_calls = Gauge(
            "lenbatch_llm_compiled_units",
            "Units run by a compiled graph (hit) or eager for want of a static shape (miss)",
            ["result"],
            registry=r,
        )
        self._oom = {"prefill": 0, "decode": 0}
        self._ttft: deque[float] = deque(maxlen=_WINDOW)
        self._stages: dict[str, deque[float]] = {s: deque(maxlen=_WINDOW) for s in STAGES}
        self._itl: deque[float] = deque(maxlen=_WINDOW)
        self._e2e: deque[float] = deque(maxlen=_WINDOW)
        self._tokens = 0
        self._decode_real = 0
        self._decode_padded = 0
        self._step_s = {"prefill": 0.0, "decode": 0.0}
        self._step_n = {"prefill": 0, "decode": 0}
        self._decode_rows = 0
        self._kv = {"bytes": 0, "real_bytes": 0, "peak_bytes": 0}

    def record_first_token(self, ttft: float, stages: Mapping[str, float]) -> None:
        """A sequence delivered its first token after `ttft` seconds, split into `stages`."""
        self.ttft.observe(ttft)
        self._ttft.append(ttft)
        for name, value in stages.items():
            self.stage.labels(name).observe(value)
            self._stages[name].append(value)

    def record_tokens(self, n: int, gaps: list[float]) -> None:
        """`n` tokens delivered; `gaps` are their inter-token latencies (first tokens have none)."""
        self.generated.inc(n)
        self._tokens += n
        for g in gaps:
            self.itl.observe(g)
        self._itl.extend(gaps)

    def record_finished(self, e2e: float, prompt_tokens: int) -> None:
        """A sequence finished normally."""
        self.e2e.observe(e2e)
        self._e2e.append(e2e)
        self.prompt_tokens.inc(prompt_tokens)

    def record_step(self, kind: str, compute_s: float, rows: int, real: int, padded: int) -> None:
        """One unit ran; for decode steps `real` / `padded` are attended cache columns."""
        self.steps.labels(kind).inc()
        self.step_time.labels(kind).observe(compute_s)
        self._step_s[kind] = self._step_s.get(kind, 0.0) + compute_s
        self._step_n[kind] = self._step_n.get(kind, 0) + 1
        if kind == "decode":
            self._decode_rows += rows
            self.decode_rows.observe(rows)
            self.kv_real.inc(real)
            self.kv_padded.inc(padded)
            self._decode_real += real
            self._decode_padded += padded

    def record_oom(self, kind: str) -> None:
        """A unit of `kind` ran out of memory (it is split and retried)."""
        self.oom.labels(kind).inc()
        self._oom[kind] = self._oom.get(kind, 0) + 1

    def set_state(
        self, kv_bytes: int, kv_real_bytes: int, kv_peak: int, running: int, pending: int
    ) -> None:
        """Current KV-cache memory and batch occupancy."""
        self.kv_bytes.set(kv_bytes)
        self.kv_real_bytes.set(kv_real_bytes)
        self.kv_peak.set(kv_peak)
        self._kv = {"bytes": kv_bytes, "real_bytes": kv_real_bytes, "peak_bytes": kv_peak}
        self.running.set(running)
        self.pending.set(pending)

    def set_compile(self, stats: Mapping[str, Any]) -> None:
        """Compiled graphs, compile seconds and hits/misses (`StaticGraphs.stats`)."""
        self.graphs.set(stats["graphs"])
        self.compile_s.set(stats["compile_s"])
        self.static_calls.labels("hit").set(stats["hits"])
        self.static_calls.labels("miss").set(stats["misses"])

    def prometheus(self) -> bytes:
        """Prometheus text exposition of the generation series."""
        return generate_latest(self.registry)

    def stats(self) -> dict[str, Any]:
        """JSON-ready summary: TTFT and its stages, ITL, e2e, throughput, decode KV waste."""
        up = time.time() - self.started
        return {
            "ttft_ms": _pcts(self._ttft),
            "ttft_stages_ms": {
                name: {"mean": _mean_ms(v), "p50": _p_ms(v, 50), "p95": _p_ms(v, 95)}
                for name, v in self._stages.items()
            },
            "inter_token_ms": _pcts(self._itl),
            "e2e_ms": _pcts(self._e2e),
            "generated_tokens": self._tokens,
            "generated_tokens_per_s": self._tokens / up if up > 0 else 0.0,
            "decode_kv_padding_waste": 1 - self._decode_real / self._decode_padded
            if self._decode_padded
            else 0.0,
            "kv_cache": dict(self._kv),
            "out_of_memory": dict(self._oom),
            "steps": {
                kind: {
                    "count": n,
                    "mean_forward_ms": 1000 * self._step_s[kind] / n if n else None,
                }
                for kind, n in self._step_n.items()
            },
            "decode_mean_rows": self._decode_rows / self._step_n["decode"]
            if self._step_n["decode"]
            else None,
        }


def _p_ms(values: deque[float], q: float) -> float | None:
    return 1000 * percentile(values, q) if values else None


def _mean_ms(values: deque[float]) -> float | None:
    return 1000 * sum(values) / len(values) if values else None


def _pcts(values: deque[float]) -> dict[str, float | None]:
    return {"p50": _p_ms(values, 50), "p95": _p_ms(values, 95), "p99": _p_ms(values, 99)}
