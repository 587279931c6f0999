"""One decode step through `CausalLMRunner` + the KV batch, per runner configuration and row count.

    bench/llm_decode_step.py --model smollm2 --rows 1,8,32 --cols 310 --steps 30 \\
        [--configs hf-fp32,lean-fp32,hf-bf16,lean-bf16,lean-bf16-dense,lean-bf16-int8,...] \\
        [--out bench/results/llm_decode_step.md]
    bench/llm_decode_step.py --configs lean-bf16 --rows 8,24,32 --mixed 1x64,2x135 \\
        --out bench/results/llm_mixed_step.md

Each row count gets a running batch (`generate.kvcache.KVBatch`) of that many rows whose cache
holds `--cols` columns (one real prompt prefilled once, its keys and values copied into every
row); a step is `runner.forward` on the batch's step inputs, after which the cache's window is
rolled back, so every timed step reads exactly `--cols` cached columns. Reported: the median
and the 10th-90th percentile range of `--steps` steps, per configuration; configurations take
turns step by step (A/B interleaved), so a load change on a shared machine hits them alike.

Configurations: `hf` is transformers' forward (`lean=False`), `lean` the lean Llama path
(`runners.llama`; `lean-bf16-dense` is `lean-bf16` without lenbatch's few-row product,
`rowlinears.Bf16Gemv`), with the linears' measured plan (prepacking, and for `-int8`/`-int4` the
switch point to weight-only kernels) printed beside it. The processor key heads the table.

`--mixed ROWSxCOLS[@CACHED],...` times, instead, what continuous batching runs on the lean path:
for each row count and prompt chunk (ROWS prompts of COLS tokens of the same text, after CACHED
tokens of it already in the chunk's cache: a prompt's later chunk), the decode step
alone, the chunk's prefill alone (a fresh cache), and both in one forward
(`runner.forward_segments`), the three interleaved step by step; the table gives the medians
and one forward's time over the two apart.

`--split` splits, instead, one decode step of each lean configuration (with `--mixed`, one forward
carrying the decode step and each prompt chunk) by part: each of the C++ ops
(`decode_attention`, `add_rms_norm`, `rope`, ...) and each product (`qkv`, `o`, `gate_up_silu`
with its activation, `down`, `lm_head`), wall-clock ms per step summed over the layers (a
timing wrapper around each call; the rest of the step is Python and torch's small ops).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from dataclasses import replace
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from lenbatch.generate.kvcache import KVBatch
from lenbatch.runners.base import Segment
from lenbatch.runners.causal import CausalLMRunner, new_cache, resolve_causal_model
from lenbatch.runners.hardware import processor_key
from lenbatch.runners.llama import LeanLlama

DEFAULT_CONFIGS = (
    "hf-fp32",
    "lean-fp32",
    "hf-bf16",
    "lean-bf16",
    "lean-bf16-int8",
    "lean-bf16-int4",
    "lean-fp32-int4",
)
CONFIGS = {
    "hf-fp32": {"dtype": "float32", "lean": False},
    "lean-fp32": {"dtype": "float32"},
    "hf-bf16": {"dtype": "bfloat16", "lean": False},
    "lean-bf16": {"dtype": "bfloat16"},
    # the same with every product dense (no `Bf16Gemv` at few rows): its A/B
    "lean-bf16-dense": {"dtype": "bfloat16", "gemv_rows": 0},
    "lean-bf16-int8": {"dtype": "bfloat16", "quantization": "int8"},
    "lean-bf16-int4": {"dtype": "bfloat16", "quantization": "int4"},
    "lean-fp32-int8": {"dtype": "float32", "quantization": "int8"},
    "lean-fp32-int4": {"dtype": "float32", "quantization": "int4"},
    # the same with torch's attention for whole prompts (`LENBATCH_PROMPT_ATTENTION=sdpa`): the
    # AVX2 build's causal prompt loop's A/B
    "lean-fp32-int4-sdpa": {
        "dtype": "float32",
        "quantization": "int4",
        "env": {"LENBATCH_PROMPT_ATTENTION": "sdpa"},
    },
}


def prompt_ids(runner: CausalLMRunner, cols: int) -> list[int]:
    """The first `cols` tokens of the bundled GSM8K text."""
    ref = resources.files("lenbatch") / "data" / "text" / "gsm8k_test.jsonl"
    text = ref.read_text(encoding="utf-8")[: 20 * cols]
    ids = runner.tokenize([text])[0]
    if len(ids) < cols:
        raise SystemExit(f"the bundled text gives only {len(ids)} tokens, fewer than {cols}")
    return ids[:cols]


def running_batch(runner: CausalLMRunner, ids: list[int], rows: int) -> KVBatch:
    """A running batch of `rows` copies of the prefilled prompt `ids`."""
    x = torch.tensor([ids])
    mask = torch.ones_like(x)
    pos = torch.arange(len(ids))[None]
    one = new_cache(runner.model.config)
    logits = runner.forward(x, mask, pos, one)
    tiled = new_cache(runner.model.config)
    for i, layer in enumerate(one.layers):
        tiled.update(layer.keys.repeat(rows, 1, 1, 1), layer.values.repeat(rows, 1, 1, 1), i)
    last = logits.argmax(-1).repeat(rows)
    return KVBatch(tiled, mask.repeat(rows, 1), torch.full((rows,), len(ids)), last)


def build_runner(ref: Any, name: str, env: dict[str, str] | None = None) -> CausalLMRunner:
    """The runner of configuration `name` (`CONFIGS`) for the resolved model `ref`, with the
    configuration's environment and `env` set while it is built (each is read once, there)."""
    cfg = dict(CONFIGS[name])
    gemv_rows = cfg.pop("gemv_rows", None)
    env = {**cfg.pop("env", {}), **(env or {})}  # type: ignore[dict-item]
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        runner = CausalLMRunner(ref.folder, gguf_file=ref.gguf_file, name=ref.name, **cfg)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    if gemv_rows is not None and runner.lean is not None:  # the measured plan, but this
        plan = replace(runner.lean.plan, gemv_rows=int(gemv_rows), gemv_shapes=(), gated_rows=0)
        runner.lean = LeanLlama(
            runner.model, plan, runner.info.max_length + 1, runner.precision.dtype
        )
    return runner


