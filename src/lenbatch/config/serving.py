"""The serving side's settings: the HTTP layer, admission limits, recovery from model failures,
and text generation."""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, Field

from lenbatch.config.fields import FROZEN

__all__ = [
    "AdmissionConfig",
    "DecodeMode",
    "GenerationConfig",
    "RecoveryConfig",
    "ServerConfig",
]


class ServerConfig(BaseModel):
    """The HTTP layer."""

    model_config = FROZEN

    host: str = "127.0.0.1"
    """Address to bind. Loopback by default: expose deliberately."""
    port: int = Field(8000, ge=0, le=65535)
    """TCP port (0 picks a free one)."""
    api_key: str | None = None
    """If set, every endpoint but /health requires `Authorization: Bearer <key>`."""
    served_model_name: str | None = None
    """The `model` name reported in responses (default: derived from the model)."""
    max_inputs_per_request: int = Field(2048, ge=1)
    """Most inputs one call may carry: /v1/embeddings inputs, rerank documents, score pairs,
    classify inputs."""
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
    access_log: bool = False
    """Log one line per HTTP request (uvicorn's access log: client address, method, path,
    status; never a body). Off by default: the line cost the event loop about 8 % of its CPU
    per one-input request (py-spy on `make serve`'s line, Intel Xeon family 6 model 167), and
    `/metrics` already counts requests by status."""
    allocator: Literal["auto", "tcmalloc", "system"] = "auto"
    """The process's malloc. `auto`: tcmalloc where its library is installed (the server
    re-executes itself once with it preloaded), else glibc's, said in the log; `tcmalloc`:
    refuse to start without it; `system`: whatever the process was launched with. glibc's
    malloc keeps freed activation buffers and lets the resident set climb with each new mix of
    batch shapes; tcmalloc keeps it put and runs the forward faster (runners/allocator.py)."""


class AdmissionConfig(BaseModel):
    """Limits applied before a request is queued."""

    model_config = FROZEN

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

    model_config = FROZEN

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

    model_config = FROZEN

    mode: DecodeMode = DecodeMode.CONTINUOUS
    """Decode mode: `lockstep` (a batch decodes together until all its rows stop; `static` is
    another name for it) or `continuous` batching."""
    max_running: int = Field(64, ge=1)
    """continuous: most sequences decoding at once (bounds the KV cache). 64 rather than 32:
    at ten times issue 25's light load a burst's prompts no longer wait for running streams
    to finish (TTFT P95 295-581 against 727-1,201 ms, inter-token P95 +11 % relative to the
    decode step; Intel Xeon family 6 model 207, SmolLM2 bf16)."""
    step_tokens: int = Field(256, ge=1)
    """continuous: token budget of one step; a prefill chunk gets it minus the running rows
    (twice it while at most 4 rows decode: few streams wait on a bigger chunk)."""
    tool_call_parser: Literal["hermes", "pythonic"] | None = None
    """The model's own tool-call format, read out of its text under `tool_choice: "auto"`
    (`generate.toolparsers`); None: `auto` is refused with a 400, as vLLM without a parser."""
    prefix_cache_mb: int = Field(512, ge=0)
    """Most MiB of prompt prefixes' keys and values kept for prompts that start the same way
    (`generate.prefixcache`); 0 turns prefix caching off. vLLM's is on by default too."""
    default_max_tokens: int = Field(16, ge=1)
    """`max_tokens` of a completion that does not say (OpenAI's default is 16)."""
    max_tokens_limit: int | None = Field(None, ge=1)
    """Largest `max_tokens` a request may ask for (None: up to the context length)."""
    compile: bool = False
    """Fixed shapes (bucket x rows, rows x cache width), one torch.compile graph each."""
    compile_max_width: int = Field(512, ge=64)
    """compile: widest fixed shape (prompt or cache columns); wider units run eager."""
