"""`lenbatch simulate` end to end on a small trace file: text, JSON, several strategies, sweep."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lenbatch.cli import main
from lenbatch.plan.costmodel import CostModel
from lenbatch.plan.summary import SUMMARY_KEYS

ROWS = [  # TIMESTAMP, ContextTokens, GeneratedTokens (the Azure trace format)
    ("2023-11-16 18:15:46.6805900", 20, 5),
    ("2023-11-16 18:15:46.7000000", 300, 5),
    ("2023-11-16 18:15:47.0000000", 60, 5),
    ("2023-11-16 18:15:47.5000000", 120, 5),
    ("2023-11-16 18:15:48.0000000", 10, 5),
    ("2023-11-16 18:15:48.2000000", 40, 5),
]


@pytest.fixture
def files(tmp_path: Path) -> tuple[str, str]:
    trace = tmp_path / "trace.csv"
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"] + [f"{a},{b},{c}" for a, b, c in ROWS]
    trace.write_text("\n".join(lines) + "\n")
    cost = tmp_path / "cost.json"
    CostModel(const=0.01, per_token=1e-5, weights_bytes=2**20, model="test").save(cost)
    return str(trace), str(cost)


def test_json_summary_has_the_shared_keys(
    files: tuple[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """One strategy: a single summary with exactly the shared keys; 300 tokens > 256 is a 413."""
    trace, cost = files
    assert main(["simulate", trace, "--cost", cost, "--strategy", "fifo", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert tuple(out) == SUMMARY_KEYS
    assert (out["requests"], out["completed"], out["rejected"]) == (6, 5, 1)
    assert out["peak_memory_mb"] >= 1.0


def test_several_strategies_give_a_list_with_strategy_keys(
    files: tuple[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """`--strategy fifo,bucketed --json` prints one summary per strategy, in order."""
    trace, cost = files
    argv = ["simulate", trace, "--cost", cost, "--strategy", "fifo,bucketed", "--json"]
    assert main([*argv, "--max-length", "512"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [s["strategy"] for s in out] == ["fifo", "bucketed"]
    assert all(s["completed"] == 6 for s in out)
    assert len(out[1]["per_bucket"]) == 7  # default boundaries 16..512 for 512, + overlong


def test_text_report_names_the_default_boundaries_and_mapping(
    files: tuple[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """Without --boundaries the report says the engine's default is used and not fitted."""
    trace, cost = files
    argv = ["simulate", trace, "--cost", cost, "--length-scale", "0.5", "--strategy", "all"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "engine's default [16, 32, 64, 128, 256]" in out
    assert "input lengths x0.5" in out
    for name in ("static", "fifo", "sorted", "bucketed"):
        assert f"{name}, per bucket" in out


def test_text_report_says_how_batch_times_vary(
    files: tuple[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The cost-model line says whether batch times are drawn from a calibrated spread."""
    trace, cost = files
    assert main(["simulate", trace, "--cost", cost, "--strategy", "fifo"]) == 0
    assert "every batch takes its predicted time (no calibrated spread)" in capsys.readouterr().out
    spread = tmp_path / "spread.json"
    CostModel(const=0.01, per_token=1e-5, model="test", batch_spread=[0.5, 1.0, 1.5]).save(spread)
    assert main(["simulate", trace, "--cost", str(spread), "--strategy", "fifo"]) == 0
    assert "drawn from x0.60-x1.40 its prediction (P10-P90), seed 0" in capsys.readouterr().out


def test_the_seed_chooses_the_draws_from_the_spread(
    files: tuple[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """With a calibrated spread the same --seed gives the same run and another seed another;
    without one every seed gives the model's run."""
    trace, cost = files
    spread = tmp_path / "spread.json"
    CostModel(const=0.01, per_token=1e-5, model="test", batch_spread=[0.5, 1.0, 1.5]).save(spread)

    def p50(path: str, seed: int) -> float:
        argv = ["simulate", trace, "--cost", path, "--strategy", "fifo", "--json"]
        assert main([*argv, "--seed", str(seed)]) == 0
        return float(json.loads(capsys.readouterr().out)["p50_ms"])

    assert p50(str(spread), 3) == p50(str(spread), 3)
    assert len({p50(str(spread), s) for s in range(4)}) > 1
    assert p50(cost, 0) == p50(cost, 5)


def test_config_file_and_flags_merge_like_serve(
    files: tuple[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A serve config file sets boundaries and admission; a flag overrides max wait."""
    trace, cost = files
    cfg = tmp_path / "lenbatch.toml"
    cfg.write_text(
        "[batching]\nboundaries = [32, 128]\nmax_wait_ms = 500\n[admission]\nmax_queue_total = 1\n"
    )
    argv = ["simulate", trace, "--cost", cost, "--config", str(cfg), "--json"]
    assert main([*argv, "--max-wait-ms", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [b["bucket"] for b in out["per_bucket"]] == ["1-32", "33-128", "overlong(129-256)"]
    assert out["p50_ms"] < 100  # 1 ms wait, not the file's 500 ms


def test_sweep_json_reports_capacity_and_oracle(
    files: tuple[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--sweep prints capacity per strategy beside the oracle and writes the plot."""
    trace, cost = files
    png = tmp_path / "p95.png"
    argv = ["simulate", trace, "--cost", cost, "--sweep", "--slo-p95-ms", "200"]
    argv += ["--rates", "1,2", "--strategy", "fifo", "--max-length", "512"]
    assert main([*argv, "--plot", str(png), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["oracle"]["throughput_rps"] > 0
    (s,) = out["strategies"]
    assert s["strategy"] == "fifo"
    assert s["capacity_rps"] is not None and 0 < s["fraction_of_oracle"] <= 1
    assert png.exists()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--sweep"], "--sweep needs --slo-p95-ms"),
        (["--plot", "x.png"], "only apply with --sweep"),
        (["--strategy", "fast"], "unknown strategy 'fast'"),
    ],
)
def test_bad_arguments_get_a_clear_error(
    files: tuple[str, str], capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    """Exit status 2 and a message saying what is wrong."""
    trace, cost = files
    assert main(["simulate", trace, "--cost", cost, *extra]) == 2
    assert message in capsys.readouterr().err


def test_adaptive_with_refit_reports_refits_and_final_boundaries(
    files: tuple[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """`--refit` runs the online re-fit in the simulator; the report counts it (too few
    requests here to re-fit: 0, and the boundaries stay as given)."""
    trace, cost = files
    argv = ["simulate", trace, "--cost", cost, "--strategy", "adaptive,bucketed", "--refit"]
    assert main([*argv, "--boundaries", "32,64", "--slo-ms", "60000"]) == 0
    out = capsys.readouterr().out
    rows = {line.split("  ")[0].strip(): line.split() for line in out.splitlines() if line}
    assert rows["re-fits"][-2:] == ["0", "-"]
    assert rows["boundaries at the end"][-2:] == ["32,64", "-"]
