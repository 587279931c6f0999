"""`--cost auto` picks this processor's cost model from a folder; `--cost URL` reads a live
server's online fit (the live part is in tests/integration/test_cost_online.py)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from lenbatch.cli.common import load_cost_model, pin_cost_spec
from lenbatch.plan.costmodel import CostModel
from lenbatch.plan.costsource import choose_auto, choose_cost_file, cost_folders, cost_from_stats
from lenbatch.runners import hardware

HERE = "cpu:Test CPU [TestVendor family 1 model 2; avx2] x2"
OTHER = "cpu:Other CPU [TestVendor family 1 model 3; avx2] x2"


def _fake_key(device: str = "cpu", threads: int | None = None) -> str:
    """This machine's key, as `processor_key`: 2 torch threads unless told otherwise."""
    return f"cpu:Test CPU [TestVendor family 1 model 2; avx2] x{threads or 2}"


def _write(folder: Path, name: str, const: float, **kw: str) -> Path:
    path = folder / name
    CostModel(const, **kw).save(path)  # type: ignore[arg-type]
    return path


@pytest.fixture
def costs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder with cost models of two processors, a keyless old one and a non-cost JSON."""
    monkeypatch.setattr(hardware, "processor_key", _fake_key)
    monkeypatch.setenv("LENBATCH_COST_DIR", str(tmp_path))
    _write(tmp_path, "other_cpu.json", 0.5, processor=OTHER, dtype="bfloat16")
    _write(tmp_path, "old.json", 0.4)
    _write(tmp_path, "here_fp32.json", 0.1, processor=HERE, dtype="float32", execution="padded")
    _write(tmp_path, "here_bf16.json", 0.2, processor=HERE, dtype="bfloat16", execution="packed")
    (tmp_path / "ray_overhead.json").write_text('{"overhead_ms": 3}')
    return tmp_path


def test_auto_takes_this_processors_file_and_the_dtype_run(costs: Path) -> None:
    """Only files keyed by this processor are candidates; the dtype the command runs with
    decides between them, then the execution."""
    path, why = choose_cost_file(costs, HERE, dtype="bfloat16")
    assert path.name == "here_bf16.json" and "this processor" in why and "as run" in why
    path, _ = choose_cost_file(costs, HERE, dtype="float32")
    assert path.name == "here_fp32.json"
    path, _ = choose_cost_file(costs, HERE, execution="padded")
    assert path.name == "here_fp32.json"
    # Through the CLI reader: LENBATCH_COST_DIR and the (patched) processor key are used.
    assert load_cost_model("auto", dtype="bfloat16").const == 0.2
    assert load_cost_model("auto", dtype="float32").const == 0.1


def test_a_calibrated_model_beats_a_plain_profile_of_the_same_kind(costs: Path) -> None:
    """`calibrate --out` writes a non-empty `calibration`: it wins over the plain profile it
    came from, even when the plain one is newer."""
    cal = _write(
        costs,
        "here_bf16_calibrated.json",
        0.25,
        processor=HERE,
        dtype="bfloat16",
        execution="packed",
        calibration="bench run x, server only",
    )
    plain = costs / "here_bf16.json"
    os.utime(cal, (1_000, 1_000))
    os.utime(plain, (2_000, 2_000))
    path, why = choose_cost_file(costs, HERE, dtype="bfloat16", execution="packed")
    assert path == cal and "calibrated" in why and "here_bf16.json" in why
    # The float type run still comes first: a calibrated bf16 model does not describe fp32.
    path, _ = choose_cost_file(costs, HERE, dtype="float32")
    assert path.name == "here_fp32.json"


def test_no_match_is_an_error_naming_what_exists(
    costs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another thread count is another processor key: the error lists every cost file and
    the processor it was measured on, and skips JSON that is not a cost model."""
    with pytest.raises(ValueError) as exc:
        load_cost_model("auto", threads=1)
    msg = str(exc.value)
    for name in ("other_cpu.json", "old.json", "here_fp32.json", "here_bf16.json"):
        assert name in msg
    assert OTHER in msg and "no processor key" in msg
    assert _fake_key(threads=1) in msg and "ray_overhead" not in msg
    monkeypatch.setenv("LENBATCH_COST_DIR", str(costs / "missing"))
    with pytest.raises(ValueError, match="does not exist"):
        load_cost_model("auto")


