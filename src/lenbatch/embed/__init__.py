"""Embeddings: the `Engine` (admit, schedule, collate, run, answer through the ledger),
the OpenAI embeddings protocol and the routes that serve it."""

from __future__ import annotations

from lenbatch.embed.api import create_app, serve
from lenbatch.embed.engine import Engine
from lenbatch.embed.protocol import EmbeddingRequest

__all__ = ["EmbeddingRequest", "Engine", "create_app", "serve"]
