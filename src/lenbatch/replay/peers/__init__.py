"""Peers: other ways to serve the same model, replayed in the same benchmark run as lenbatch.

In lenbatch's own venv (`PEERS`), both serving `POST /v1/embeddings` and `GET /health` from the
same model folder; run one with `python -m lenbatch.replay.peers.naive --port P`:

- `naive`: the simplest server a user would write (FastAPI, one text per model call).
- `ray`: Ray Serve with `@serve.batch` (needs the `lenbatch[ray]` extra).

Other projects' servers, each in its own venv under `.venv-peers/` made on first use
(`EXTERNAL_PEERS`, see `external`):

- `infinity`: Infinity's torch engine (embeddings).
- `vllm`, `vllm-allcores`: vLLM's CPU build, default thread binding or every core
  (embeddings and completions).
- `llamacpp`: llama-cpp-python's server on the GGUF file (completions).

All bind to 127.0.0.1 only.
"""

from __future__ import annotations

from lenbatch.replay.peers.registry import EXTERNAL_PEERS, PEERS

__all__ = ["EXTERNAL_PEERS", "PEERS"]
