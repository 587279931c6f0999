"""Config: validation, merging of file, environment and flags, resolution for the scheduler."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest
from pydantic import ValidationError

from lenbatch.config import BatchingConfig, Strategy, load_settings
from lenbatch.core.lanes import resolve_scheduler


def test_precedence_file_env_flags(tmp_path: Path) -> None:
    """Flags beat environment, environment beats the file, the file beats defaults."""
    f = tmp_path / "c.toml"
    f.write_text(
        '[batching]\nstrategy = "fifo"\nmax_batch = 8\nmax_wait_ms = 3\n[server]\nport = 9000\n'
    )
    env = {"LENBATCH_BATCHING__MAX_BATCH": "16", "LENBATCH_SERVER__PORT": "9001"}
    s = load_settings(f, env, {"server": {"port": 9002, "host": None}})
    assert s.batching.strategy is Strategy.FIFO
    assert s.batching.max_wait_ms == 3
    assert s.batching.max_batch == 16
    assert s.server.port == 9002
    assert s.server.host == "127.0.0.1"


def test_yaml_and_list_env(tmp_path: Path) -> None:
    """YAML files work, and list fields come from comma-separated variables."""
    f = tmp_path / "c.yaml"
    f.write_text("batching:\n  boundaries: [8, 16]\n")
    s = load_settings(f, {"LENBATCH_BATCHING__BOUNDARIES": "32,64,128"})
    assert s.batching.boundaries == (32, 64, 128)
    assert load_settings(f, {}).batching.boundaries == (8, 16)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"boundaries": (64, 32)}, "strictly increasing"),
        ({"boundaries": ()}, "must not be empty"),
        ({"boundaries": (0, 32)}, "positive"),
        ({"boundaries": (32, 64), "bucket_max_batch": (8,)}, "one value per boundary"),
        ({"max_batch": 0}, "greater than or equal to 1"),
        ({"strategy": "bogus"}, "static"),
    ],
)
def test_invalid_values_name_the_problem(kwargs: dict[str, object], message: str) -> None:
    """Bad values raise errors that name the values."""
    with pytest.raises(ValidationError, match=message):
        BatchingConfig(**kwargs)  # type: ignore[arg-type]


def test_unknown_keys_and_sections_are_errors(tmp_path: Path) -> None:
    """A typo in a config file or variable is an error, not silently ignored."""
    f = tmp_path / "c.toml"
    f.write_text("[batching]\nmax_batchh = 3\n")
    with pytest.raises(ValidationError, match="max_batchh"):
        load_settings(f, {})
    with pytest.raises(ValueError, match="unknown section"):
        load_settings(None, {"LENBATCH_BATCHIN__MAX_BATCH": "3"})


def test_resolve_bucketed_lanes() -> None:
    """Bucketed resolves to one lane per boundary plus an overlong lane with its quota."""
    cfg = BatchingConfig(
        boundaries=(32, 64),
        bucket_max_batch=(64, 16),
        overlong_max_batch=4,
        overlong_max_wait_ms=40,
        overlong_max_inflight=2,
        max_wait_ms=5,
    )
    sc = resolve_scheduler(cfg, 256)
    assert [lane.upper for lane in sc.lanes] == [32, 64, 256]
    assert [lane.max_batch for lane in sc.lanes] == [64, 16, 4]
    assert [lane.max_wait for lane in sc.lanes] == [0.005, 0.005, 0.04]
    assert [lane.quota for lane in sc.lanes] == [None, None, 2]
    assert sc.slots == cfg.max_concurrent_batches + cfg.prefetch_batches
    with pytest.raises(ValueError, match="exceeds the model's max length"):
        resolve_scheduler(BatchingConfig(boundaries=(300,)), 256)


def test_resolve_single_queue_strategies() -> None:
    """static pads to the model limit; fifo and sorted pad to the batch's longest."""
    for strategy, pad in (("static", 256), ("fifo", None), ("sorted", None)):
        sc = resolve_scheduler(BatchingConfig(strategy=Strategy(strategy)), 256)
        assert len(sc.lanes) == 1 and sc.lanes[0].pad_to == pad


