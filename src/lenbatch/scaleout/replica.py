"""One engine replica: a lenbatch embedding `Engine` (`EngineReplica`) or a causal LM's
`GenerationEngine` (`LMReplica`) inside a Ray Serve replica.

The replica loads the same model with the same settings as `lenbatch serve` and runs the same
engine (buckets, scheduler, admission, recovery); only the HTTP layer is elsewhere (the ingress).
Inputs arrive tokenized (token-id arrays; the ingress measured their lengths once), and answers
go back as plain data: the vectors, or the error a client should see, so nothing depends on how
Ray wraps exceptions. The keyword arguments `group` and `replica` are for the request router
(`lenbatch.scaleout.router`) and ignored here.

`LMReplica.generate` is a streaming call: the first item says whether the prompt was admitted
(or carries the error a client should see), then one item per delta, the last with the
sequence's timings. The ingress relays them (`scaleout.lmfrontend`).

On shutdown (Ray calls `__del__` during a graceful stop) the engine drains: every admitted
request is answered.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator
from typing import Any

from lenbatch.config import Settings, Strategy
from lenbatch.core.errors import LenbatchError
from lenbatch.embed.engine import Engine
from lenbatch.runners.base import ModelInfo

__all__ = [
    "EngineReplica",
    "LMReplica",
    "ReplicaShell",
    "error_fields",
    "load_causal",
    "model_info",
]

log = logging.getLogger("lenbatch.scaleout.replica")


def error_fields(err: LenbatchError) -> dict[str, Any]:
    """What the ingress needs to answer with the same error: status, message, kind, code."""
    return {
        "status": err.status,
        "message": err.message,
        "kind": err.kind,
        "code": err.code,
        "retry_after": err.retry_after,
    }


class ReplicaShell:
    """What both replica kinds share: figures for the ingress, Ray's health check and the
    drain on a graceful stop (subclasses set `engine`, `settings` and `replica_id`)."""

    engine: Any
    settings: Settings
    replica_id: str

    async def info(self, **_: Any) -> dict[str, Any]:
        """The model's facts the ingress needs (`model`: its `ModelInfo` as plain data, see
        `model_info`), and the engine's boundaries."""
        return {
            "model": dataclasses.asdict(self.engine.info),
            "replica": self.replica_id,
            "boundaries": list(self.engine.cfg.boundaries),
            "describe": self.engine.describe(),
        }

    async def figures(self, **_: Any) -> tuple[dict[str, Any], bytes]:
        """The engine's `/stats` JSON and its Prometheus exposition, in one call."""
        out = self.engine.stats()
        out["replica"] = self.replica_id
        return out, self.engine.prometheus()

    def check_health(self) -> None:
        """Ray's health check: a failed runner makes the replica unhealthy, so Ray replaces it."""
        if self.engine.failure is not None:
            raise RuntimeError(f"runner failed: {self.engine.failure}")

    async def __del__(self) -> None:
        # Ray's graceful stop: answer every admitted request before the replica goes.
        await self.engine.stop(timeout=self.settings.server.drain_timeout_s)


class EngineReplica(ReplicaShell):
    """A Ray Serve deployment class: one lenbatch engine per replica."""

    # Ray Serve awaits an async constructor (the engine starts on the replica's loop).
    async def __init__(self, settings: dict[str, Any], threads: int = 1) -> None:  # type: ignore[misc]
        from ray import serve

        from lenbatch.runners import load_runner

        self.settings = Settings.model_validate(settings)
        m = self.settings.model
        execution = m.execution
        if execution == "auto" and self.settings.batching.strategy is Strategy.STATIC:
            execution = "padded"  # as `lenbatch serve`: static pads on purpose
        runner = load_runner(
            m.name,
            device=m.device,
            max_length=m.max_length,
            torch_threads=m.torch_threads or threads,
            dtype=m.dtype,
            execution=execution,
            quantization=m.quantization.value,
        )
        # Replicas share the machine: pinned, each one's forwards would crowd onto the same core.
        batching = self.settings.batching.model_copy(update={"pin_workers": False})
        self.engine = Engine(
            runner,
            batching,
            self.settings.admission,
            recovery=self.settings.recovery,
            default_truncate=m.truncate,
            adaptive=self.settings.adaptive,
        )
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        await self.engine.start()
        log.info("replica %s: %s", self.replica_id, self.engine.describe())

    async def embed(
        self,
        ids: list[list[int]],
        truncate: bool,
        timeout: float | None,
        priority: int = 0,
        **_: Any,
    ) -> dict[str, Any]:
        """Vectors of token-id arrays, in order, with the tokens embedded; or the error."""
        try:
            done = await self.engine.embed_with_usage(
                ids, truncate=truncate, timeout=timeout, priority=priority
            )
        except LenbatchError as err:
            return {"error": error_fields(err), "replica": self.replica_id}
        return {"vectors": done.vectors, "tokens": done.prompt_tokens, "replica": self.replica_id}


