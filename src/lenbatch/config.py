"""Configuration: one validated tree, read from a file, the environment and flags in one place.

`Settings` is what `lenbatch serve` runs with. Its `batching` part is resolved, once the model's
length limit is known, into the pure scheduler's own config (`lenbatch.core.lanes`).

Precedence, lowest first: defaults < config file (TOML or YAML) < `LENBATCH_*` environment
variables < command-line flags. Environment variables name a field as
`LENBATCH_<SECTION>__<FIELD>` (e.g. `LENBATCH_BATCHING__MAX_WAIT_MS=5`).
"""

from __future__ import annotations

import itertools
import os
import tomllib
from collections.abc import Mapping
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

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


class Strategy(StrEnum):
    """How requests are grouped into batches. All run through the same engine and scheduler."""

    STATIC = "static"  # one FIFO queue, every batch padded to the model's max length
    FIFO = "fifo"  # one FIFO queue, padded to the batch's longest (Ray Serve, TorchServe)
    SORTED = "sorted"  # one queue; a window is sorted by length and cut (Infinity)
    BUCKETED = "bucketed"  # one FIFO per length bucket + an overlong lane (this project)
    # bucketed lanes, batches formed by a cost model and deadlines (`core.adaptive`)
    ADAPTIVE = "adaptive"

    @property
    def bucketed(self) -> bool:
        """True for the strategies that queue by length bucket (bucketed, adaptive)."""
        return self in (Strategy.BUCKETED, Strategy.ADAPTIVE)

    @classmethod
    def parse(cls, name: str) -> Strategy:
        """The strategy called `name`, or a ValueError listing the valid names."""
        try:
            return cls(name.strip().lower())
        except ValueError:
            valid = ", ".join(s.value for s in cls)
            raise ValueError(f"unknown strategy {name!r}; choose one of: {valid}") from None


_FROZEN = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)


class BatchingConfig(BaseModel):
    """How requests are queued and batched."""

    model_config = _FROZEN

    strategy: Strategy = Strategy.BUCKETED
    """Batching strategy: static, fifo, sorted, bucketed or adaptive."""
    boundaries: tuple[int, ...] | None = None
    """Bucket upper bounds in tokens, ascending (bucketed, adaptive). None: the model's default.
    `"auto"` (adaptive only): start with one lane and learn the boundaries from the traffic
    (online re-fit, see `[adaptive]`)."""
    auto_boundaries: bool = False
    """Set by `boundaries = "auto"`: learn the boundaries online (adaptive only)."""
    max_batch: int = Field(32, ge=1)
    """Most requests in one batch."""
    max_wait_ms: float = Field(10.0, ge=0)
    """Longest a queue's oldest request waits for its batch to fill before it is flushed."""
    max_batch_tokens: int = Field(8192, ge=1)
    """Token budget of one batch: batch size x padded length."""
    bucket_max_batch: tuple[int, ...] | None = None
    """Per-bucket max batch (one per boundary); overrides `max_batch`."""
    bucket_max_wait_ms: tuple[float, ...] | None = None
    """Per-bucket max wait (one per boundary); overrides `max_wait_ms`."""
    overlong_max_batch: int = Field(8, ge=1)
    """Most requests in one batch of the overlong lane (above the last boundary)."""
    overlong_max_wait_ms: float = Field(50.0, ge=0)
    """Max wait of the overlong lane."""
    overlong_max_inflight: int = Field(1, ge=1)
    """Overlong batches allowed to be running or prepared at once (the lane's quota)."""
    sorted_window: int = Field(128, ge=1)
    """`sorted`: how many queued requests are sorted together before cutting batches."""
    max_concurrent_batches: int = Field(1, ge=1)
    """Batches the runner executes at the same time (1 on a CPU; more on a GPU)."""
    prefetch_batches: int = Field(1, ge=0)
    """Batches formed and collated ahead while the runner is busy."""

    @model_validator(mode="before")
    @classmethod
    def _auto_boundaries(cls, data: Any) -> Any:
        # `boundaries = "auto"` keeps the field's type a tuple: it becomes a flag.
        if isinstance(data, dict):
            b = data.get("boundaries")
            if (isinstance(b, str) and b.strip().lower() == "auto") or (
                isinstance(b, list | tuple) and len(b) == 1 and str(b[0]).lower() == "auto"
            ):
                data = {**data, "boundaries": None, "auto_boundaries": True}
        return data

    @field_validator("boundaries")
    @classmethod
    def _boundaries_increasing(cls, v: tuple[int, ...] | None) -> tuple[int, ...] | None:
        if v is None:
            return v
        if not v:
            raise ValueError("boundaries must not be empty (omit them to use the default)")
        if any(b < 1 for b in v):
            raise ValueError(f"boundaries must be positive, got {list(v)}")
        if any(b >= c for b, c in itertools.pairwise(v)):
            raise ValueError(f"boundaries must be strictly increasing, got {list(v)}")
        return v

    @model_validator(mode="after")
    def _per_bucket_lengths(self) -> BatchingConfig:
        for name in ("bucket_max_batch", "bucket_max_wait_ms"):
            values = getattr(self, name)
            if values is None:
                continue
            if self.boundaries is None or len(values) != len(self.boundaries):
                n = None if self.boundaries is None else len(self.boundaries)
                raise ValueError(
                    f"{name} has {len(values)} values but there are {n} boundaries; "
                    "give one value per boundary"
                )
            if any(x < (1 if name == "bucket_max_batch" else 0) for x in values):
                raise ValueError(f"{name} values must be positive, got {list(values)}")
        return self


