"""The embeddings API: `POST /v1/embeddings` (OpenAI-compatible), `GET /v1/models`, `/health`,
`/metrics` (Prometheus) and `/stats` (JSON summary) over an `EmbeddingService` (the single
server's `Engine`, or the Ray ingress's front-end).

The routes only validate the body's shape and call the engine; the app shell (guard, error
shape, validation messages) is `lenbatch.serving.http`, the hot route's machinery
`lenbatch.serving.hotroute`, the draining server `lenbatch.serving.server`.
"""

from __future__ import annotations

import logging
from typing import Annotated

from fastapi import FastAPI, Header, Request
from fastapi.responses import Response
from pydantic import ValidationError
from starlette.types import Receive, Scope

from lenbatch.config import Settings
from lenbatch.core.errors import BadInput
from lenbatch.embed.prompting import cut_dimensions, prompt_for, prompted
from lenbatch.embed.protocol import EmbeddingRequest, dumps, encode_vector
from lenbatch.runners.tokenizer import TextTokenizer
from lenbatch.serving.hotroute import add_hot_route, hot_headers
from lenbatch.serving.http import check_model, engine_app, watched
from lenbatch.serving.messages import Inputs
from lenbatch.serving.routes import add_task_refusals
from lenbatch.serving.server import received_at, serve_app
from lenbatch.serving.services import EmbeddingService
from lenbatch.serving.tokenize_api import add_tokenize_routes

__all__ = ["create_app", "serve"]

log = logging.getLogger("lenbatch.embed.api")

_PRIORITY_DOC = (
    "Priority level of this call's inputs: 0 (the default) to the server's priority_levels - 1; "
    "higher levels run first, FIFO within a level, and long waits age to the top. The body's "
    "`priority` field overrides it."
)
_TIMEOUT_DOC = (
    "Seconds this call may wait before it runs; if it has not started by then its inputs are "
    "dropped and the answer is 504. Overrides the server's admission.request_timeout_s."
)


def create_app(
    engine: EmbeddingService,
    settings: Settings | None = None,
    tokenizer: TextTokenizer | None = None,
) -> FastAPI:
    """The FastAPI app serving `engine`; starts and drains the engine with the app's lifespan.
    `tokenizer` (the model's) adds `/tokenize` and `/detokenize`."""
    settings = settings or Settings()
    served = settings.server.served_model_name or engine.info.name
    accepted_names = {served, engine.info.name, settings.model.name}

    app = engine_app(engine, settings, served, {"task": "embed"})
    has_default_prompt = engine.info.default_prompt_name is not None

    async def answer(
        body: EmbeddingRequest,
        timeout: float | None,
        header_priority: int | None,
        receive: Receive,
        arrival: float,
    ) -> Response:
        """The answer to a validated call received at `arrival` (the engine's clock): the
        FastAPI route's and the hot route's."""
        check_model(body.model, accepted_names, served)
        info = engine.info
        if body.dimensions is not None and body.dimensions > info.dim:
            cut_dimensions([], body.dimensions, info.dim, info.normalized)  # raises its 400
        inputs: Inputs = _inputs(body.input, settings.server.max_inputs_per_request)
        if has_default_prompt or body.prompt_name is not None or body.input_type is not None:
            prompt = prompt_for(info, body.prompt_name, body.input_type)
            if prompt is not None:
                inputs = prompted(inputs, prompt)
        priority = body.priority if body.priority is not None else header_priority
        work = engine.embed_with_usage(
            inputs, truncate=body.truncate, timeout=timeout, priority=priority or 0, arrival=arrival
        )
        done = await watched(app, receive, work)
        if done is None:
            log.info("client disconnected: %d inputs withdrawn", len(inputs))
            return Response(status_code=499)
        usage = done.prompt_tokens
        vectors = done.vectors
        if body.dimensions is not None:
            vectors = cut_dimensions(vectors, body.dimensions, info.dim, info.normalized)
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
        return Response(dumps(payload), media_type="application/json")

    @app.post("/v1/embeddings")
    async def embeddings(
        body: EmbeddingRequest,
        request: Request,
        x_request_timeout: Annotated[
            float | None, Header(gt=0, allow_inf_nan=False, description=_TIMEOUT_DOC)
        ] = None,
        x_priority: Annotated[int | None, Header(description=_PRIORITY_DOC)] = None,
    ) -> Response:
        """OpenAI-compatible embeddings; each input is batched by its own length."""
        arrival = received_at(request.scope, engine.clock)
        return await answer(body, x_request_timeout, x_priority, request.receive, arrival)

    async def hot_embeddings(scope: Scope, raw: bytes, receive: Receive) -> Response | None:
        # The same route for the calls it can read without FastAPI: a JSON body that
        # validates and plain header values; anything else goes on to the route above.
        arrival = received_at(scope, engine.clock)
        head = hot_headers(scope)
        if head is None:
            return None
        try:
            body = EmbeddingRequest.model_validate_json(raw)
        except ValidationError:
            return None
        return await answer(body, head.timeout, head.priority, receive, arrival)

    add_hot_route(app, "POST", "/v1/embeddings", hot_embeddings)

    if tokenizer is not None:
        add_tokenize_routes(app, tokenizer, engine.info.max_length, accepted_names, served)
    add_task_refusals(app, served, ["embed"])
    return app


def _inputs(
    raw: str | list[str] | list[int] | list[list[int]], max_inputs: int
) -> list[str] | list[list[int]]:
    """`input` as a list of texts or of token arrays (the engine tokenizes and checks them)."""
    if isinstance(raw, str):
        return [raw]
    if not raw:
        raise BadInput("input is empty: give a string, a list of strings or token ids")
    if isinstance(raw[0], int):
        return [raw]  # one token array
    if len(raw) > max_inputs:
        raise BadInput(f"{len(raw)} inputs in one call; the limit is {max_inputs}")
    return raw


def serve(
    engine: EmbeddingService, settings: Settings, tokenizer: TextTokenizer | None = None
) -> None:
    """Serve `engine` over HTTP until SIGTERM or Ctrl-C, then drain and exit."""
    serve_app(create_app(engine, settings, tokenizer), engine, settings)