class LMReplica(ReplicaShell):
    """A Ray Serve deployment class: one `GenerationEngine` (a causal LM) per replica, loaded
    exactly as `lenbatch serve --model <causal LM>` loads it."""

    async def __init__(self, settings: dict[str, Any], threads: int = 1) -> None:  # type: ignore[misc]
        from ray import serve

        from lenbatch.generate.engine import GenerationEngine
        from lenbatch.serving.torchthread import on_torch_thread

        self.settings = Settings.model_validate(settings)
        m = self.settings.model
        # loaded on the thread the engine runs it on (`serving.torchthread`: one OpenMP pool)
        runner = on_torch_thread(load_causal, self.settings, m.device, m.torch_threads or threads)
        s = self.settings
        self.engine = GenerationEngine(runner, s.batching, s.admission, s.generation)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        await self.engine.start()
        log.info("replica %s: %s", self.replica_id, self.engine.describe())

    async def prompt_logprobs(self, prompt: list[int], top: int, **_: Any) -> dict[str, Any]:
        """`{"logprobs": [TokenLogprob, ...]}` of a checked `prompt` (for `echo`), from this
        replica's model, or `{"error": ...}`."""
        try:
            return {"logprobs": await self.engine.prompt_logprobs(prompt, top)}
        except LenbatchError as err:
            return {"error": error_fields(err), "replica": self.replica_id}

    async def generate(
        self,
        prompt: list[int],
        params: Any,
        timeout: float | None,
        priority: int = 0,
        **_: Any,
    ) -> AsyncIterator[dict[str, Any]]:
        """Generate from one tokenized prompt: `{"admitted": replica}` or `{"error": ...}`
        first, then `{"ids", "text", "finish_reason"}` per delta (and `logprobs`, the
        `TokenLogprob`s, where the request asked for them; the last one also carries
        `timings` and `cached_tokens`), or `{"error": ...}` if the sequence fails. Leaving
        early (the ingress cancels the stream) cancels the sequence."""
        try:
            seq = self.engine.submit(prompt, params, timeout=timeout, priority=priority)
        except LenbatchError as err:
            yield {"error": error_fields(err), "replica": self.replica_id}
            return
        yield {"admitted": self.replica_id}
        try:
            async for d in self.engine.stream(seq):
                item: dict[str, Any] = {
                    "ids": list(d.token_ids),
                    "text": d.text,
                    "finish_reason": d.finish_reason,
                }
                if d.logprobs is not None:
                    item["logprobs"] = d.logprobs
                if d.finish_reason is not None:
                    item["timings"] = seq.timings.summary_ms()
                    item["cached_tokens"] = seq.cached_tokens
                yield item
        except LenbatchError as err:
            yield {"error": error_fields(err), "replica": self.replica_id}


def model_info(facts: dict[str, Any]) -> ModelInfo:
    """The served model's facts from what a replica's `info()` answered."""
    return ModelInfo(**facts["model"])


def load_causal(settings: Settings, device: str, threads: int) -> Any:
    """The settings' causal LM as `lenbatch serve` loads it (a `CausalLMRunner`)."""
    from lenbatch.runners.causal import CausalLMRunner, resolve_causal_model

    m = settings.model
    ref = resolve_causal_model(m.name)
    if ref is None:
        raise ValueError("the model is not a causal LM")
    return CausalLMRunner(
        ref.folder,
        gguf_file=ref.gguf_file,
        name=ref.name,
        device=device,
        max_length=m.max_length,
        torch_threads=threads,
        dtype=m.dtype,
        quantization=m.quantization.value,
    )