def _step(runner: CausalLMRunner, kv: KVBatch) -> float:
    ids, mask, pos = kv.step_inputs()
    t0 = time.perf_counter()
    runner.forward(ids, mask, pos, kv.cache)
    elapsed = time.perf_counter() - t0
    kv.rollback()  # the window reads `cols` columns again next step
    return elapsed


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--rows", default="1,8,32")
    p.add_argument("--cols", type=int, default=310)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS))
    p.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    p.add_argument("--out", type=Path, help="write the table (markdown) here")
    p.add_argument(
        "--mixed",
        metavar="ROWSxCOLS[@CACHED],...",
        help="time these prompt chunks alone, the decode step alone, and both in one forward",
    )
    p.add_argument("--split", action="store_true", help="split each decode step by op and product")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ref = resolve_causal_model(args.model)
    if ref is None:
        raise SystemExit(f"{args.model} is not a causal LM")
    names = args.configs.split(",")
    runners = {name: build_runner(ref, name) for name in names}
    first = next(iter(runners.values()))
    ids = prompt_ids(first, args.cols)
    rows_list = [int(r) for r in args.rows.split(",")]
    if args.split:
        return _split_table(args, runners, ids, rows_list)
    if args.mixed:
        return _mixed_table(args, runners, ids, rows_list)
    table: dict[tuple[str, int], list[float]] = {}
    for rows in rows_list:
        batches = {n: running_batch(r, ids, rows) for n, r in runners.items()}
        for n in names:  # warm-up
            for _ in range(3):
                _step(runners[n], batches[n])
        for _ in range(args.steps):
            for n in names:
                table.setdefault((n, rows), []).append(_step(runners[n], batches[n]))
        del batches

    def cell(xs: list[float]) -> str:
        q = statistics.quantiles(xs, n=10)
        return f"{1000 * statistics.median(xs):.1f} ({1000 * q[0]:.1f}-{1000 * q[-1]:.1f})"

    def plan(r: CausalLMRunner) -> str:
        return r.lean.plan.describe() if r.lean is not None else "transformers forward"

    lines = [
        *header(),
        "One decode step, ms: median (10th-90th percentile) of "
        f"{args.steps} steps at {args.cols} cached columns.",
        "",
        "| config | linears | " + " | ".join(f"{r} rows" for r in rows_list) + " |",
        "|---|---|" + "---:|" * len(rows_list),
    ]
    for n in names:
        cells = " | ".join(cell(table[(n, r)]) for r in rows_list)
        lines.append(f"| {n} | {plan(runners[n])} | {cells} |")
    return write(lines, args.out)