def test_configuration_docs_are_current() -> None:
    """docs/configuration.md is what docs/gen_config.py renders from the code now."""
    root = Path(__file__).resolve().parents[2]
    render = runpy.run_path(str(root / "docs" / "gen_config.py"))["render"]
    assert (root / "docs" / "configuration.md").read_text() == render(), "run `make docs`"


def test_shipped_tuned_config_loads() -> None:
    """The config `make serve` uses is valid and fits MiniLM's 256-token limit."""
    root = Path(__file__).resolve().parents[2]
    s = load_settings(root / "configs" / "minilm-azure-conv.toml", {})
    assert s.batching.strategy is Strategy.BUCKETED
    sc = resolve_scheduler(s.batching, 256)
    assert sc.boundaries and sc.boundaries[-1] <= 256


@pytest.mark.parametrize(
    ("cores", "workers", "threads"), [(1, 1, 1), (2, 2, 1), (4, 4, 1), (16, 8, 2), (20, 8, 2)]
)
def test_cpu_layout_fills_one_worker_per_core_where_none_is_given(
    cores: int, workers: int, threads: int
) -> None:
    """Neither the thread count nor the concurrency given: one single-threaded worker per core,
    up to AUTO_MAX_WORKERS, whose torch threads then share the cores."""
    s = load_settings(None, {}).with_cpu_layout(cores)
    assert (s.batching.max_concurrent_batches, s.model.torch_threads) == (workers, threads)
    assert s.batching.max_batch == BatchingConfig().max_batch  # nothing else moves


@pytest.mark.parametrize(
    ("cores", "batches", "threads"), [(2, 1, 2), (2, 2, 1), (8, 2, 4), (2, 4, 1)]
)
def test_cpu_layout_shares_the_cores_among_the_batches_given(
    cores: int, batches: int, threads: int
) -> None:
    """Batches given without a thread count get the cores split among them, never torch's
    default team per batch (which `lenbatch tune`'s written `[batching]` would otherwise get)."""
    env = {"LENBATCH_BATCHING__MAX_CONCURRENT_BATCHES": str(batches)}
    s = load_settings(None, env).with_cpu_layout(cores)
    assert (s.batching.max_concurrent_batches, s.model.torch_threads) == (batches, threads)


@pytest.mark.parametrize(
    "env",
    [
        {"LENBATCH_MODEL__TORCH_THREADS": "2"},
        {"LENBATCH_MODEL__TORCH_THREADS": "1"},
        {"LENBATCH_MODEL__DEVICE": "cuda"},
    ],
)
def test_cpu_layout_keeps_a_thread_count_given_and_other_devices(env: dict[str, str]) -> None:
    """A thread count alone holds the server to part of a shared CPU: one batch at a time."""
    s = load_settings(None, env)
    assert s.with_cpu_layout(2) == s


def test_cpu_layout_given_in_a_file_is_kept_and_several_models_take_turns(tmp_path: Path) -> None:
    """A file naming the thread count keeps it; several models share one budget of turns (one
    call at a time), so their layout stays torch's default."""
    f = tmp_path / "c.toml"
    f.write_text("[model]\ntorch_threads = 2\n")
    s = load_settings(f, {})
    laid = s.with_cpu_layout(2)
    assert (laid.model.torch_threads, laid.batching.max_concurrent_batches) == (2, 1)
    several = load_settings(None, {}, {"models": [{"name": "a"}, {"name": "b"}]})
    assert several.with_cpu_layout(2) == several
    shipped = Path(__file__).resolve().parents[2] / "configs" / "minilm-azure-conv.toml"
    tuned = load_settings(shipped, {})
    assert tuned.with_cpu_layout(2) == tuned
