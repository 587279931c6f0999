"""Self-calibration: `serve --cost auto` measures a cost model where none was measured on this
processor, caches it per key (processor, threads, dtype, quantization, execution, lenbatch and
torch version), and the next start loads it without measuring."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from lenbatch.core.clock import FakeClock
from lenbatch.plan import costcache, selfcal
from lenbatch.plan.costmodel import CostModel
from lenbatch.plan.costsource import choose_auto
from lenbatch.runners import hardware
from lenbatch.runners.fake import FakeRunner

HERE = "cpu:Test CPU [TestVendor family 1 model 2; avx2] x{threads}"


def _key(device: str = "cpu", threads: int | None = None) -> str:
    return HERE.format(threads=threads or 2)


def _true_cost(b: int, n: int) -> float:
    """What the fake runner charges: 20 ms a call, 10 us per padded token, a small L^2 term."""
    return 0.02 + 1e-5 * b * n + 2e-8 * b * n * n


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    monkeypatch.setattr(hardware, "processor_key", _key)
    empty = tmp_path / "no-costs"
    empty.mkdir()
    return {"LENBATCH_CACHE_DIR": str(tmp_path / "cache"), "LENBATCH_COST_DIR": str(empty)}


def _same(a: CostModel, b: CostModel) -> bool:
    """Equal as JSON (NaN fit errors compare equal there)."""
    return json.dumps(a.to_json(), sort_keys=True) == json.dumps(b.to_json(), sort_keys=True)


def _runner() -> tuple[FakeRunner, FakeClock]:
    clock = FakeClock()
    return FakeRunner(max_length=256, cost=_true_cost, clock=clock, record=False), clock


def test_cache_root_follows_xdg(tmp_path: Path) -> None:
    home = Path.home()
    assert costcache.cache_root({}) == home / ".cache" / "lenbatch"
    xdg = {"XDG_CACHE_HOME": str(tmp_path)}
    assert costcache.cache_root(xdg) == tmp_path / "lenbatch"
    # the XDG spec: a relative value is ignored
    assert costcache.cache_root({"XDG_CACHE_HOME": "rel"}) == home / ".cache" / "lenbatch"
    both = {**xdg, "LENBATCH_CACHE_DIR": str(tmp_path / "own")}
    assert costcache.cache_root(both) == tmp_path / "own"


def test_calibration_recovers_the_runners_cost_within_its_budget(env: dict[str, str]) -> None:
    runner, clock = _runner()
    cost = selfcal.calibrate_runner(runner, budget_s=30, clock=clock)
    assert clock.now() <= 30
    assert len(cost.points) >= 4
    for b, n in ((1, 16), (8, 100), (32, 256)):
        assert cost.latency(b, n) == pytest.approx(_true_cost(b, n), rel=0.02)
    assert cost.processor == _key() and cost.execution == "padded"


def test_a_small_budget_skips_the_large_shapes(env: dict[str, str]) -> None:
    runner, clock = _runner()
    cost = selfcal.calibrate_runner(runner, budget_s=1.0, clock=clock)
    # the last point may overrun by its own prediction error only
    assert clock.now() <= 1.2
    assert len(cost.points) >= 4
    assert max(p["batch"] * p["padded_len"] for p in cost.points) < 32 * 256


def test_too_small_a_budget_says_so(env: dict[str, str]) -> None:
    runner, clock = _runner()
    with pytest.raises(RuntimeError, match="4 are needed"):
        selfcal.calibrate_runner(runner, budget_s=0.1, clock=clock)


def test_first_start_calibrates_and_caches_the_next_loads(
    env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    runner, clock = _runner()
    real = selfcal.calibrate_runner
    monkeypatch.setattr(
        selfcal, "calibrate_runner", lambda r, **kw: real(r, **{**kw, "clock": clock})
    )
    cost, why = selfcal.auto_cost(runner, environ=env)  # type: ignore[misc]
    assert "self-calibrated now" in why
    (cached,) = Path(env["LENBATCH_CACHE_DIR"]).rglob("*.json")
    assert "lenbatch-" in cached.parent.name and "torch-" in cached.parent.name
    assert _same(CostModel.load(cached), cost)

    def boom(*a: object, **k: object) -> CostModel:
        raise AssertionError("a cached key must not be measured again")

    monkeypatch.setattr(selfcal, "calibrate_runner", boom)
    again, why = selfcal.auto_cost(runner, environ=env)  # type: ignore[misc]
    assert _same(again, cost) and why.startswith("cached")
    # `--cost auto` of the other commands finds it too, from any folder
    path, _ = choose_auto(_key(), dtype=None, environ=env)
    assert path == cached


@pytest.mark.parametrize(
    "change",
    ["threads", "dtype", "quantization", "execution", "version", "runner code"],
)
def test_any_change_of_key_misses_the_cache(
    env: dict[str, str], monkeypatch: pytest.MonkeyPatch, change: str
) -> None:
    runner, _ = _runner()
    key, execution = selfcal.runner_key(runner)
    cost = CostModel(0.01, per_token=1e-5, processor=key.processor, model=key.model)
    cost = dataclasses.replace(cost, dtype=key.dtype, execution=execution)
    costcache.store_cost(cost, key, env)
    assert costcache.cached_cost(key, execution, env) is not None
    if change == "threads":
        key = dataclasses.replace(key, processor=_key(threads=1))
    elif change == "dtype":
        key = dataclasses.replace(key, dtype="bfloat16")
    elif change == "quantization":
        key = dataclasses.replace(key, quantization="int8")
    elif change == "execution":
        execution = "packed"
    elif change == "version":
        monkeypatch.setattr(costcache, "_version", lambda dist: "9.9.9")
    else:  # a source checkout's runners changed, its version string did not
        monkeypatch.setattr(costcache, "runner_code", lambda: "0badc0de")
    assert costcache.cached_cost(key, execution, env) is None


def test_the_runner_code_hash_covers_the_runners_source() -> None:
    """The hash is stable, and it is over the runners' own files (the C++ op's included)."""
    from importlib import resources

    names = {e.name for e in resources.files("lenbatch.runners").iterdir()}
    assert "packed.py" in names and "decode_attention.cpp" in names
    code = costcache.runner_code()
    assert len(code) == 8 and int(code, 16) >= 0
    costcache.runner_code.cache_clear()
    assert costcache.runner_code() == code
    assert code in str(costcache.cost_cache_dir({"LENBATCH_CACHE_DIR": "/x"}))


def test_a_strategy_that_reads_no_cost_model_does_not_calibrate(env: dict[str, str]) -> None:
    runner, clock = _runner()
    assert selfcal.auto_cost(runner, calibrate=False, environ=env) is None
    assert clock.now() == 0


def test_a_matching_committed_file_is_used_without_measuring(env: dict[str, str]) -> None:
    runner, clock = _runner()
    folder = Path(env["LENBATCH_COST_DIR"])
    CostModel(0.03, per_token=2e-5, processor=_key(), model="fake").save(folder / "c.json")
    cost, why = selfcal.auto_cost(runner, environ=env)  # type: ignore[misc]
    assert cost.const == 0.03 and str(folder / "c.json") in why
    assert clock.now() == 0


@pytest.mark.parametrize(
    ("spec", "reads_cost", "expected"),
    [
        (None, True, "auto"),  # strategy adaptive without --cost: as --cost auto
        (None, False, None),  # a strategy that reads no cost model
        ("generic", True, None),  # the generic prior, on purpose
        ("GENERIC", True, None),
        ("auto", True, "auto"),
        ("costs.json", True, "costs.json"),
    ],
)
def test_serve_cost_spec(spec: str | None, reads_cost: bool, expected: str | None) -> None:
    got, why = selfcal.serve_cost_spec(spec, reads_cost=reads_cost)
    assert got == expected
    assert bool(why) == ((spec is None and reads_cost) or (spec or "").lower() == "generic")


def test_adaptive_without_cost_calibrates_and_generic_does_not(
    env: dict[str, str], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """`serve --strategy adaptive` with no `--cost` on a processor with nothing measured
    measures its own (logged); `--cost generic` starts on the prior without measuring."""
    import logging

    from lenbatch.cli.build import _serve_cost

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    runner, clock = _runner()
    real = selfcal.calibrate_runner
    monkeypatch.setattr(
        selfcal, "calibrate_runner", lambda r, **kw: real(r, **{**kw, "clock": clock})
    )
    with caplog.at_level(logging.INFO):
        assert _serve_cost("generic", "cpu", runner, calibrate=True) is None
        assert clock.now() == 0 and not list(Path(env["LENBATCH_CACHE_DIR"]).rglob("*.json"))
        cost = _serve_cost(None, "cpu", runner, calibrate=True)
    assert cost is not None and cost.latency(8, 100) == pytest.approx(_true_cost(8, 100), 0.02)
    assert clock.now() > 0 and list(Path(env["LENBATCH_CACHE_DIR"]).rglob("*.json"))
    text = caplog.text
    assert "no --cost: strategy adaptive" in text and "measuring one now" in text
    assert "--cost generic: the online cost model starts on its generic CPU prior" in text
    # a strategy that reads no cost model neither measures nor logs about it
    assert _serve_cost(None, "cpu", runner, calibrate=False) is None