def header(script: str = "bench/llm_decode_step.py") -> list[str]:
    """The table's head: the processor key, torch and Python, and the command line."""
    return [
        f"Processor: `{processor_key()}`; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, Python {platform.python_version()}.",
        "",
        f"Command: `{' '.join([script, *sys.argv[1:]])}`",
        "",
    ]


def write(lines: list[str], out: Path | None) -> int:
    """Print the table, and write it to `out` where given."""
    text = "\n".join(lines) + "\n"
    print(text)
    if out:
        out.write_text(text, encoding="utf-8")
    return 0


Chunk = tuple[int, int, int]  # prompts, columns, columns cached before them


def _segment(runner: CausalLMRunner, ids: list[int], chunk: Chunk) -> Segment:
    """`rows` copies of `cols` tokens of `ids` as a prompt's chunk, in a fresh cache that
    holds the `cached` tokens before them (prefilled here, untimed)."""
    rows, cols, cached = chunk
    cache = runner.new_cache()
    if cached:
        before = torch.tensor([ids[:cached]] * rows)
        runner.forward(
            before, torch.ones_like(before), torch.arange(cached).expand(rows, -1), cache
        )
    x = torch.tensor([ids[cached : cached + cols]] * rows)
    pos = torch.arange(cached, cached + cols)[None].repeat(rows, 1)
    return Segment(x, torch.ones(rows, cached + cols, dtype=torch.long), pos, cache)


def _chunks(args: argparse.Namespace, ids: list[int]) -> list[Chunk]:
    """`--mixed`'s prompt chunks as (prompts, columns, cached columns): ROWSxCOLS[@CACHED]."""
    chunks = []
    for c in args.mixed.split(","):
        shape, _, cached = c.partition("@")
        prompts, _, cols = shape.partition("x")
        chunks.append((int(prompts), int(cols), int(cached or 0)))
    if any(cols < 1 or cols + cached > len(ids) for _, cols, cached in chunks):
        raise SystemExit(
            f"--mixed wants ROWSxCOLS[@CACHED] with COLS + CACHED <= --cols ({args.cols})"
        )
    return chunks


def _label(chunk: Chunk) -> str:
    return f"{chunk[0]} x {chunk[1]}" + (f" after {chunk[2]}" if chunk[2] else "")


def _mixed_step(
    runner: CausalLMRunner,
    kv: KVBatch,
    ids: list[int],
    chunk: Chunk,
    spent: dict[str, float] | None = None,
) -> float:
    """Seconds of one forward carrying `kv`'s decode step and a prompt `chunk` (`spent`, the
    split's per-part sums, left as they were by the untimed prefill of its cached columns)."""
    step_ids, step_mask, step_pos = kv.step_inputs()
    before = dict(spent or {})
    segs = [Segment(step_ids, step_mask, step_pos, kv.cache), _segment(runner, ids, chunk)]
    if spent is not None:
        spent.clear()
        spent.update(before)
    t0 = time.perf_counter()
    runner.forward_segments(segs)
    elapsed = time.perf_counter() - t0
    kv.rollback()
    return elapsed


def _one(
    runner: CausalLMRunner,
    kv: KVBatch,
    ids: list[int],
    chunk: Chunk | None,
    spent: dict[str, float] | None = None,
) -> float:
    """Seconds of one decode step, with prompt `chunk` in the same forward where given."""
    return _step(runner, kv) if chunk is None else _mixed_step(runner, kv, ids, chunk, spent)


