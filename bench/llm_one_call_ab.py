"""A decode step with its layers in one C++ call against the same step op by op, alternated.

    bench/llm_one_call_ab.py [--dtype float32 --quantize int4]

SmolLM2 through `CausalLMRunner` (the lean path), a running batch of 1, 2 and 4 rows of one
real 310-token prompt (as `llm_decode_step.py` builds it); two `LeanLlama`s over the same
weights, one with its one call switched off, take turns step by step (30 timed steps each after
3 warm-up steps). Prints the medians.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from lenbatch.runners.causal import CausalLMRunner, resolve_causal_model
from lenbatch.runners.hardware import processor_key
from llm_decode_step import _step, prompt_ids, running_batch


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="float32")
    p.add_argument("--quantize", default="int4")
    args = p.parse_args()
    ref = resolve_causal_model("smollm2")
    assert ref is not None
    r = CausalLMRunner(
        ref.folder, gguf_file=ref.gguf_file, name=ref.name, dtype=args.dtype,
        quantization=args.quantize,
    )  # fmt: skip
    one = r.lean
    assert one is not None and one.one_call is not None, "no one call on this CPU and dtype"
    print(f"{processor_key()}\n{one.describe()}", flush=True)
    ops = copy.copy(one)
    ops.one_call, ops._packed = None, {}
    ids = prompt_ids(r, 310)
    for rows in (1, 2, 4):
        kv = {}
        for name, lean in (("one", one), ("ops", ops)):
            r.lean = lean
            kv[name] = running_batch(r, ids, rows)
        ts: dict[str, list[float]] = {"one": [], "ops": []}
        for i in range(33):
            for name, lean in (("one", one), ("ops", ops)):
                r.lean = lean
                t = _step(r, kv[name])
                if i >= 3:
                    ts[name].append(t)
        one_ms, ops_ms = (1000 * statistics.median(ts[n]) for n in ("one", "ops"))
        print(f"rows {rows}: one call {one_ms:.2f} ms, op by op {ops_ms:.2f} ms", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
