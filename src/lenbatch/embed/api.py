"""The embeddings API: `POST /v1/embeddings` (OpenAI-compatible), `GET /v1/models`, `/health`,
`/metrics` (Prometheus) and `/stats` (JSON summary) over an embedding `Engine`.

The routes only validate the body's shape and call the engine; the app shell (guard, error
shape, validation messages, draining server) is `lenbatch.serving.http`.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import FastAPI, Header, Request
from fastapi.responses import JSONResponse, Response

from lenbatch.config import Settings
from lenbatch.core.errors import BadInput
from lenbatch.embed.engine import Engine
from lenbatch.embed.protocol import EmbeddingRequest, encode_vector
from lenbatch.serving.http import check_model, new_app, serve_app, until_disconnect

__all__ = ["create_app", "serve"]

log = logging.getLogger("lenbatch.embed.api")

_TIMEOUT_DOC = (
    "Seconds this call may wait before it runs; if it has not started by then its inputs are "
    "dropped and the answer is 504. Overrides the server's admission.request_timeout_s."
)


def create_app(engine: Engine, settings: Settings | None = None) -> FastAPI:
    """The FastAPI app serving `engine`; starts and drains the engine with the app's lifespan."""
    settings = settings or Settings()
    served = settings.server.served_model_name or engine.info.name
    accepted_names = {served, engine.info.name, settings.model.name}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        log.info(
            "engine started: strategy=%s lanes=%s",
            engine.cfg.strategy.value,
            ",".join(engine.lane_labels),
        )
        yield
        await engine.stop(timeout=settings.server.drain_timeout_s)
        log.info("engine stopped")

    app = new_app(settings, lifespan)

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 while accepting work; 503 with the state (and the reason if the runner
        failed) while draining, failed or stopped."""
        if engine.ready:
            return JSONResponse({"status": "ok"})
        body: dict[str, Any] = {"status": engine.state.value}
        if engine.failure is not None:
            body["reason"] = engine.failure
        return JSONResponse(body, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        """Prometheus exposition."""
        mem = engine.runner.memory()
        engine.metrics.set_memory(mem.weights, mem.peak_activations, mem.device)
        return Response(
            engine.metrics.prometheus(), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    @app.get("/stats")
    async def stats() -> JSONResponse:
        """JSON summary: waste, latency percentiles, per-bucket figures, batch caps, state."""
        mem = engine.runner.memory()
        engine.metrics.set_memory(mem.weights, mem.peak_activations, mem.device)
        out = engine.metrics.stats()
        out["model"] = served
        out["state"] = engine.state.value
        out["boundaries"] = list(engine.cfg.boundaries)
        out["default_boundaries"] = engine.uses_default_boundaries
        out["queue_depths"] = engine.queues.depths()
        out["unanswered"] = engine.unanswered
        out["batch_caps"] = engine.caps.describe(engine.clock.now(), engine.lane_labels)
        return JSONResponse(out)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        """The one served model, OpenAI style."""
        return JSONResponse(
            {
                "object": "list",
                "data": [{"id": served, "object": "model", "owned_by": "lenbatch", "created": 0}],
            }
        )

    @app.post("/v1/embeddings")
    async def embeddings(
        body: EmbeddingRequest,
        request: Request,
        x_request_timeout: Annotated[
            float | None, Header(gt=0, allow_inf_nan=False, description=_TIMEOUT_DOC)
        ] = None,
    ) -> Response:
        """OpenAI-compatible embeddings; each input is batched by its own length."""
        check_model(body.model, accepted_names, served)
        if body.dimensions is not None and body.dimensions != engine.info.dim:
            raise BadInput(
                f"dimensions={body.dimensions} is not supported: this model's "
                f"vectors have {engine.info.dim} dimensions"
            )
        ids = _token_ids(body.input, engine, body.truncate, settings.server.max_inputs_per_request)
        work = asyncio.ensure_future(
            engine.embed(ids, truncate=body.truncate, timeout=x_request_timeout)
        )
        gone = asyncio.ensure_future(until_disconnect(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            work.cancel()
            gone.cancel()
            raise
        gone.cancel()
        if not work.done():
            work.cancel()  # the client left: its requests leave the queue
            await asyncio.wait({work})  # let the cancellation run before answering
        if work.cancelled():
            log.info("client disconnected: %d inputs withdrawn", len(ids))
            return Response(status_code=499)
        vectors = work.result()
        usage = sum(len(x) for x in ids)
        data = [
            {"object": "embedding", "index": i, "embedding": encode_vector(v, body.encoding_format)}
            for i, v in enumerate(vectors)
        ]
        payload = {
            "object": "list",
            "data": data,
            "model": served,
            "usage": {"prompt_tokens": usage, "total_tokens": usage},
        }
        return Response(json.dumps(payload, separators=(",", ":")), media_type="application/json")

    return app


def _token_ids(
    raw: str | list[str] | list[int] | list[list[int]],
    engine: Engine,
    truncate: bool | None,
    max_inputs: int,
) -> list[list[int]]:
    """Validate `input` and turn it into token-id lists (tokenizing text, then dropping it)."""
    if isinstance(raw, str):
        raw = [raw]
    if not raw:
        raise BadInput("input is empty: give a string, a list of strings or token ids")
    if isinstance(raw[0], int):
        raw = [raw]  # one token array
    if len(raw) > max_inputs:
        raise BadInput(f"{len(raw)} inputs in one call; the limit is {max_inputs}")
    if isinstance(raw[0], str):
        texts: list[str] = raw
        for i, t in enumerate(texts):
            if not t:
                raise BadInput(f"input {i} is an empty string")
            if not t.isascii():
                try:
                    t.encode("utf-8")
                except UnicodeEncodeError:
                    raise BadInput(
                        f"input {i} is not valid Unicode (it holds a lone surrogate escape)"
                    ) from None
        try:
            ids = engine.tokenize(texts, truncate)
        except Exception as exc:  # the message could quote the text: report the type only
            raise BadInput(
                f"the tokenizer could not process the input ({type(exc).__name__})"
            ) from None
        return ids
    ids = raw
    vocab = engine.info.vocab_size
    for i, seq in enumerate(ids):
        if not seq:
            raise BadInput(f"input {i} is an empty token array")
        if min(seq) < 0 or max(seq) >= vocab:
            raise BadInput(f"input {i} has token ids outside [0, {vocab})")
    return ids


def serve(engine: Engine, settings: Settings) -> None:
    """Serve `engine` over HTTP until SIGTERM or Ctrl-C, then drain and exit."""
    serve_app(create_app(engine, settings), engine, settings)