def _mixed_table(
    args: argparse.Namespace,
    runners: dict[str, CausalLMRunner],
    ids: list[int],
    rows_list: list[int],
) -> int:
    """Decode step, prompt chunk, and both in one forward, per config, rows and chunk."""
    chunks = _chunks(args, ids)
    lines = [
        *header(),
        f"Milliseconds, medians of {args.steps} of each, interleaved; the running batch's rows",
        f"each hold {args.cols} cached columns.",
        "",
        "| config | running rows | prompt chunk | decode step | prefill chunk | both apart "
        "| one forward | one / apart |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for name, runner in runners.items():
        if not runner.mixes:
            raise SystemExit(f"{name}: not on the lean path, no forward over several caches")
        for rows in rows_list:
            kv = running_batch(runner, ids, rows)
            for chunk in chunks:
                times: dict[str, list[float]] = {"decode": [], "prefill": [], "mixed": []}
                for i in range(args.steps + 3):
                    d = _step(runner, kv)
                    seg = _segment(runner, ids, chunk)
                    t0 = time.perf_counter()
                    runner.forward(seg.input_ids, seg.mask, seg.positions, seg.cache)
                    pf = time.perf_counter() - t0
                    mx = _mixed_step(runner, kv, ids, chunk)
                    if i >= 3:  # the first three warm up
                        times["decode"].append(d)
                        times["prefill"].append(pf)
                        times["mixed"].append(mx)
                med = {k: 1000 * statistics.median(v) for k, v in times.items()}
                apart = med["decode"] + med["prefill"]
                lines.append(
                    f"| {name} | {rows} | {_label(chunk)} | {med['decode']:.1f} | "
                    f"{med['prefill']:.1f} | {apart:.1f} | {med['mixed']:.1f} | "
                    f"{med['mixed'] / apart:.2f} |"
                )
            del kv
    return write(lines, args.out)


class _Timed:
    """Calls through `target`'s callables, adding each call's seconds to `spent[name]`."""

    def __init__(self, target: Any, spent: dict[str, float]) -> None:
        self._target, self._spent = target, spent

    def __getattr__(self, name: str) -> Any:
        return _timed(getattr(self._target, name), name, self._spent)


class _TimedCall:
    """`fn`, its calls' seconds added to `spent[name]`; its attributes read through (the lean
    path reads a layer product's own kernels, e.g. `gate_up_silu.linear`)."""

    def __init__(self, fn: Any, name: str, spent: dict[str, float]) -> None:
        self._fn, self._name, self._spent = fn, name, spent

    def __call__(self, *a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        out = self._fn(*a, **kw)
        self._spent[self._name] = self._spent.get(self._name, 0.0) + time.perf_counter() - t0
        return out

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._fn, attr)


def _timed(fn: Any, name: str, spent: dict[str, float]) -> Any:
    return _TimedCall(fn, name, spent)


# a lean layer's products (`gate_up_silu`: the gate/up product and its activation)
_PARTS = ("qkv", "o", "gate_up_silu", "down")


def _split_table(
    args: argparse.Namespace,
    runners: dict[str, CausalLMRunner],
    ids: list[int],
    rows_list: list[int],
) -> int:
    """One decode step per config and row count (with `--mixed`: one forward carrying it and
    each prompt chunk), split by C++ op and product."""
    chunks: list[Chunk | None] = [*_chunks(args, ids)] if args.mixed else [None]
    what = "forward (decode step and prompt chunk)" if args.mixed else "decode step"
    lines = [
        *header(),
        f"Milliseconds per {what} (mean of {args.steps}), {args.cols} cached columns; "
        "`step` is the median whole forward.",
        "",
    ]
    for name, runner in runners.items():
        lean = runner.lean
        if lean is None:
            raise SystemExit(f"{name}: not on the lean path, nothing to split")
        spent: dict[str, float] = {}
        kernel, head = lean.kernel, lean.lm_head
        saved = [{part: getattr(layer, part) for part in _PARTS} for layer in lean.layers]
        if kernel is not None:
            lean.kernel = _Timed(kernel, spent)
        lean.lm_head = _timed(head, "lm_head", spent)
        for layer in lean.layers:
            for part in _PARTS:
                setattr(layer, part, _timed(getattr(layer, part), part, spent))
        lines += [f"{name} ({lean.plan.describe()}):", ""]
        table: dict[str, tuple[float, dict[str, float]]] = {}
        for rows in rows_list:
            kv = running_batch(runner, ids, rows)
            for chunk in chunks:
                for _ in range(3):
                    _one(runner, kv, ids, chunk)
                spent.clear()
                steps = [_one(runner, kv, ids, chunk, spent) for _ in range(args.steps)]
                label = f"{rows} rows" + (f" + {_label(chunk)}" if chunk else "")
                table[label] = (statistics.median(steps), dict(spent))
            del kv
        parts = sorted({k for _, sp in table.values() for k in sp})
        lines.append("| part | " + " | ".join(table) + " |")
        lines.append("|---|" + "---:|" * len(table))
        for part in parts:
            cells = [f"{1000 * sp.get(part, 0.0) / args.steps:.2f}" for _, sp in table.values()]
            lines.append(f"| {part} | " + " | ".join(cells) + " |")
        whole = [f"{1000 * med:.1f}" for med, _ in table.values()]
        lines.append("| step | " + " | ".join(whole) + " |")
        lines.append("")
        lean.kernel, lean.lm_head = kernel, head
        for layer, originals in zip(lean.layers, saved, strict=True):
            for part, fn in originals.items():
                setattr(layer, part, fn)
    return write(lines, args.out)


if __name__ == "__main__":
    sys.exit(main())
