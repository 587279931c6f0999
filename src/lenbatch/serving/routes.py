"""Which routes each task serves, and the 400 a route answers on a model that does another task.

A model serves one task (`config.ModelTask`): an embedder `/v1/embeddings`; a cross-encoder
(scorer) `/v1/rerank`, `/rerank`, `/v1/score` and `/classify`; a classifier `/classify`; a
causal LM the completions routes. Asking a model for a task it does not do gets a 400 that says
which tasks and routes it serves, instead of a bare 404.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable

from fastapi import FastAPI
from fastapi.routing import APIRoute

from lenbatch.core.errors import BadInput

__all__ = ["TASK_ROUTES", "add_task_refusals", "tasks_phrase"]

TASK_ROUTES: dict[str, tuple[str, ...]] = {
    "embed": ("/v1/embeddings",),
    "score": ("/v1/rerank", "/v2/rerank", "/rerank", "/v1/score", "/score"),
    "classify": ("/classify",),
    "generate": ("/v1/completions", "/v1/chat/completions"),
}


def tasks_phrase(tasks: Iterable[str]) -> str:
    """`embed (/v1/embeddings)`-style words for the tasks a model serves."""
    return ", ".join(f"{t} ({', '.join(TASK_ROUTES[t])})" for t in tasks)


def add_task_refusals(app: FastAPI, served: str, tasks: Iterable[str]) -> None:
    """For every task route `app` does not have, a POST answering 400 `wrong_task` that names
    what model `served` does (call after the app's own routes are added)."""
    tasks = list(tasks)
    have = {r.path for r in app.routes if isinstance(r, APIRoute)}
    message = f"model {served!r} serves {tasks_phrase(tasks)}"
    for task, paths in TASK_ROUTES.items():
        for path in paths:
            if path not in have:
                app.add_api_route(
                    path,
                    _refusal(f"{message}; {path} needs a model with task {task}"),
                    methods=["POST"],
                    include_in_schema=False,
                    name=f"not_{path.strip('/').replace('/', '_')}",
                )


def _refusal(message: str) -> Callable[[], Awaitable[None]]:
    async def refuse() -> None:
        raise BadInput(message, code="wrong_task")

    return refuse