class ShedMode(StrEnum):
    """What `adaptive` does with a request predicted to miss its deadline."""

    REJECT_429 = "429"  # answer at once: 429 with Retry-After
    REJECT_503 = "503"  # answer at once: 503 with Retry-After
    LATE = "late"  # keep it and serve it late (Triton's DELAY)


class AdaptiveConfig(BaseModel):
    """The `adaptive` strategy: SLO-aware waiting, cost-based merges, deadline-aware shedding,
    priorities and online re-fit of the boundaries. Every mechanism has its switch."""

    model_config = _FROZEN

    slo_ms: float | None = Field(None, gt=0)
    """Service-level objective: arrival to answer, ms. None: derived from the cost model (four
    times the predicted time of the longest input alone, at least 100 ms). The
    `X-Request-Timeout` header overrides it per call."""
    min_wait_ms: float = Field(0.0, ge=0)
    """Shortest wait a lane may choose to fill its batch."""
    max_wait_ms: float = Field(100.0, ge=0)
    """Longest wait a lane may choose to fill its batch (the SLO bounds it too)."""
    late_binding: bool = True
    """Wait to fill only while it pays (work per model-second) and no deadline is at risk;
    off: a lane runs as soon as a runner slot is free."""
    fill_gain: float = Field(0.1, ge=0)
    """Waiting for one more request must raise real tokens per model-second by this share."""
    fill_above_load: float = Field(0.7, ge=0)
    """Wait to fill only once the runner would be busy this share of the time running every
    request alone (below it there is model time to spare; 0: whenever filling pays)."""
    rate_window_s: float = Field(1.0, gt=0)
    """Time constant of the per-lane arrival-rate estimate."""
    merge: bool = True
    """Top up a short-of-full batch with requests of the next shorter lanes when it is cheaper
    than running them later in their own batch."""
    shed: ShedMode = ShedMode.REJECT_429
    """A request predicted to miss its deadline: 429 or 503 at once (with Retry-After), or
    `late` (kept and served late)."""
    priority_levels: int = Field(1, ge=1, le=16)
    """Strict priority levels 0..N-1 (higher runs first; FIFO within a level)."""
    priority_slo_ms: tuple[float, ...] | None = None
    """SLO of each level, lowest first (default: `slo_ms` for every level)."""
    aging_ms: float = Field(1000.0, gt=0)
    """A request that waited this long runs as if it had the top level (bounds starvation,
    the overlong lane's too)."""
    cost_window: int = Field(256, ge=8)
    """Batch timings the online cost model is fitted on (a sliding window)."""
    refit: bool = False
    """Re-fit the boundaries online when the length distribution drifts (on with
    `boundaries = "auto"`)."""
    refit_sample: int = Field(2000, ge=50)
    """Recent lengths kept for the re-fit and the drift test."""
    refit_min_requests: int = Field(300, ge=20)
    """Lengths seen (since the last fit) before a re-fit is considered."""
    refit_min_interval_s: float = Field(10.0, ge=0)
    """Shortest time between two re-fits (hysteresis)."""
    refit_min_saving: float = Field(0.05, ge=0, le=1)
    """A re-fit must cut the predicted cost per request by this share (hysteresis)."""
    refit_buckets: int = Field(6, ge=1, le=16)
    """Most buckets a re-fit may use."""

    @model_validator(mode="after")
    def _levels(self) -> AdaptiveConfig:
        if self.priority_slo_ms is not None:
            if len(self.priority_slo_ms) != self.priority_levels:
                raise ValueError(
                    f"priority_slo_ms has {len(self.priority_slo_ms)} values for "
                    f"priority_levels={self.priority_levels}; give one per level"
                )
            if any(v <= 0 for v in self.priority_slo_ms):
                raise ValueError(f"priority_slo_ms must be positive, got {self.priority_slo_ms}")
        if self.min_wait_ms > self.max_wait_ms:
            raise ValueError(
                f"min_wait_ms={self.min_wait_ms} is above max_wait_ms={self.max_wait_ms}"
            )
        return self


