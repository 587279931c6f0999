"""The encoder tasks' routes over a `ScoringService`: rerank, score and classify.

- `POST /v1/rerank`, `/v2/rerank` (Cohere v2, Jina, vLLM): `{model, query, documents: [str |
  {text}], top_n?, return_documents?}` -> `{id, model, results: [{index, relevance_score,
  document?: {text}}], usage: {total_tokens}}`, best first.
- `POST /rerank`: the same with `documents`, or TEI's `{query, texts, raw_scores?,
  return_text?, truncate?}` -> `[{index, score, text?}]`, best first; the body tells them apart.
- `POST /v1/score`, `/score` (vLLM): `{model, text_1: str | [str], text_2: str | [str]}` ->
  `{id, object, created, model, data: [{index, object: "score", score}], usage}`.
- `POST /classify` (vLLM): `{model, input: str | [str]}` -> `{..., data: [{index, label, probs,
  num_classes}], usage}`.

Each (query, document) pair is one input to the engine, bucketed by its own token count and
batched with other requests' pairs. Scores are the head's logits through sentence-transformers'
`CrossEncoder` default activation (sigmoid for one label), or the logits with `raw_scores`;
probabilities are transformers' (softmax, or a sigmoid per label for a multi-label head).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Sequence
from typing import Annotated, Any

import numpy as np
from fastapi import FastAPI, Header, Request
from fastapi.responses import Response

from lenbatch.config import Settings
from lenbatch.core.errors import BadInput
from lenbatch.embed.protocol import dumps
from lenbatch.embed.score_protocol import (
    ClassifyRequest,
    Document,
    RerankRequest,
    ScoreRequest,
    activate,
    probabilities,
)
from lenbatch.runners.tokenizer import TextTokenizer
from lenbatch.serving.http import check_model, engine_app, unless_disconnected
from lenbatch.serving.messages import PairInputs, Predicted
from lenbatch.serving.routes import add_task_refusals
from lenbatch.serving.server import received_at, serve_app
from lenbatch.serving.services import ScoringService
from lenbatch.serving.tokenize_api import add_tokenize_routes

__all__ = ["create_scoring_app", "serve_scoring"]

log = logging.getLogger("lenbatch.embed.score_api")

_Timeout = Annotated[
    float | None,
    Header(gt=0, allow_inf_nan=False, description="Seconds the inputs may wait before they run."),
]


def create_scoring_app(
    engine: ScoringService,
    settings: Settings | None = None,
    tokenizer: TextTokenizer | None = None,
) -> FastAPI:
    """The FastAPI app serving a scorer or classifier `engine` (started and drained with the
    app's lifespan); `tokenizer` adds `/tokenize` and `/detokenize`."""
    settings = settings or Settings()
    served = settings.server.served_model_name or engine.info.name
    accepted = {served, engine.info.name, settings.model.name}
    labels = list(engine.labels)
    one_label = len(labels) == 1
    tasks = ["score", "classify"] if one_label else ["classify"]
    app = engine_app(engine, settings, served, {"task": tasks[0], "labels": labels})
    max_inputs = settings.server.max_inputs_per_request

    def check_scorer() -> None:
        if not one_label:
            raise BadInput(
                f"model {served!r} has {len(labels)} labels: rerank and score need a "
                "cross-encoder with one label; use /classify",
                code="wrong_task",
            )

    def check_count(n: int, what: str) -> None:
        if n == 0:
            raise BadInput(f"{what} is empty: give at least one")
        if n > max_inputs:
            raise BadInput(f"{n} {what} in one call; the limit is {max_inputs}")

    async def run(
        request: Request, inputs: PairInputs, body: Any, timeout: float | None
    ) -> Predicted | None:
        work = engine.predict_with_usage(
            inputs,
            truncate=body.truncate,
            timeout=timeout,
            priority=body.priority or 0,
            arrival=received_at(request.scope, engine.clock),  # tokenizing's wait counts
        )
        done = await unless_disconnected(request, work)
        if done is None:
            log.info("client disconnected: %d inputs withdrawn", len(inputs))
        return done

    def scores(done: Predicted, raw: bool) -> list[float]:
        logits = np.stack(done.logits)[:, 0]
        values = logits if raw else activate(logits, engine.activation)
        return [float(v) for v in values]

    async def rerank(body: RerankRequest, request: Request, timeout: float | None) -> Response:
        check_model(body.model, accepted, served)
        check_scorer()
        tei = body.texts is not None
        if tei == (body.documents is not None):
            raise BadInput("give documents (Cohere/Jina shape) or texts (TEI shape), not both")
        docs = body.texts if body.texts is not None else _texts(body.documents or [])
        check_count(len(docs), "documents")
        if body.top_n is not None and body.top_n < 1:
            raise BadInput(f"top_n must be at least 1; got {body.top_n}")
        done = await run(request, [(body.query, d) for d in docs], body, timeout)
        if done is None:
            return Response(status_code=499)
        values = scores(done, body.raw_scores)
        order = sorted(range(len(docs)), key=lambda i: -values[i])
        if tei:
            tei_out = [
                {"index": i, "score": values[i]} | ({"text": docs[i]} if body.return_text else {})
                for i in order
            ]
            return Response(dumps(tei_out), media_type="application/json")
        top = order[: body.top_n] if body.top_n is not None else order
        results = [
            {"index": i, "relevance_score": values[i]}
            | ({"document": {"text": docs[i]}} if body.return_documents else {})
            for i in top
        ]
        payload = {
            "id": f"rerank-{uuid.uuid4().hex}",
            "model": served,
            "results": results,
            "usage": {"total_tokens": done.prompt_tokens},
        }
        return Response(dumps(payload), media_type="application/json")

    @app.post("/v1/rerank")
    async def rerank_v1(
        body: RerankRequest, request: Request, x_request_timeout: _Timeout = None
    ) -> Response:
        """Cohere v2 / Jina / vLLM rerank: documents sorted by relevance to the query."""
        return await rerank(body, request, x_request_timeout)

    @app.post("/v2/rerank")
    async def rerank_v2(
        body: RerankRequest, request: Request, x_request_timeout: _Timeout = None
    ) -> Response:
        """The same as `/v1/rerank` (vLLM serves Cohere's v2 path too)."""
        return await rerank(body, request, x_request_timeout)

    @app.post("/rerank")
    async def rerank_plain(
        body: RerankRequest, request: Request, x_request_timeout: _Timeout = None
    ) -> Response:
        """TEI's shape with `texts`, or the Cohere/Jina shape with `documents`."""
        return await rerank(body, request, x_request_timeout)

    async def score(body: ScoreRequest, request: Request, timeout: float | None) -> Response:
        check_model(body.model, accepted, served)
        check_scorer()
        firsts = [body.text_1] if isinstance(body.text_1, str) else body.text_1
        seconds = [body.text_2] if isinstance(body.text_2, str) else body.text_2
        if len(firsts) == 1:
            firsts = firsts * len(seconds)
        elif len(seconds) == 1:
            seconds = seconds * len(firsts)
        elif len(firsts) != len(seconds):
            raise BadInput(
                f"text_1 has {len(firsts)} texts and text_2 {len(seconds)}: give one text_1, "
                "or lists of equal length"
            )
        check_count(len(firsts), "pairs")
        done = await run(request, list(zip(firsts, seconds, strict=True)), body, timeout)
        if done is None:
            return Response(status_code=499)
        values = scores(done, body.raw_scores)
        payload = {
            "id": f"score-{uuid.uuid4().hex}",
            "object": "list",
            "created": int(time.time()),
            "model": served,
            "data": [{"index": i, "object": "score", "score": v} for i, v in enumerate(values)],
            "usage": _usage(done),
        }
        return Response(dumps(payload), media_type="application/json")

    @app.post("/v1/score")
    async def score_v1(
        body: ScoreRequest, request: Request, x_request_timeout: _Timeout = None
    ) -> Response:
        """vLLM's score: one `text_1` against every `text_2`, or two lists pairwise."""
        return await score(body, request, x_request_timeout)

    @app.post("/score")
    async def score_plain(
        body: ScoreRequest, request: Request, x_request_timeout: _Timeout = None
    ) -> Response:
        """The same as `/v1/score`."""
        return await score(body, request, x_request_timeout)

    @app.post("/classify")
    async def classify(
        body: ClassifyRequest, request: Request, x_request_timeout: _Timeout = None
    ) -> Response:
        """vLLM's classify: each input's label and label probabilities."""
        check_model(body.model, accepted, served)
        texts = [body.input] if isinstance(body.input, str) else body.input
        check_count(len(texts), "inputs")
        done = await run(request, texts, body, x_request_timeout)
        if done is None:
            return Response(status_code=499)
        probs = probabilities(np.stack(done.logits), engine.problem_type)
        data = [
            {
                "index": i,
                "label": labels[int(np.argmax(p))],
                "probs": [float(x) for x in p],
                "num_classes": len(labels),
            }
            for i, p in enumerate(probs)
        ]
        payload = {
            "id": f"classify-{uuid.uuid4().hex}",
            "object": "list",
            "created": int(time.time()),
            "model": served,
            "data": data,
            "usage": _usage(done),
        }
        return Response(dumps(payload), media_type="application/json")

    if tokenizer is not None:
        add_tokenize_routes(app, tokenizer, engine.info.max_length, accepted, served)
    add_task_refusals(app, served, tasks)
    return app


def _texts(documents: Sequence[str | Document]) -> list[str]:
    return [d if isinstance(d, str) else d.text for d in documents]


def _usage(done: Predicted) -> dict[str, int]:
    return {"prompt_tokens": done.prompt_tokens, "total_tokens": done.prompt_tokens}


def serve_scoring(
    engine: ScoringService, settings: Settings, tokenizer: TextTokenizer | None = None
) -> None:
    """Serve a scorer or classifier over HTTP until SIGTERM or Ctrl-C, then drain and exit."""
    serve_app(create_scoring_app(engine, settings, tokenizer), engine, settings)
