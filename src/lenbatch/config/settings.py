"""The whole settings tree (`Settings`: the sections, and the models to serve) and
`load_settings`, which merges defaults, a config file (TOML or YAML), `LENBATCH_*` environment
variables and flags, in that order of precedence (see the package's docstring)."""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, model_validator

from lenbatch.config.batching import AdaptiveConfig, BatchingConfig
from lenbatch.config.fields import FROZEN
from lenbatch.config.model import ModelConfig
from lenbatch.config.serving import (
    AdmissionConfig,
    GenerationConfig,
    RecoveryConfig,
    ServerConfig,
)

__all__ = ["AUTO_MAX_WORKERS", "Settings", "load_settings"]

# Most batch workers the CPU layout picks by itself (`Settings.with_cpu_layout`). Each worker is
# a Python thread: past a few, their turns on the GIL between torch ops start to delay the
# event loop. Measured on 2 cores only; above 8 cores each worker runs several torch threads.
AUTO_MAX_WORKERS = 8


class Settings(BaseModel):
    """Everything `lenbatch serve` runs with.

    One model is `[model]`; several are `[[models]]` tables (a list in YAML), each with the
    fields of `[model]`. Give one or the other: `served_models()` returns the list either way.
    """

    model_config = FROZEN

    model: ModelConfig = ModelConfig()
    """The one model served (`[model]`)."""
    models: tuple[ModelConfig, ...] = ()
    """Several models in one process: `[[models]]` tables (a list in YAML), each with the
    fields of `[model]`. Give `[model]` or `[[models]]`, not both; each model is served under
    its own name (`served_name`, else the folder's name), so those must differ. A list of one
    is the same as `[model]`; `lenbatch serve` refuses more than one until it serves them.
    `task = "auto"` is told from each folder's config.json when the server starts."""
    batching: BatchingConfig = BatchingConfig()
    server: ServerConfig = ServerConfig()
    admission: AdmissionConfig = AdmissionConfig()
    recovery: RecoveryConfig = RecoveryConfig()
    generation: GenerationConfig = GenerationConfig()
    adaptive: AdaptiveConfig = AdaptiveConfig()

    def with_cpu_layout(self, cores: int) -> Settings:
        """These settings with the batch layout filled in for one encoder served alone on a
        CPU with `cores` usable cores, where `model.torch_threads` is not given: the cores are
        shared among the batches that run at once, `cores // batches` torch threads each, and
        where `batching.max_concurrent_batches` is not given either, one batch per core (up to
        `AUTO_MAX_WORKERS`). A thread count given alone is kept with one batch at a time: it is
        how a server is held to part of a shared CPU. Unchanged for several models (their calls
        take turns on one budget) and other devices.

        Why: one batch on every core pays the OpenMP team's wake-up and spin on each call, and
        on 2 cores that competes with the event loop for the second core; two batches on one
        thread each served 1.15x the tokens/s with a far lower P95 under load
        (`bench/results/cpu_layout.md`). And batches given without a thread count would each
        start torch's default team of one thread per core: more threads than cores."""
        if (
            self.models
            or self.model.device != "cpu"
            or "torch_threads" in self.model.model_fields_set
        ):
            return self
        if "max_concurrent_batches" in self.batching.model_fields_set:
            workers = self.batching.max_concurrent_batches
        else:
            workers = max(1, min(cores, AUTO_MAX_WORKERS))
        return self.model_copy(
            update={
                "model": self.model.model_copy(update={"torch_threads": max(1, cores // workers)}),
                "batching": self.batching.model_copy(update={"max_concurrent_batches": workers}),
            }
        )

    @model_validator(mode="after")
    def _one_way_to_name_models(self) -> Settings:
        if not self.models:
            single = self.model.served_name
            other = self.server.served_model_name
            if single is not None and other is not None and single != other:
                raise ValueError(
                    f"[model] served_name={single!r} and [server] served_model_name={other!r} "
                    "name the one model twice: give one"
                )
            return self
        if self.model.model_fields_set:
            given = ", ".join(sorted(self.model.model_fields_set))
            raise ValueError(
                f"[model] ({given}) and [[models]] are both given: list every model in "
                "[[models]] (the --model, --dtype, --quantize ... flags and LENBATCH_MODEL__* "
                "variables set [model] too)"
            )
        if self.server.served_model_name is not None:
            raise ValueError(
                f"[server] served_model_name={self.server.served_model_name!r} names the one "
                "model of [model]: with [[models]], set served_name in each [[models]] table"
            )
        seen: dict[str, str] = {}
        for m in self.models:
            served = m.served_name or m.default_served_name()
            if served in seen:
                how = "served_name" if m.served_name else "name, without served_name,"
                raise ValueError(
                    f"[[models]] {seen[served]!r} and {m.name!r} are both served as "
                    f"{served!r} (the second by its {how}): give each a distinct served_name"
                )
            seen[served] = m.name
        return self

    def served_models(self) -> tuple[ModelConfig, ...]:
        """The models to serve, one per entry: the `[[models]]` list, or `[model]` alone
        (with `[server] served_model_name` as its `served_name` when that is the one given)."""
        if self.models:
            return self.models
        if self.model.served_name is None and self.server.served_model_name is not None:
            return (self.model.model_copy(update={"served_name": self.server.served_model_name}),)
        return (self.model,)

    def for_model(self, model: ModelConfig) -> Settings:
        """These settings serving `model` alone (as `[model]`, its served name in `[server]`
        too, its own `max_batch_tokens` in `[batching]` if it has one): what a single-model
        server runs with, from an entry of `served_models()`."""
        server = self.server.model_copy(update={"served_model_name": model.served_name})
        update: dict[str, Any] = {"model": model, "models": (), "server": server}
        if model.max_batch_tokens is not None:
            update["batching"] = self.batching.model_copy(
                update={"max_batch_tokens": model.max_batch_tokens}
            )
        return self.model_copy(update=update)


def _read_file(path: Path) -> dict[str, Any]:
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".toml":
        return tomllib.loads(text)
    if path.suffix in (".yaml", ".yml"):
        import yaml

        data = yaml.safe_load(text) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: top level must be a mapping")
        return data
    raise ValueError(f"{path}: config files must end in .toml, .yaml or .yml")


_LIST_FIELDS = frozenset(
    {"boundaries", "bucket_max_batch", "bucket_max_wait_ms", "cors_origins", "priority_slo_ms"}
)


def _env_overrides(env: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in env.items():
        if not key.startswith("LENBATCH_") or "__" not in key:
            continue
        section, _, field = key[len("LENBATCH_") :].lower().partition("__")
        if section not in Settings.model_fields:
            raise ValueError(f"{key}: unknown section {section!r}")
        if section == "models":
            raise ValueError(f"{key}: [[models]] is a list of tables: set it in a config file")
        parsed: Any = value
        if field in _LIST_FIELDS:
            parsed = [v.strip() for v in value.split(",") if v.strip()]
        out.setdefault(section, {})[field] = parsed
    return out


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping):
            merged[key] = _merge(merged.get(key) or {}, value)
        elif value is not None:
            merged[key] = value
    return merged


def load_settings(
    file: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Settings:
    """Merge a config file, `LENBATCH_*` variables and flag overrides into validated Settings.

    `overrides` is nested like the file (`{"batching": {"strategy": "fifo"}}`); None values are
    ignored so unset flags do not mask the file or environment.
    """
    data: dict[str, Any] = {}
    if file is not None:
        data = _read_file(Path(file))
    data = _merge(data, _env_overrides(os.environ if env is None else env))
    if overrides:
        data = _merge(data, overrides)
    return Settings.model_validate(data)
