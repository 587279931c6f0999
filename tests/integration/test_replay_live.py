"""Short real replays on loopback: `lenbatch replay` against the real server app (MiniLM), and
`lenbatch bench` starting `lenbatch serve` and the naive peer as processes."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from lenbatch.cli import main
from lenbatch.plan.costmodel import CostModel
from lenbatch.plan.summary import SUMMARY_KEYS
from tests.integration.conftest import LiveServer

pytestmark = [pytest.mark.model, pytest.mark.slow]

MAPPING = ["--length-scale", "0.0625", "--max-length", "256", "--no-progress"]
COST = Path(__file__).parents[2] / "bench" / "results" / "cost_minilm_cpu.json"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_replay_against_lenbatch_serve(tmp_path: Path, served_minilm: LiveServer) -> None:
    """Every request is answered, and the server counted exactly the tokens we meant to send."""
    out = tmp_path / "summary.json"
    argv = ["replay", "azure-conv", "--url", served_minilm.url, "--start", "40", "--duration", "3"]
    assert main([*argv, *MAPPING, "--json", str(out)]) == 0
    s = json.loads(out.read_text())
    assert set(SUMMARY_KEYS) <= set(s)
    assert s["requests"] >= 5
    assert s["completed"] == s["requests"] and s["error_rate"] == 0.0
    # Text bodies were sized with MiniLM's tokenizer; the server's count must agree exactly.
    assert s["server"]["real_tokens"] == round(s["real_tokens_per_s"] * s["duration_s"])
    assert s["server"]["strategy"] == "bucketed"
    assert 0.0 <= s["padding_waste"] < 1.0
    assert [b["bucket"] for b in s["per_bucket"]][-1].startswith("overlong")
    assert sum(b["requests"] for b in s["per_bucket"]) == s["requests"]
    assert s["driver"]["send_lateness_max_ms"] is not None
    assert s["peak_memory_mb"] > 0


def test_bench_runs_a_strategy_and_the_naive_peer(tmp_path: Path) -> None:
    """One bench run: a lenbatch strategy and the naive peer, same traffic, one report, with
    the simulator's plain and calibrated predictions."""
    report = tmp_path / "report"
    argv = ["bench", "azure-conv", "--strategies", "fifo", "--peer", "naive", "--start", "40"]
    argv += ["--duration", "2", "--cost", str(COST)]
    assert main([*argv, *MAPPING, "--report", str(report)]) == 0
    text = (report / "report.md").read_text()
    assert "| fifo |" in text and "| naive |" in text
    assert "## Simulator prediction vs live" in text
    assert "## Calibrated prediction" in text and "| fifo (measured here) |" in text
    calibrated = CostModel.load(report / "calibrated_cost.json")
    assert calibrated.calibration.startswith("fifo at rate x1:")
    assert calibrated.const == CostModel.load(COST).const
    assert (report / "latency_cdf.png").exists()
    runs = {p.stem: json.loads(p.read_text()) for p in (report / "runs").glob("*.json")}
    assert set(runs) == {"fifo", "naive"}
    fifo, naive = runs["fifo"]["summary"], runs["naive"]["summary"]
    assert fifo["requests"] == naive["requests"] > 0
    assert fifo["completed"] == fifo["requests"] and naive["completed"] == naive["requests"]
    assert runs["fifo"]["result"]["lengths"] == runs["naive"]["result"]["lengths"]
    assert fifo["padding_waste"] is not None and naive["padding_waste"] is None
    cpu = fifo["server_cpu"]  # read from /proc during the replay: the loop did the HTTP work
    assert cpu["process_s"] >= cpu["loop_s"] > 0
    assert fifo["peak_memory_mb"] > 100 and naive["peak_memory_mb"] > 100
    assert sys.executable in runs["naive"]["command"]
    for run in runs.values():  # every server process is gone once the bench returns
        assert not _alive(run["pid"])
