"""What generation measures, beside the per-bucket prefill figures (`lenbatch.serving.metrics`):
time to first token split into stages, inter-token latency, end-to-end latency, token counts,
decode batch sizes and their KV padding, and KV-cache memory apart from weights and activations.

Prometheus series live in their own registry (the server concatenates both expositions); a
bounded window of recent samples feeds the `/stats` percentiles.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from lenbatch.generate.generation import STAGES
from lenbatch.serving.metrics import (
    BATCH_BUCKETS,
    LATENCY_BUCKETS,
    Series,
    mean_ms,
    percentiles_ms,
    window,
)

__all__ = ["LMMetrics"]

_SECONDS = (*LATENCY_BUCKETS, 60.0)  # a whole generation may take a minute


class LMMetrics(Series):
    """Recorder of generation figures for one engine."""

    def __init__(self) -> None:
        super().__init__(seconds=_SECONDS)
        self.started = time.time()
        h, c, g = self.histogram, self.counter, self.gauge
        self.ttft = h("lenbatch_llm_ttft_seconds", "Time to first token")
        self.stage = h(
            "lenbatch_llm_ttft_stage_seconds",
            "Time to first token by stage (the stages sum to the TTFT)",
            "stage",
        )
        self.itl = h(
            "lenbatch_llm_inter_token_seconds", "Gap between consecutive tokens of one sequence"
        )
        self.e2e = h("lenbatch_llm_e2e_seconds", "Arrival to last token")
        self.prompt_tokens = c("lenbatch_llm_prompt_tokens", "Prompt tokens of finished requests")
        self.generated = c("lenbatch_llm_generated_tokens", "Tokens generated")
        self.steps = c("lenbatch_llm_steps", "Units run, by kind", "kind")
        self.step_time = h(
            "lenbatch_llm_step_seconds",
            "Forward time of one unit (prefill chunk or decode step)",
            "kind",
        )
        self.turn_time = h(
            "lenbatch_llm_turn_seconds",
            "One unit's whole turn when the next followed at once: its start to the next's "
            "(forward, thread hand-offs, delivery, scheduling, HTTP on the same cores)",
            "kind",
        )
        self.decode_rows = h(
            "lenbatch_llm_decode_batch_size", "Sequences per decode step", buckets=BATCH_BUCKETS
        )
        self.kv_real = c(
            "lenbatch_llm_decode_kv_real_tokens", "Cached tokens attended in decode steps (real)"
        )
        self.kv_padded = c(
            "lenbatch_llm_decode_kv_padded_tokens",
            "Cached columns attended in decode steps (padding included)",
        )
        self.kv_bytes = g(
            "lenbatch_llm_kv_cache_bytes", "KV-cache bytes held now (padding included)"
        )
        self.kv_real_bytes = g(
            "lenbatch_llm_kv_cache_real_bytes", "KV-cache bytes holding real tokens"
        )
        self.kv_peak = g("lenbatch_llm_kv_cache_peak_bytes", "Highest KV-cache bytes held")
        self.running = g("lenbatch_llm_running_sequences", "Sequences in the decode batch")
        self.pending = g(
            "lenbatch_llm_prefill_pending_sequences", "Admitted sequences waiting for prefill"
        )
        self.oom = c(
            "lenbatch_llm_out_of_memory",
            "Units that ran out of memory (split and retried), by kind",
            "kind",
        )
        self.graphs = g("lenbatch_llm_compiled_graphs", "Fixed shapes compiled (--compile)")
        self.compile_s = g("lenbatch_llm_compile_seconds", "Seconds spent compiling fixed shapes")
        self.compiled_units = g(
            "lenbatch_llm_compiled_units",
            "Units run by a compiled graph (hit) or eager for want of a fixed shape (miss)",
            "result",
        )
        self.prefix_bytes = g(
            "lenbatch_llm_prefix_cache_bytes", "Bytes of prompt prefixes kept for reuse"
        )
        self.prefix_looked = g(
            "lenbatch_llm_prefix_cache_looked_up_tokens",
            "Prompt tokens looked up in the prefix cache since the start",
        )
        self.prefix_hit = g(
            "lenbatch_llm_prefix_cache_hit_tokens",
            "Prompt tokens whose keys and values came from the prefix cache since the start",
        )
        self._prefix: dict[str, Any] = {"enabled": False}
        self._oom = {"prefill": 0, "decode": 0}
        self._ttft = window()
        self._stages = {s: window() for s in STAGES}
        self._itl = window()
        self._e2e = window()
        self._tokens = 0
        self._decode_real = 0
        self._decode_padded = 0
        self._step_s = {"prefill": 0.0, "decode": 0.0, "mixed": 0.0}
        self._step_n = {"prefill": 0, "decode": 0, "mixed": 0}
        self._step_jobs = {"prefill": 0, "mixed": 0}  # prefill jobs the units carried
        self._step_prompt = {"prefill": 0, "mixed": 0}  # their real prompt tokens
        self._turn_s = {"prefill": 0.0, "decode": 0.0, "mixed": 0.0}
        self._between_s = {"prefill": 0.0, "decode": 0.0, "mixed": 0.0}
        self._turn_n = {"prefill": 0, "decode": 0, "mixed": 0}
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

    def record_step(
        self,
        kind: str,
        compute_s: float,
        rows: int,
        real: int,
        padded: int,
        *,
        jobs: int = 0,
        prompt_tokens: int = 0,
    ) -> None:
        """One unit ran; for decode steps (and mixed units, whose decode step is counted as
        one) `real` / `padded` are attended cache columns. `jobs`: the prefill jobs (scheduler
        batches) whose chunks it carried, `prompt_tokens` their real tokens."""
        self.steps.labels(kind).inc()
        if kind in self._step_jobs:
            self._step_jobs[kind] += jobs
            self._step_prompt[kind] += prompt_tokens
        self.step_time.labels(kind).observe(compute_s)
        self._step_s[kind] = self._step_s.get(kind, 0.0) + compute_s
        self._step_n[kind] = self._step_n.get(kind, 0) + 1
        if kind in ("decode", "mixed"):
            self._decode_rows += rows
            self.decode_rows.observe(rows)
            self.kv_real.inc(real)
            self.kv_padded.inc(padded)
            self._decode_real += real
            self._decode_padded += padded

    def record_turn(self, kind: str, turn_s: float, forward_s: float) -> None:
        """A unit of `kind` and everything around it took `turn_s` seconds, from its start to
        the start of the next, which followed without waiting for work; `forward_s` of it was
        its forward. The rest is what the engine loses between forwards."""
        self.turn_time.labels(kind).observe(turn_s)
        self._turn_s[kind] = self._turn_s.get(kind, 0.0) + turn_s
        self._between_s[kind] = self._between_s.get(kind, 0.0) + max(0.0, turn_s - forward_s)
        self._turn_n[kind] = self._turn_n.get(kind, 0) + 1

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

    def set_prefix_cache(self, stats: Mapping[str, Any]) -> None:
        """The prefix cache's figures (`PrefixCache.stats`)."""
        self.prefix_bytes.set(stats["bytes"])
        self.prefix_looked.set(stats["looked_up_tokens"])
        self.prefix_hit.set(stats["hit_tokens"])
        self._prefix = {"enabled": True, **stats}

    def set_compile(self, stats: Mapping[str, Any]) -> None:
        """Compiled graphs, compile seconds and hits/misses (`ShapeGraphs.stats`)."""
        self.graphs.set(stats["graphs"])
        self.compile_s.set(stats["compile_s"])
        self.compiled_units.labels("hit").set(stats["hits"])
        self.compiled_units.labels("miss").set(stats["misses"])

    def stats(self) -> dict[str, Any]:
        """JSON-ready summary: TTFT and its stages, ITL, e2e, throughput, decode KV waste."""
        up = time.time() - self.started
        decode_steps = self._step_n["decode"] + self._step_n["mixed"]
        return {
            "ttft_ms": percentiles_ms(self._ttft),
            "ttft_stages_ms": {
                name: {"mean": mean_ms(v), **percentiles_ms(v, (50, 95))}
                for name, v in self._stages.items()
            },
            "inter_token_ms": percentiles_ms(self._itl),
            "e2e_ms": percentiles_ms(self._e2e),
            "generated_tokens": self._tokens,
            "generated_tokens_per_s": self._tokens / up if up > 0 else 0.0,
            "decode_kv_padding_waste": 1 - self._decode_real / self._decode_padded
            if self._decode_padded
            else 0.0,
            "kv_cache": dict(self._kv),
            "prefix_cache": dict(self._prefix),
            "out_of_memory": dict(self._oom),
            "steps": {
                kind: {
                    "count": n,
                    "mean_forward_ms": 1000 * self._step_s[kind] / n if n else None,
                    # turns followed at once by the next unit: forward and what surrounds it,
                    # and that surround alone (the turn less its own forward)
                    "turns": self._turn_n.get(kind, 0),
                    "mean_turn_ms": 1000 * self._turn_s[kind] / self._turn_n[kind]
                    if self._turn_n.get(kind)
                    else None,
                    "mean_between_forwards_ms": 1000 * self._between_s[kind] / self._turn_n[kind]
                    if self._turn_n.get(kind)
                    else None,
                    # prefill and mixed units: jobs (scheduler batches) and real prompt tokens
                    # a unit carried
                    **(
                        {
                            "mean_jobs": self._step_jobs[kind] / n if n else None,
                            "mean_prompt_tokens": self._step_prompt[kind] / n if n else None,
                        }
                        if kind in self._step_jobs
                        else {}
                    ),
                }
                for kind, n in self._step_n.items()
            },
            "decode_mean_rows": self._decode_rows / decode_steps if decode_steps else None,
        }
