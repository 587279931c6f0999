"""Text generation for causal LMs: length-bucketed prefill, lockstep or continuous decoding,
streaming, and the TTFT breakdown.

`GenerationEngine` is the asyncio shell (its loop: schedule, execute, update; `schedule_step`
and `update_step` its first and last step); `streams` a generation's way back to its caller;
`Decoder` the compute (prefill jobs and the running decode batch; `jobs` the prefill jobs and
unit results it works on and hands back); `failures` what happens when a unit raises; `policy`
the two decode modes; `kvcache` the right-aligned KV-cache batch and `windowcache` its per-layer
buffers; `shapes` the fixed shapes of `--compile`; `sampling` token choice and stop strings;
`prompts` tokenization off the event loop; `metrics` the generation figures; `protocol` and
`api` the OpenAI-compatible HTTP layer.
"""

from __future__ import annotations

from lenbatch.generate.engine import GenerationEngine
from lenbatch.generate.generation import STAGES, Generation, Timings
from lenbatch.serving.messages import Delta, SamplingParams

__all__ = [
    "STAGES",
    "Delta",
    "Generation",
    "GenerationEngine",
    "SamplingParams",
    "Timings",
]
