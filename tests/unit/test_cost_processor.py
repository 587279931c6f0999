"""Cost models are keyed by the processor they were measured on; readers warn on another."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from lenbatch.cli.build import _serve_cost
from lenbatch.cli.common import load_cost_model
from lenbatch.core.clock import FakeClock
from lenbatch.plan.costmodel import CostModel, processor_mismatch
from lenbatch.plan.costsource import SOURCE_COST_DIR
from lenbatch.plan.profile import profile_and_fit
from lenbatch.runners.fake import FakeRunner
from lenbatch.runners.hardware import processor_key

ZEN5 = "cpu:AMD EPYC 9755 [AuthenticAMD family 26 model 2; avx2 avx512f avx_vnni] x2"


def test_mismatch_names_both_processors() -> None:
    """Same processor: no warning; another: both named; none recorded: says it predates keys."""
    here = ZEN5
    assert processor_mismatch(CostModel(0.01, processor=here), here) is None
    other = processor_mismatch(CostModel(0.01, processor="cpu:Intel Xeon x2"), here)
    assert other is not None and "Intel Xeon" in other and "AMD EPYC" in other
    unknown = processor_mismatch(CostModel(0.01), here)
    assert unknown is not None and "predates" in unknown


def test_mismatch_says_what_differs() -> None:
    """Another model number of the same family, or another thread count, is named."""
    zen4 = "cpu:AMD EPYC 9755 [AuthenticAMD family 26 model 17; avx2 avx512f avx_vnni] x2"
    why = processor_mismatch(CostModel(0.01, processor=zen4), ZEN5)
    assert why is not None and "model number 17 vs 2" in why
    why = processor_mismatch(CostModel(0.01, processor=ZEN5.replace("x2", "x1")), ZEN5)
    assert why is not None and "threads 1 vs 2" in why


def test_committed_cost_files_load_and_never_match() -> None:
    """Every cost model committed in bench/results loads; none has a key of the current form,
    so none is taken for any processor, this one included, and the reason says why."""
    costs = [CostModel.load(p) for p in sorted(SOURCE_COST_DIR.glob("cost_*.json"))]
    assert costs
    for cost in costs:
        assert (cost.quantization, cost.work) == ("none", "encoder_batch")
        why = processor_mismatch(cost, processor_key("cpu"))
        assert why is not None
        assert "predates" in why if not cost.processor else "model number" in why


def test_old_cost_files_still_load(tmp_path: Path) -> None:
    """A cost model written before processor keys loads, with the fields empty."""
    path = tmp_path / "old.json"
    path.write_text('{"const": 0.01, "per_token": 1e-5, "model": "m"}')
    cost = CostModel.load(path)
    assert (cost.processor, cost.dtype, cost.execution) == ("", "", "")
    keyed = CostModel(0.01, processor="cpu:X", dtype="bfloat16", execution="packed")
    keyed.save(path)
    back = CostModel.load(path)
    assert (back.processor, back.dtype, back.execution) == ("cpu:X", "bfloat16", "packed")


def test_profile_records_this_processor() -> None:
    """`profile` writes the processor key of the machine it ran on."""
    clock = FakeClock()
    runner = FakeRunner(max_length=64, cost=lambda b, n: 0.001 * b * n, clock=clock)
    cost = profile_and_fit(runner, [1, 2, 4], [8, 16, 32], repeats=1, warmup=0)
    assert cost.processor == processor_key("cpu")
    assert cost.execution == "padded"


def test_readers_warn_on_another_processor(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """CLI readers print a warning and `serve` logs one for a foreign cost model; none for
    this machine's."""
    foreign, own = tmp_path / "foreign.json", tmp_path / "own.json"
    CostModel(0.01, processor="cpu:Some Other CPU x64").save(foreign)
    CostModel(0.01, processor=processor_key("cpu")).save(own)
    load_cost_model(str(foreign))
    load_cost_model(str(own))
    err = capsys.readouterr().err
    assert err.count("warning") == 1 and "Some Other CPU" in err
    with caplog.at_level(logging.INFO, logger="lenbatch"):
        _serve_cost(str(foreign), "cpu", FakeRunner())
        _serve_cost(str(own), "cpu", FakeRunner())
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "Some Other CPU" in warnings[0].getMessage()
