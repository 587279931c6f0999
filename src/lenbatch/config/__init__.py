"""Configuration: one validated tree, read from a file, the environment and flags in one place.

One module per part of the tree: `batching` (strategy, lanes, `adaptive`), `model` (`[model]`
and each `[[models]]` entry), `serving` (server, admission, recovery, generation), `settings`
(the whole tree and `load_settings`). This package imports nothing else from lenbatch.

`Settings` is what `lenbatch serve` runs with. Its `batching` part is resolved, once the model's
length limit is known, into the pure scheduler's own config (`lenbatch.core.lanes`).

Precedence, lowest first: defaults < config file (TOML or YAML) < `LENBATCH_*` environment
variables < command-line flags. Environment variables name a field as
`LENBATCH_<SECTION>__<FIELD>` (e.g. `LENBATCH_BATCHING__MAX_WAIT_MS=5`).
"""

from __future__ import annotations

from lenbatch.config.batching import AdaptiveConfig, BatchingConfig, ShedMode, Strategy
from lenbatch.config.model import ModelConfig, ModelTask, Quantization
from lenbatch.config.serving import (
    AdmissionConfig,
    DecodeMode,
    GenerationConfig,
    RecoveryConfig,
    ServerConfig,
)
from lenbatch.config.settings import Settings, load_settings

__all__ = [
    "AdaptiveConfig",
    "AdmissionConfig",
    "BatchingConfig",
    "DecodeMode",
    "GenerationConfig",
    "ModelConfig",
    "ModelTask",
    "Quantization",
    "RecoveryConfig",
    "ServerConfig",
    "Settings",
    "ShedMode",
    "Strategy",
    "load_settings",
]
