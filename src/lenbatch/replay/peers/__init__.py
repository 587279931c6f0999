"""Peers: other ways to serve the same model, replayed in the same benchmark run as lenbatch.

- `naive`: the simplest server a user would write (FastAPI, one text per model call).
- `ray`: Ray Serve with `@serve.batch` (needs the `lenbatch[ray]` extra).

Both serve `POST /v1/embeddings` (OpenAI shape) and `GET /health`, load the same model
folder, and bind to 127.0.0.1 only. Run one with `python -m lenbatch.replay.peers.naive --port P`.
"""

from __future__ import annotations

from lenbatch.replay.peers.registry import PEERS

__all__ = ["PEERS"]