class ModelTask(StrEnum):
    """What a served model does, which decides its routes and its runner."""

    AUTO = "auto"  # from the model folder's config.json (see `runners.tasks.resolve_task`)
    EMBED = "embed"  # /v1/embeddings
    GENERATE = "generate"  # /v1/completions and /v1/chat/completions (a causal LM)
    SCORE = "score"  # one relevance score per (query, document) pair (a cross-encoder)
    CLASSIFY = "classify"  # labels and their probabilities per input


class Quantization(StrEnum):
    """How a model's weights are stored, apart from the float type of its activations."""

    NONE = "none"  # the weights in the model's float type (`dtype`)
    INT8 = "int8"  # 8-bit integer weights (no runner implements it yet: refused at start-up)
    INT4 = "int4"  # 4-bit integer weights (no runner implements it yet: refused at start-up)


class ModelConfig(BaseModel):
    """Which model to serve and how to run it: the `[model]` table, or one `[[models]]` entry."""

    model_config = _FROZEN

    name: str = "minilm"
    """`minilm` (the bundled all-MiniLM-L6-v2), `smollm2` (the demo causal LM), a path to a
    local Hugging Face model folder, or a .gguf file."""
    served_name: str | None = None
    """The `model` name clients call it by and responses report (None: the built-in model's
    name, or the folder's or file's name). For a single model, `[server] served_model_name`
    sets it too."""
    task: ModelTask = ModelTask.AUTO
    """embed, generate, score, classify, or auto: from the folder's config.json (a causal LM
    generates; `*ForSequenceClassification` scores with one label, else classifies; any other
    model embeds)."""
    truncate: bool = False
    """Default for requests that do not say: truncate inputs over the model limit (else: error)."""
    max_length: int | None = Field(None, ge=1)
    """Override the model's input limit in tokens (never above what the model supports)."""
    device: str = "cpu"
    """Torch device: cpu, cuda, cuda:1, ..."""
    torch_threads: int | None = Field(None, ge=1)
    """Intra-op threads for torch on CPU (None: torch's default)."""
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "auto"
    """Float type of the model: float32, bfloat16, float16 (GPU only) or auto (bfloat16 where
    the hardware runs it natively, else float32). The start-up log says what was picked and why."""
    quantization: Quantization = Quantization.NONE
    """Weight quantization, apart from `dtype`: none, int8 or int4. A runner that does not
    implement the one asked for refuses to start (no runner implements int8 or int4 yet)."""
    cost_model: str | None = None
    """Path of the cost model (`lenbatch profile` JSON) this deployment was tuned with, `auto`
    (the one in `$LENBATCH_COST_DIR`, default the source checkout's `bench/results/`, measured
    on this processor) or a live adaptive server's URL (its online fit); serve warns at
    start-up when a file was measured on another processor (or does not say)."""
    execution: Literal["auto", "padded", "packed"] = "auto"
    """How a batch runs: `packed` (padding-free: the token-wise layers run on the batch's real
    tokens only; BERT-family encoders), `padded` (to the batch's longest member), or `auto`
    (packed where the model supports it, else padded)."""

    def default_served_name(self) -> str:
        """The served name when none is given, as far as the config can tell: the folder's or
        file's name (`.gguf` dropped). A built-in model reports its own name at run time."""
        return Path(self.name).expanduser().name.removesuffix(".gguf") or self.name


class ServerConfig(BaseModel):
    """The HTTP layer."""

    model_config = _FROZEN

    host: str = "127.0.0.1"
    """Address to bind. Loopback by default: expose deliberately."""
    port: int = Field(8000, ge=0, le=65535)
    """TCP port (0 picks a free one)."""
    api_key: str | None = None
    """If set, every endpoint but /health requires `Authorization: Bearer <key>`."""
    served_model_name: str | None = None
    """The `model` name reported in responses (default: derived from the model)."""
    max_inputs_per_request: int = Field(2048, ge=1)
    """Most inputs one /v1/embeddings call may carry."""
    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1024)
    """Largest accepted request body."""
    cors_origins: tuple[str, ...] = ()
    """Origins allowed by CORS; empty means CORS is off."""
    length_log: str | None = None
    """Path of a JSONL log of (id, arrival, length, bucket, queue wait, exec time); no text."""
    drain_timeout_s: float = Field(30.0, ge=0)
    """On SIGTERM (or Ctrl-C), how long queued and running requests may take to finish; new
    requests get 503 meanwhile and whatever is left after it is answered 503."""
    log_level: str = "info"
    """Log level of lenbatch and uvicorn."""


