"""Several models in one process: one HTTP server, one engine per model, one CPU budget.

Each model is served by the app its kind has alone (`embed/api.py`, `embed/score_api.py`,
`generate/api.py`), with its own engine, lanes, buckets and cost model. In front of them,
`ModelRouter` reads a POST body's `model` field and hands the call to that model's app
unchanged (so every route, its validation and its errors are exactly the single-model ones):

- a name no model is served under: 404 in OpenAI's error shape, listing the served names;
- no `model`: the one model that does the route's task, else a 400 listing the names (several
  do it) or saying which task each model does (none does);
- `GET /v1/models` lists every model with its task; `/health` is 503 naming any model that
  failed; `/metrics` carries every model's series with a `model` label; `/stats` keeps the
  first model's summary at the top level (what `lenbatch calibrate` and the Ray cost fit read)
  and adds `models: {name: its summary}` and the CPU budget's figures.

The engines share a `ComputeBudget`: their model calls take turns on the cores, by priority and
due time, so a burst on one model cannot starve another. `ServiceGroup` is the one `Service`
the HTTP shell starts and drains: every engine together.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import orjson
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from lenbatch.config import Settings
from lenbatch.core.errors import BadInput, ModelNotFound
from lenbatch.serving.budget import ComputeBudget
from lenbatch.serving.http import freeze_heap, guarded, new_app
from lenbatch.serving.http_errors import error_response
from lenbatch.serving.lifecycle import EngineState
from lenbatch.serving.routes import TASK_ROUTES, tasks_phrase
from lenbatch.serving.services import Service

__all__ = ["ModelRouter", "ServedModel", "ServiceGroup", "build_router", "merge_prometheus"]

_EVERY_MODEL = ("/tokenize", "/detokenize", "/decode")  # routes every model serves


@dataclass
class ServedModel:
    """One model of a several-model server: the name it is served under (and other names a
    call may use for it), the tasks it does, its engine and the app it has alone."""

    name: str
    tasks: list[str]
    engine: Service
    app: ASGIApp
    aliases: set[str] = field(default_factory=set)
    card: dict[str, Any] = field(default_factory=dict)

    def answers_to(self, requested: str) -> bool:
        """True if a call naming `requested` means this model."""
        return requested == self.name or requested in self.aliases


class ServiceGroup:
    """Every model's engine as one `Service`: started, drained and stopped together; ready
    while all are; its figures are the first model's (`stats` adds the others)."""

    def __init__(self, models: Sequence[ServedModel], budget: ComputeBudget) -> None:
        self.models = list(models)
        self.budget = budget

    @property
    def state(self) -> EngineState:
        """Failed if any engine failed, else the first engine that is not running, else
        running."""
        states = [m.engine.state for m in self.models]
        if EngineState.FAILED in states:
            return EngineState.FAILED
        return next((s for s in states if s is not EngineState.RUNNING), EngineState.RUNNING)

    @property
    def failure(self) -> str | None:
        """Which models failed and why."""
        failed = [f"model {m.name!r}: {m.engine.failure}" for m in self.models if m.engine.failure]
        return "; ".join(failed) or None

    @property
    def ready(self) -> bool:
        """True while every model accepts work."""
        return all(m.engine.ready for m in self.models)

    @property
    def unanswered(self) -> int:
        """Admitted requests not answered yet, all models together."""
        return sum(m.engine.unanswered for m in self.models)

    async def start(self) -> None:
        """Start every engine."""
        for m in self.models:
            await m.engine.start()

    async def drain(self, timeout: float | None = 30.0) -> None:
        """Drain every engine at once."""
        await asyncio.gather(*(m.engine.drain(timeout) for m in self.models))

    async def stop(self, timeout: float | None = 30.0) -> None:
        """Drain, then stop every engine."""
        await asyncio.gather(*(m.engine.stop(timeout) for m in self.models))

    def describe(self) -> str:
        """One line per model."""
        return "; ".join(
            f"{m.name} ({', '.join(m.tasks)}): {m.engine.describe()}" for m in self.models
        )

    def stats(self) -> dict[str, Any]:
        """The first model's summary at the top level (its readers stay as they are), every
        model's under `models`, and the CPU budget's figures."""
        per = {m.name: {**m.engine.stats(), "task": m.tasks[0]} for m in self.models}
        first = self.models[0].name
        return {**per[first], "model": first, "models": per, "cpu_budget": self.budget.describe()}

    def prometheus(self) -> bytes:
        """Every model's series, labelled `model`."""
        return merge_prometheus({m.name: m.engine.prometheus() for m in self.models})


