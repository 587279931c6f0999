"""A decode step's layers in one call of the C++ op `decode_layers` (the lean Llama path,
bfloat16, few-row products) or `decode_layers_groups` (float32, the group loop's products of a
GGUF's blocks) against the same step run op by op from Python (`LENBATCH_DECODE_LAYERS=off`'s
path, itself checked against transformers in test_lean_llama.py): the same logits and the same
keys and values in the cache, bit for bit, through the running batch's life (rows leaving,
rows joining with their own padding), and the op-by-op path wherever the one call does not
apply."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lenbatch.generate.kvcache import KVBatch
from lenbatch.runners.causal import CausalLMRunner, new_cache
from lenbatch.runners.llama import LeanLlama
from lenbatch.runners.weightonly import LinearPlan
from tests.helpers import needs_avx512, needs_op

# Every product of up to 8 rows on the one call's kernel: the few-row bfloat16 op, or the
# float32 group loop (the plan a server measures at load may pick other row counts on another
# CPU). Each precision's op name, and the CPUs that build it.
_PRECISIONS = {
    "bfloat16": (LinearPlan(pack=False, gemv_rows=8, gated_rows=8), "decode_layers"),
    "float32": (LinearPlan(quantization="int4", switch_rows=8), "decode_layers_groups"),
}
_BOTH = pytest.mark.parametrize(
    "dtype",
    [
        pytest.param("bfloat16", marks=needs_avx512),
        pytest.param("float32", marks=needs_op),
    ],
)


class _Counted:
    """The C++ ops, counting calls of the one-call op `name`."""

    def __init__(self, op: Any, name: str) -> None:
        self.op, self.name, self.calls = op, name, 0

    def __getattr__(self, attr: str) -> Any:
        if attr != self.name:
            return getattr(self.op, attr)

        def counted(*args: Any) -> Any:
            self.calls += 1
            return getattr(self.op, attr)(*args)

        return counted


def _runner(tiny_llama_dir: Path, dtype: str) -> CausalLMRunner:
    return CausalLMRunner(tiny_llama_dir, name="tiny-llama", dtype=dtype)


def _lean(runner: CausalLMRunner, one_call: bool) -> LeanLlama:
    plan, name = _PRECISIONS[runner.precision.name]
    lean = LeanLlama(runner.model, plan, runner.info.max_length + 1, runner.precision.dtype)
    assert lean.one_call is not None  # built here, not switched off
    if not one_call:
        lean.one_call = None
    else:
        lean.one_call = _Counted(lean.one_call, name)
    return lean


def _prefilled(lean: LeanLlama, lengths: tuple[int, ...], seed: int) -> KVBatch:
    """A running batch of left-padded prompts of `lengths` (random tokens), prefilled."""
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros((len(lengths), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, n in enumerate(lengths):
        ids[r, width - n :] = torch.randint(5, 200, (n,), generator=gen)
        mask[r, width - n :] = 1
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    cache = new_cache()
    logits = lean.forward(ids, mask, pos, cache)
    return KVBatch(cache, mask, pos[:, -1] + 1, logits.argmax(-1))


def _windows(kv: KVBatch) -> list[torch.Tensor]:
    return [t.clone() for layer in kv.cache.window_layers() for t in (layer.keys, layer.values)]


def _step(lean: LeanLlama, kv: KVBatch) -> torch.Tensor:
    ids, mask, pos = kv.step_inputs()
    logits = lean.forward(ids, mask, pos, kv.cache)
    kv.advance(mask, logits.argmax(-1))
    return logits


@_BOTH
def test_decode_steps_in_one_call_equal_the_op_by_op_steps(
    tiny_llama_dir: Path, dtype: str
) -> None:
    """Twelve decode steps of a running batch, the one call against op by op: equal logits
    and equal cached keys and values after every step, while a row leaves (its place filled
    from the tail) and two prompts join (wider than the window: it grows to the left, and the
    mask has holes). Every step took the one call."""
    runner = _runner(tiny_llama_dir, dtype)
    paths = {"one": _lean(runner, True), "ops": _lean(runner, False)}
    batches = {name: _prefilled(lean, (9, 4, 13), seed=0) for name, lean in paths.items()}
    for step in range(12):
        if step == 4:
            for kv in batches.values():
                kv.select([0, 2])  # row 1 leaves, row 2 moves up
        if step == 7:
            for name, kv in batches.items():
                joining = _prefilled(paths[name], (31, 6), seed=1)
                kv.join(joining.cache, joining.mask, joining.next_pos, joining.last)
        got = {name: _step(paths[name], kv) for name, kv in batches.items()}
        assert torch.equal(got["one"], got["ops"]), step
        one, ops = (_windows(batches[name]) for name in ("one", "ops"))
        assert all(torch.equal(a, b) for a, b in zip(one, ops, strict=True)), step
    assert batches["one"].rows == 4 and batches["one"].width > 31
    assert paths["one"].one_call.calls == 12
    assert paths["ops"].one_call is None


@_BOTH
def test_the_op_by_op_path_runs_where_the_one_call_does_not_apply(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch, dtype: str
) -> None:
    """No one call for more rows than the few-row op takes (the plan's 8), for a prompt
    (several new columns), for a cache that is not the running batch's window (a prompt
    decoded alone), or with `LENBATCH_DECODE_LAYERS=off`; the running batch of 9 rows still
    decodes as op by op does."""
    runner = _runner(tiny_llama_dir, dtype)
    one, ops = _lean(runner, True), _lean(runner, False)
    assert one._packed_at(8) is not None and one._packed_at(9) is None
    lengths = (3, 5, 7, 9, 11, 4, 6, 8, 10)
    kv_one, kv_ops = _prefilled(one, lengths, seed=2), _prefilled(ops, lengths, seed=2)
    assert one.one_call.calls == 0  # the prefill
    for _ in range(3):
        assert torch.equal(_step(one, kv_one), _step(ops, kv_ops))
    assert one.one_call.calls == 0
    runner.lean = one  # a prompt decoded alone: a transformers cache, not a window
    runner.greedy_alone([5, 6, 7, 8], 4)
    assert one.one_call.calls == 0
    monkeypatch.setenv("LENBATCH_DECODE_LAYERS", "off")
    plan = _PRECISIONS[dtype][0]
    assert LeanLlama(runner.model, plan, 64, runner.precision.dtype).one_call is None
