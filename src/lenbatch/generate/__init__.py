"""Text generation for causal LMs: length-bucketed prefill, static or continuous decoding,
streaming, and the TTFT breakdown.

`GenerationEngine` is the asyncio shell; `DecodeCore` the compute (prefill jobs and the running
decode batch); `policy` the two decode modes; `kvcache` the right-aligned KV-cache batch;
`sampling` token choice and stop strings; `metrics` the generation figures.
"""

from __future__ import annotations

from lenbatch.generate.engine import GenerationEngine, GenState
from lenbatch.generate.sampling import SamplingParams
from lenbatch.generate.sequence import STAGES, Delta, Sequence, Timings

__all__ = [
    "STAGES",
    "Delta",
    "GenState",
    "GenerationEngine",
    "SamplingParams",
    "Sequence",
    "Timings",
]