def test_pin_resolves_auto_once_and_leaves_paths_and_urls(
    costs: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`bench` pins `auto` to the chosen file (named on stderr) so its report names it."""
    assert pin_cost_spec("auto", dtype="float32") == str(costs / "here_fp32.json")
    assert "here_fp32.json" in capsys.readouterr().err
    assert pin_cost_spec("x.json") == "x.json"
    assert pin_cost_spec("http://127.0.0.1:1") == "http://127.0.0.1:1"


def test_stats_without_an_online_model_are_refused() -> None:
    """A bucketed server has no `adaptive` section; an adaptive one that ran no batch has
    only its prior: both are clear errors, not a made-up model."""
    with pytest.raises(ValueError, match="strategy adaptive"):
        cost_from_stats({"boundaries": [16]}, "http://h:1")
    prior_only = {
        "adaptive": {
            "cost_model": {
                "a_s": 0.02,
                "b_s_per_token": 1e-4,
                "c_s_per_token_sq": 0.0,
                "observed_batches": 0,
                "prior": "generic prior",
            }
        }
    }
    with pytest.raises(ValueError, match="no batch yet"):
        cost_from_stats(prior_only, "http://h:1")


def test_an_older_key_equal_to_this_one_is_not_taken(costs: Path) -> None:
    """A file whose key is in the older form (no model number, no ISA flags) is not taken
    even when its text equals the key asked for; the error says why such keys never match."""
    legacy = "cpu:Test CPU family 1 x2"
    _write(costs, "legacy.json", 0.3, processor=legacy)
    with pytest.raises(ValueError, match="never matches"):
        choose_cost_file(costs, legacy)


def test_quantization_is_part_of_the_match(costs: Path) -> None:
    """A cost model of int8 weights describes only int8: `auto` asked for none skips it."""
    _write(costs, "here_int8.json", 0.05, processor=HERE, dtype="float32", quantization="int8")
    path, _ = choose_cost_file(costs, HERE, dtype="float32", quantization="int8")
    assert path.name == "here_int8.json"
    path, _ = choose_cost_file(costs, HERE, dtype="float32", quantization="none")
    assert path.name == "here_fp32.json"
    with pytest.raises(ValueError, match="quantization int4"):
        choose_cost_file(costs, HERE, quantization="int4")


def test_the_default_folder_is_found_from_any_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without $LENBATCH_COST_DIR, `auto` reads the checkout's bench/results/ whatever the
    current directory: from an empty one, the error lists the committed cost files."""
    monkeypatch.delenv("LENBATCH_COST_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    checkout = Path(__file__).resolve().parents[2] / "bench" / "results"
    assert cost_folders() == (checkout,)
    assert cost_folders({"LENBATCH_COST_DIR": str(tmp_path)}) == (tmp_path,)
    with pytest.raises(ValueError) as exc:
        choose_auto(HERE)
    assert str(checkout) in str(exc.value) and "cost_minilm" in str(exc.value)


def test_a_servers_measured_cpu_per_request_reaches_the_simulator() -> None:
    """`--cost URL` carries the request-side CPU the server measured, so `simulate` charges
    the same slowdown the server's shedding counts."""
    stats = {
        "model": "m",
        "adaptive": {
            "cost_model": {
                "a_s": 0.02,
                "b_s_per_token": 1e-4,
                "c_s_per_token_sq": 0.0,
                "observed_batches": 9,
            },
            "request_cpu": {"cpu_per_request_ms": 2.5, "cores": 2, "intervals": 4},
        },
    }
    cost = cost_from_stats(stats, "http://h:1")
    assert cost.cpu_per_request_s == pytest.approx(0.0025) and cost.cpu_cores == 2
    assert cost.slowdown(400) == pytest.approx(2.0)
    del stats["adaptive"]["request_cpu"]  # an older server: no slowdown
    assert cost_from_stats(stats, "http://h:1").slowdown(400) == 1.0


def test_a_servers_batch_spread_reaches_the_simulator() -> None:
    """`--cost URL` carries how much the server's batch times varied around its fit, which
    `simulate` draws each batch's time from; a server before it gives none."""
    model = {"a_s": 0.02, "b_s_per_token": 1e-4, "c_s_per_token_sq": 0.0, "observed_batches": 40}
    stats: dict[str, Any] = {"model": "m", "adaptive": {"cost_model": model}}
    assert cost_from_stats(stats, "http://h:1").batch_spread == []
    model["batch_spread"] = [0.5, 1.0, 1.5]
    cost = cost_from_stats(stats, "http://h:1")
    assert cost.batch_spread == [0.5, 1.0, 1.5] and cost.spread_factor(0.75) == 1.25
