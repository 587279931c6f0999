"""Where a decode step's time goes: model forward, KV-cache upkeep, sampling, Python per sequence.

    bench/run.py profile-decode -- --model smollm2 --rows 16 --prompt-len 160 \\
        --steps 48 [--dtype bfloat16] [--json out.json]

Drives `lenbatch.generate.decode.Decoder` directly (no HTTP, no event loop): one prefill job
of `--rows` prompts of about `--prompt-len` tokens, then decode steps until every row has
finished; rows stop at different lengths (max_tokens from `--steps` down to half of it, as in a
real batch) and a second job of `--rows // 2` prompts joins after a quarter of the steps, so
row removal and joining are paid as in serving. Each decode step is split by timing wrappers
that exist in both the old and the new core (so `bench/run.py --src <old tree>/src
profile-decode` profiles the old decode with the same script):

* `model`: the runner's forward call (inside it, transformers' cache update);
* `sampling`: choosing each row's next token (`decode.choose_next`);
* `per-seq python`: `Generation.add_token` for every row (detokenizing, stop checks);
* `cache + rest`: the step's remainder (building step inputs, appending, dropping finished rows).

A torch profiler pass over a few steps then splits the model call by operator kind (matmuls,
attention, cache copies, ...). Timings are wall-clock on this machine; run it alone (the CPU
lock) to report them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

import lenbatch.generate.decode as decode_mod
from lenbatch.core.request import Request
from lenbatch.generate.generation import Generation, Timings
from lenbatch.generate.sampling import TextTracker
from lenbatch.runners.causal import CausalLMRunner, resolve_causal_model
from lenbatch.serving.messages import SamplingParams

TEXT = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips "
    "in May. How many clips did Natalia sell altogether in April and May? Weng earns $12 an "
    "hour for babysitting. Yesterday, she just did 50 minutes of babysitting. How much did "
    "she earn? Betty is saving money for a new wallet which costs $100. "
) * 20


class PhaseTimer:
    """Accumulates wall time per phase while `active`."""

    def __init__(self) -> None:
        self.active = False
        self.spent: dict[str, float] = defaultdict(float)

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.active:
                return fn(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent[name] += time.perf_counter() - t0

        return timed


def _sequences(runner: Any, n: int, length: int, steps: int, offset: int) -> list[Generation]:
    ids = runner.tokenize([TEXT])[0]
    seqs = []
    for i in range(n):
        prompt = ids[offset + i : offset + i + max(4, length - 3 * i)]  # lengths differ by row
        max_tokens = max(2, steps - (i * steps) // (2 * n))
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        req: Request[Generation] = Request(len(prompt), 0.0, list(prompt))
        seq = Generation(req, params, TextTracker(runner.decode), Timings(0.0), runner.device)
        req.handle = seq
        seqs.append(seq)
    return seqs


def _op_kind(name: str) -> str:
    n = name.lower()
    if any(k in n for k in ("addmm", "mm", "linear", "matmul", "bmm", "mkldnn")):
        return "matmul"
    if "attention" in n or "sdpa" in n or "softmax" in n:
        return "attention"
    if any(k in n for k in ("cat", "index_copy", "copy_", "index_select", "slice_scatter")):
        return "cache copies (cat/copy/index)"
    if any(k in n for k in ("mul", "add", "silu", "rsqrt", "pow", "mean", "neg", "sigmoid")):
        return "elementwise (norm, rotary, act)"
    return "other"


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Profile decode steps; returns the summary."""
    ref = resolve_causal_model(args.model)
    if ref is None:
        raise SystemExit(f"{args.model} is not a causal LM")
    kwargs: dict[str, Any] = {"dtype": args.dtype} if args.dtype else {}
    extra = json.loads(args.runner_args) if args.runner_args else {}
    runner = CausalLMRunner(ref.folder, gguf_file=ref.gguf_file, name=ref.name, **kwargs, **extra)
    warm_up = getattr(runner, "warm_up", None)
    if callable(warm_up):
        warm_up()
    timer = PhaseTimer()
    runner.forward = timer.wrap("model", runner.forward)  # type: ignore[method-assign]
    decode_mod.choose_next = timer.wrap("sampling", decode_mod.choose_next)
    Generation.add_token = timer.wrap("per-seq python", Generation.add_token)  # type: ignore[method-assign]

    def one_pass(profile: bool) -> tuple[list[float], dict[str, float], list[list[int]]]:
        core = decode_mod.Decoder(runner, time.perf_counter, True)
        first = _sequences(runner, args.rows, args.prompt_len, args.steps, 0)
        late = _sequences(runner, max(1, args.rows // 2), args.prompt_len // 2, args.steps, 7)
        job = core.add_job(0, first, None)
        while core.jobs:
            core.prefill(job, job.remaining)
        steps: list[float] = []
        timer.spent.clear()
        step = 0
        while core.running_rows or core.jobs:
            if step == args.steps // 4:
                job2 = core.add_job(0, late, None)
                while core.jobs:
                    core.prefill(job2, job2.remaining)
            timer.active = True
            t0 = time.perf_counter()
            core.decode()
            steps.append(time.perf_counter() - t0)
            timer.active = False
            step += 1
        tokens = [list(s.generated) for s in first + late]
        return steps, dict(timer.spent), tokens

    one_pass(False)  # warm: allocator, kernels
    steps, spent, tokens = one_pass(False)
    total = sum(steps)
    parts = {k: spent.get(k, 0.0) for k in ("model", "sampling", "per-seq python")}
    parts["cache + rest"] = max(0.0, total - sum(parts.values()))
    # Operator split of the model call over one more pass.
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        one_pass(True)
    by_kind: dict[str, float] = defaultdict(float)
    for ev in prof.key_averages():
        by_kind[_op_kind(ev.key)] += ev.self_cpu_time_total
    prof_total = sum(by_kind.values()) or 1.0
    return {
        "model": args.model,
        "dtype": getattr(getattr(runner, "precision", None), "name", "float32"),
        "rows": args.rows,
        "prompt_len": args.prompt_len,
        "steps": len(steps),
        "step_ms_mean": 1000 * total / len(steps),
        "step_ms_p50": 1000 * statistics.median(steps),
        "step_ms_p95": 1000 * sorted(steps)[int(0.95 * (len(steps) - 1))],
        "phases_ms_per_step": {k: 1000 * v / len(steps) for k, v in parts.items()},
        "profile_share": {k: v / prof_total for k, v in sorted(by_kind.items())},
        "tokens": tokens,
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "lenbatch": os.path.dirname(decode_mod.__file__),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=160)
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--dtype", help="runner dtype (float32, bfloat16, auto)")
    p.add_argument("--runner-args", help="extra CausalLMRunner keyword arguments as JSON")
    p.add_argument("--json", help="write the summary (with generated tokens) here")
    args = p.parse_args()
    out = run(args)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)
    shown = {k: v for k, v in out.items() if k != "tokens"}
    print(json.dumps(shown, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
