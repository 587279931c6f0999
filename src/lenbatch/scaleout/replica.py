"""One engine replica: a lenbatch embedding `Engine` inside a Ray Serve replica.

The replica loads the same model with the same settings as `lenbatch serve` and runs the same
engine (buckets, scheduler, admission, recovery); only the HTTP layer is elsewhere (the ingress).
Inputs arrive tokenized (token-id arrays; the ingress measured their lengths once), and answers
go back as plain data: the vectors, or the error a client should see, so nothing depends on how
Ray wraps exceptions. The keyword arguments `group` and `replica` are for the request router
(`lenbatch.scaleout.router`) and ignored here.

On shutdown (Ray calls `__del__` during a graceful stop) the engine drains: every admitted
request is answered.
"""

from __future__ import annotations

import logging
from typing import Any

from lenbatch.config import Settings
from lenbatch.core.errors import LenbatchError
from lenbatch.embed.engine import Engine

__all__ = ["EngineReplica", "error_fields"]

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


class EngineReplica:
    """A Ray Serve deployment class: one lenbatch engine per replica."""

    # Ray Serve awaits an async constructor (the engine starts on the replica's loop).
    async def __init__(self, settings: dict[str, Any], threads: int = 1) -> None:  # type: ignore[misc]
        from ray import serve

        from lenbatch.runners import load_runner

        self.settings = Settings.model_validate(settings)
        m = self.settings.model
        runner = load_runner(
            m.name,
            device=m.device,
            max_length=m.max_length,
            torch_threads=m.torch_threads or threads,
            dtype=m.dtype,
        )
        self.engine = Engine(
            runner,
            self.settings.batching,
            self.settings.admission,
            recovery=self.settings.recovery,
            default_truncate=m.truncate,
        )
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        await self.engine.start()
        log.info("replica %s: %s", self.replica_id, self.engine.describe())

    async def info(self, **_: Any) -> dict[str, Any]:
        """The model's facts the ingress needs, and the engine's boundaries."""
        i = self.engine.info
        return {
            "replica": self.replica_id,
            "name": i.name,
            "dim": i.dim,
            "max_length": i.max_length,
            "vocab_size": i.vocab_size,
            "boundaries": list(self.engine.cfg.boundaries),
            "describe": self.engine.describe(),
        }

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
