"""Text generation for causal LMs: length-bucketed prefill, static or continuous decoding,
streaming, and the TTFT breakdown.

`GenerationEngine` is the asyncio shell; `DecodeCore` the compute (prefill jobs and the running
decode batch); `policy` the two decode modes; `kvcache` the right-aligned KV-cache batch;
`sampling` token choice and stop strings; `metrics` the generation figures.
"""

from __future__ import annotations

from lenbatch.generate.engine import GenerationEngine
from lenbatch.generate.sequence import STAGES, Sequence, Timings
from lenbatch.serving.messages import Delta, SamplingParams

__all__ = [
    "STAGES",
    "Delta",
    "GenerationEngine",
    "SamplingParams",
    "Sequence",
    "Timings",
]
