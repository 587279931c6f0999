"""`lenbatch analyze`, `fit` and `profile` end to end, and the length log written by the real
engine read back by them."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest

from lenbatch.cli import main
from lenbatch.config import BatchingConfig, load_settings
from lenbatch.core.buckets import BucketSet
from lenbatch.core.lanes import resolve_scheduler
from lenbatch.embed.engine import Engine
from lenbatch.plan.costmodel import CostModel
from lenbatch.plan.trace import load_trace, map_trace
from lenbatch.runners.fake import FakeRunner
from lenbatch.serving.lengthlog import LengthLog

FIX = Path(__file__).parent.parent / "fixtures"
MAPPING = ["--length-scale", "0.05", "--max-length", "256"]


def _json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict[str, object]:
    assert main(argv) == 0
    out: dict[str, object] = json.loads(capsys.readouterr().out)
    return out


def test_analyze_json_matches_numpy(capsys: pytest.CaptureFixture[str]) -> None:
    """`analyze --json` on the mapped dev trace: nearest-rank percentiles equal numpy's, and
    the mapping is reported."""
    out = _json(capsys, ["analyze", "azure-conv", *MAPPING, "--json"])
    lengths = map_trace(load_trace("azure-conv"), length_scale=0.05, max_length=256).input_lengths
    for q in (50, 75, 90, 95, 99):
        assert out[f"p{q}"] == np.percentile(lengths, q, method="inverted_cdf")
    assert out["count"] == 19366 and out["max"] == 256
    assert out["mean_rate"] == pytest.approx(19366 / 3501.7, rel=1e-3)
    assert out["peak_rate"] == 16
    assert out["notes"] == ["input lengths x0.05", "clipped 70 inputs to 256 tokens"]


@pytest.mark.slow
def test_analyze_text_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Text output names the mapping; --plot writes a PNG."""
    png = tmp_path / "h.png"
    assert main(["analyze", str(FIX / "azure_conv_head12.csv"), "--plot", str(png), "--log-x"]) == 0
    text = capsys.readouterr().out
    assert "mapping: none" in text and "burstiness" in text
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_unknown_format_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    """An unreadable trace is a clear error and exit status 2."""
    assert main(["analyze", str(FIX / "generic_ms.csv")]) == 2
    assert "--length-column" in capsys.readouterr().err


def test_generic_columns_from_cli(capsys: pytest.CaptureFixture[str]) -> None:
    """Generic CSV columns are named on the command line."""
    argv = ["analyze", str(FIX / "generic_ms.csv"), "--length-column", "prompt_tokens"]
    out = _json(capsys, [*argv, "--arrival-column", "t_ms", "--time-unit", "ms", "--json"])
    assert out["count"] == 4 and out["max"] == 300 and out["duration_s"] == pytest.approx(3.0)


@pytest.mark.parametrize("method", ["quantile", "kmeans", "optimal"])
def test_fit_snippet_round_trips(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], method: str
) -> None:
    """`fit --out` writes a [batching] section that load_settings reads back with the same
    boundaries, and that resolves for a 256-token model."""
    snippet = tmp_path / "fit.toml"
    argv = ["fit", "azure-conv", *MAPPING, "--method", method, "--rate", "full"]
    out = _json(capsys, [*argv, "--buckets", "4", "--out", str(snippet), "--json"])
    settings = load_settings(snippet, env={})
    assert settings.batching.strategy == "bucketed"
    assert settings.batching.boundaries == tuple(out["boundaries"])  # type: ignore[arg-type]
    assert resolve_scheduler(settings.batching, 256).boundaries == tuple(out["boundaries"])  # type: ignore[arg-type]
    assert 0 < out["expected_padding_waste"] < 1  # type: ignore[operator]
    assert sum(out["shares"]) == pytest.approx(1.0)  # type: ignore[arg-type]
    assert len(out["per_bucket"]) == len(out["boundaries"]) + 1  # type: ignore[arg-type]


def test_fit_text_prints_reasoning(capsys: pytest.CaptureFixture[str]) -> None:
    """Text mode prints the mapping, the auto-K reasoning and the snippet."""
    assert main(["fit", "azure-conv", *MAPPING, "--rate", "full"]) == 0
    text = capsys.readouterr().out
    assert "mapping: input lengths x0.05" in text
    assert "chose K=" in text and "[batching]" in text and "boundaries = [" in text


def test_fit_uses_cost_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--cost takes the batch overhead from a cost model file."""
    path = tmp_path / "cost.json"
    CostModel(const=0.03, per_token=2e-4, model="m").save(path)
    out = _json(capsys, ["fit", str(FIX / "lengthlog.jsonl"), "--cost", str(path), "--json"])
    assert any("150 token-equivalents" in line for line in out["reasoning"])  # type: ignore[union-attr]


async def test_engine_length_log_round_trip(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A length log written by the real engine (fake runner) loads as a trace with the same
    lengths, buckets and statuses, and `analyze` and `fit` read it."""
    path = tmp_path / "lengths.jsonl"
    runner = FakeRunner(max_length=64)
    cfg = BatchingConfig(boundaries=(8, 16, 32), max_wait_ms=1)
    engine = Engine(runner, cfg, length_log=LengthLog(path))
    await engine.start()
    words = [1, 3, 5, 6, 9, 13, 14, 20, 29, 40, 55, 62, 3, 7]
    ids = engine.tokenize([" ".join(["w"] * n) for n in words])
    await asyncio.gather(*(engine.embed([x]) for x in ids))
    await engine.stop()

    trace = load_trace(path)
    sent = sorted(len(x) for x in ids)
    assert sorted(trace.input_lengths.tolist()) == sent
    buckets = BucketSet((8, 16, 32), 64)
    expect = [buckets.label(buckets.bucket_of(n)) for n in trace.input_lengths]
    assert trace.extra["bucket"].tolist() == expect
    assert set(trace.extra["status"].tolist()) == {"ok"}
    assert trace.arrivals is not None and trace.duration < 60

    out = _json(capsys, ["analyze", str(path), "--json"])
    assert out["count"] == len(words) and out["max"] == max(sent)
    assert out["log"]["statuses"] == {"ok": len(words)}  # type: ignore[index]
    fit = _json(capsys, ["fit", str(path), "--max-length", "64", "--buckets", "2", "--json"])
    assert len(fit["boundaries"]) <= 2  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.model
def test_profile_minilm_small_grid(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`profile` on the real model writes a cost model with one point per grid cell and a
    per-bucket max batch under a budget."""
    path = tmp_path / "cost.json"
    argv = ["profile", "--out", str(path), "--batch-sizes", "1,2", "--lengths", "8,16"]
    argv += ["--repeats", "1", "--warmup", "0", "--memory-budget-mb", "4096"]
    assert main([*argv, "--boundaries", "8,16"]) == 0
    text = capsys.readouterr().out
    cost = CostModel.load(path)
    assert len(cost.points) == 4 and cost.model == "all-MiniLM-L6-v2"
    assert cost.weights_bytes > 50e6  # ~22.7M float32 parameters
    assert cost.latency(2, 16) > 0 and "rss" in cost.memory_method
    assert "bucket_max_batch = [" in text and "relative RMS error" in text