class AdmissionConfig(BaseModel):
    """Limits applied before a request is queued."""

    model_config = _FROZEN

    max_queue_total: int = Field(4096, ge=1)
    """Most inputs waiting in all queues together; beyond it new calls get 429 (a call with
    more inputs than this can never fit and gets 413)."""
    max_queue_per_bucket: int | None = Field(None, ge=1)
    """Most inputs waiting in one queue (None: only the total applies)."""
    tokens_per_s: float | None = Field(None, gt=0)
    """Token-bucket refill rate in tokens per second (None: no rate limit)."""
    burst_tokens: int | None = Field(None, ge=1)
    """Token-bucket size (default: one second of `tokens_per_s`)."""
    request_timeout_s: float | None = Field(None, gt=0)
    """Default deadline of a request from its arrival (None: no deadline); the
    `X-Request-Timeout` header overrides it per call. Expired requests are answered 504."""
    retry_after_s: float = Field(1.0, gt=0)
    """`Retry-After` sent with 429 for a full queue (rate-limit 429s send the exact wait)."""


class RecoveryConfig(BaseModel):
    """What the engine does when the model fails."""

    model_config = _FROZEN

    oom_cooldown_s: float = Field(30.0, ge=0)
    """After an out-of-memory error, how long the bucket's batch cap stays lowered (to half
    the failing batch) before it is restored."""
    probe_after_failures: int = Field(8, ge=1)
    """After this many failed model calls in a row, run one known-good input: if it fails too,
    the runner is declared crashed (not ready, every waiting request answered with 503)."""
    batch_timeout_s: float | None = Field(None, gt=0)
    """A batch still running after this many seconds means the runner hangs: it is declared
    crashed, and its requests answered 503 (None: wait for ever; set it above the slowest
    batch the budget allows)."""


class DecodeMode(StrEnum):
    """How a causal LM decodes its batches (see `lenbatch.generate.policy`).

    `static` is accepted as another name of `lockstep`, the mode's former name (strategy
    `static`, the padded baseline, is another thing)."""

    LOCKSTEP = "lockstep"  # a batch prefills together and decodes together until all rows stop
    CONTINUOUS = "continuous"  # rows join and leave the running batch at every step

    @classmethod
    def _missing_(cls, value: object) -> DecodeMode | None:
        return cls.LOCKSTEP if value == _LOCKSTEP_ALIAS else None

    @classmethod
    def choices(cls) -> list[str]:
        """Every name a config file or `--decode-mode` accepts: the modes, then the alias."""
        return [m.value for m in cls] + [_LOCKSTEP_ALIAS]


_LOCKSTEP_ALIAS = "static"  # what `lockstep` was called before; still accepted


class GenerationConfig(BaseModel):
    """Text generation (causal LMs only): decode mode, step budget and request defaults."""

    model_config = _FROZEN

    mode: DecodeMode = DecodeMode.CONTINUOUS
    """Decode mode: `lockstep` (a batch decodes together until all its rows stop; `static` is
    another name for it) or `continuous` batching."""
    max_running: int = Field(32, ge=1)
    """continuous: most sequences decoding at once (bounds the KV cache)."""
    step_tokens: int = Field(256, ge=1)
    """continuous: token budget of one step; a prefill chunk gets it minus the running rows."""
    default_max_tokens: int = Field(16, ge=1)
    """`max_tokens` of a completion that does not say (OpenAI's default is 16)."""
    max_tokens_limit: int | None = Field(None, ge=1)
    """Largest `max_tokens` a request may ask for (None: up to the context length)."""
    compile: bool = False
    """Fixed shapes (bucket x rows, rows x cache width), one torch.compile graph each."""
    compile_max_width: int = Field(512, ge=64)
    """compile: widest fixed shape (prompt or cache columns); wider units run eager."""


class Settings(BaseModel):
    """Everything `lenbatch serve` runs with.

    One model is `[model]`; several are `[[models]]` tables (a list in YAML), each with the
    fields of `[model]`. Give one or the other: `served_models()` returns the list either way.
    """

    model_config = _FROZEN

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
        too): what a single-model server runs with, from an entry of `served_models()`."""
        server = self.server.model_copy(update={"served_model_name": model.served_name})
        return self.model_copy(update={"model": model, "models": (), "server": server})


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
