"""`tune`: the search finds configs that meet the SLO, and writes one `serve` can load."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from lenbatch.cli import main
from lenbatch.config import AdmissionConfig, BatchingConfig, load_settings
from lenbatch.plan.costmodel import CostModel
from lenbatch.plan.sweep import Probe
from lenbatch.plan.trace import Trace
from lenbatch.plan.tune import settings_toml, tune

COST = CostModel(const=0.01, per_token=2e-5)
SMALL = {"buckets": (2, 3), "waits_ms": (1.0, 5.0, 20.0), "batches": (8, 32)}


def bimodal_trace(n: int = 600, rate: float = 40.0) -> Trace:
    rng = np.random.default_rng(2)
    arrivals = np.cumsum(rng.exponential(1 / rate, n))
    short = rng.integers(5, 20, n)
    long = rng.integers(180, 250, n)
    lengths = np.where(rng.random(n) < 0.8, short, long)
    return Trace(lengths.astype(np.int64), arrivals - arrivals[0], source="bimodal")


def test_tune_repairs_a_start_that_misses_the_slo() -> None:
    """A 300 ms max wait cannot meet a 100 ms P95; the search finds configs that do, and the
    capacity it reports is sustainable when simulated again."""
    t = bimodal_trace()
    start = BatchingConfig(max_wait_ms=300)
    res = tune(t, COST, start, slo_p95_ms=100.0, **SMALL)  # type: ignore[arg-type]
    assert res.start.capacity is None
    assert res.met_slo and res.best.capacity is not None
    assert res.best.capacity_rps <= res.oracle.throughput_rps
    probe = Probe(t, COST, None, 100.0)
    assert probe(res.best.batching, 1.0).sustainable
    again = probe(res.best.batching, res.best.capacity.rate_scale)
    assert again.sustainable and again.throughput_rps == res.best.capacity_rps
    assert res.best.batching.boundaries is not None


def test_tuned_capacity_is_never_below_the_start() -> None:
    """The start is a candidate: a new incumbent must sustain more load."""
    t = bimodal_trace()
    res = tune(t, COST, BatchingConfig(), slo_p95_ms=150.0, **SMALL)  # type: ignore[arg-type]
    assert res.start.capacity is not None
    assert res.best.capacity_rps >= res.start.capacity_rps
    assert len(res.tried) > 10


def test_settings_toml_round_trips_through_load_settings(tmp_path: Path) -> None:
    """The written file is what `serve --config` reads, field for field."""
    cfg = BatchingConfig(
        boundaries=(20, 200), bucket_max_batch=(16, 4), bucket_max_wait_ms=(2.5, 1e-05)
    )
    adm = AdmissionConfig(max_queue_total=100, request_timeout_s=2.0)
    path = tmp_path / "tuned.toml"
    path.write_text(settings_toml(cfg, adm))
    loaded = load_settings(path, env={})
    assert loaded.batching == cfg
    assert loaded.admission == adm


def test_cli_tune_writes_a_config_simulate_reproduces(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`tune --out` then `simulate --config` predicts the same P95 that tune printed."""
    t = bimodal_trace(300, rate=30.0)
    trace = tmp_path / "trace.jsonl"
    trace.write_text(
        "".join(
            json.dumps({"timestamp": 1000 * float(a), "input_length": int(n), "output_length": 1})
            + "\n"
            for a, n in zip(t.arrivals, t.input_lengths, strict=True)  # type: ignore[arg-type]
        )
    )
    cost = tmp_path / "cost.json"
    COST.save(cost)
    out = tmp_path / "tuned.toml"
    argv = ["tune", str(trace), "--cost", str(cost), "--slo-p95-ms", "150", "--json"]
    small = ["--buckets", "2", "--waits-ms", "2,10", "--batches", "32", "--methods", "kmeans"]
    assert main([*argv, *small, "--out", str(out)]) == 0
    tuned = json.loads(capsys.readouterr().out)
    assert tuned["met_slo"] and tuned["config"] == out.read_text()
    assert main(["simulate", str(trace), "--cost", str(cost), "--config", str(out), "--json"]) == 0
    sim = json.loads(capsys.readouterr().out)
    assert sim == tuned["at_trace_rate"]