def merge_prometheus(parts: dict[str, bytes]) -> bytes:
    """One Prometheus exposition from several, each sample labelled with its model (families
    of the same name merged, so each is written once)."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.metrics_core import Metric
    from prometheus_client.parser import text_string_to_metric_families
    from prometheus_client.samples import Sample

    families: dict[str, Metric] = {}
    for model, text in parts.items():
        for fam in text_string_to_metric_families(text.decode("utf-8")):
            merged = families.get(fam.name)
            if merged is None:
                merged = families[fam.name] = Metric(
                    fam.name, fam.documentation, fam.type, fam.unit
                )
            for s in fam.samples:
                labels = {**s.labels, "model": model}
                merged.samples.append(Sample(s.name, labels, s.value, s.timestamp, s.exemplar))

    class _Merged:
        def collect(self) -> list[Metric]:
            return list(families.values())

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged())
    out: bytes = generate_latest(registry)
    return out


class ModelRouter:
    """ASGI: POST calls go to the app of the model their body names (see the module's
    docstring); everything else to `front` (lifespan, `/health`, `/metrics`, `/stats`,
    `/v1/models`)."""

    def __init__(self, front: ASGIApp, models: Sequence[ServedModel]) -> None:
        self.front = front
        self.models = list(models)
        self.names = ", ".join(repr(m.name) for m in self.models)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.front(scope, receive, send)
            return
        body, messages = await _read_body(receive)
        try:
            model = self._pick(scope["path"], _model_field(body))
        except (BadInput, ModelNotFound) as err:
            await error_response(err)(scope, receive, send)
            return
        if model is None:
            await self.front(scope, _replay(messages, receive), send)
            return
        await model.app(scope, _replay(messages, receive), send)

    def _pick(self, path: str, requested: str | None) -> ServedModel | None:
        if requested is not None:
            for m in self.models:
                if m.answers_to(requested):
                    return m
            raise ModelNotFound(f"the requested model is not served here; served: {self.names}")
        if path in _EVERY_MODEL:
            doers = self.models
        else:
            tasks = [t for t, paths in TASK_ROUTES.items() if path in paths]
            if not tasks:
                return None  # not a model route: the front app answers (404)
            doers = [m for m in self.models if set(tasks) & set(m.tasks)]
            if not doers:
                what = "; ".join(f"{m.name!r} serves {tasks_phrase(m.tasks)}" for m in self.models)
                raise BadInput(f"no model here serves {path}: {what}", code="wrong_task")
        if len(doers) > 1:
            names = ", ".join(repr(m.name) for m in doers)
            raise BadInput(
                f"several models serve {path} ({names}): name one in the body's model field",
                code="model_required",
            )
        return doers[0]


async def _read_body(receive: Receive) -> tuple[bytes, list[Message]]:
    """The whole request body (the guard in front has bounded its size) and its messages."""
    messages: list[Message] = []
    chunks: list[bytes] = []
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(chunks), messages


def _model_field(body: bytes) -> str | None:
    """The body's `model` if it is a JSON object naming one (anything else: None, and the
    chosen app's validation answers)."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    model = data.get("model") if isinstance(data, dict) else None
    return model if isinstance(model, str) else None


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """`receive` that first gives back the messages already read, then the client's own (so a
    route still sees the disconnect)."""
    pending = list(messages)

    async def replay() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replay


def build_router(
    models: Sequence[ServedModel], settings: Settings, budget: ComputeBudget
) -> tuple[ASGIApp, ServiceGroup]:
    """The several-model app (guard, error shape and lifespan from `new_app`) and the group
    the HTTP shell drains. Every engine takes turns on `budget`."""
    group = ServiceGroup(models, budget)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await group.start()
        freeze_heap()
        yield
        await group.stop(timeout=settings.server.drain_timeout_s)

    front = new_app(settings, lifespan)

    @front.get("/health")
    async def health() -> JSONResponse:
        """200 while every model accepts work; 503 naming the models that do not."""
        if group.ready:
            return JSONResponse({"status": "ok", "models": [m.name for m in models]})
        body: dict[str, Any] = {"status": group.state.value}
        body["models"] = {m.name: m.engine.state.value for m in models}
        if group.failure is not None:
            body["reason"] = group.failure
        return JSONResponse(body, status_code=503)

    @front.get("/metrics")
    async def metrics() -> Response:
        """Prometheus exposition, every series labelled by model."""
        return Response(group.prometheus(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @front.get("/stats")
    async def stats() -> JSONResponse:
        """The first model's summary, every model's under `models`, the CPU budget."""
        return JSONResponse(group.stats())

    @front.get("/v1/models")
    async def list_models() -> JSONResponse:
        """Every served model, OpenAI style, with its task."""
        data = [
            {"id": m.name, "object": "model", "owned_by": "lenbatch", "created": 0}
            | {"task": m.tasks[0]}
            | m.card
            for m in models
        ]
        return JSONResponse({"object": "list", "data": data})

    return guarded(ModelRouter(front, models), settings), group
