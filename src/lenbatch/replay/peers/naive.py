"""The naive peer: the simplest embedding server a user would write.

FastAPI, the model loaded once, and one model call per text: no queue, no batching, no
padding at all. The endpoint is a plain `def`, so FastAPI runs it on its thread pool; a lock
keeps one model call at a time, because on a CPU torch already spreads one call over every
core and concurrent calls would only fight over them. On a small CPU this is a strong
baseline: batch 1 never pays for padding.

    python -m lenbatch.replay.peers.naive --port 8101 [--model minilm]
"""

from __future__ import annotations

import argparse
import threading
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from lenbatch.replay.peers.common import PlainEncoder, response, texts_of

__all__ = ["create_app", "main"]


def create_app(encoder: PlainEncoder) -> FastAPI:
    """The app: `POST /v1/embeddings` and `GET /health`."""
    app = FastAPI(title="naive embeddings server")
    lock = threading.Lock()

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/v1/embeddings")
    def embeddings(body: dict[str, Any]) -> Any:
        try:
            inputs = texts_of(body.get("input"))
        except ValueError as exc:
            return JSONResponse({"error": {"message": str(exc)}}, status_code=400)
        vectors = []
        tokens = 0
        for x in inputs:  # one text per model call
            with lock:
                vectors.extend(encoder.embed([x] if isinstance(x, str) else [list(x)]))
            tokens += len(x) if isinstance(x, list) else 0
        return response(vectors, encoder.name, tokens)

    return app


def main(argv: list[str] | None = None) -> int:
    """Serve on 127.0.0.1 until stopped."""
    import uvicorn

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="minilm")
    p.add_argument("--port", type=int, default=8101)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = p.parse_args(argv)
    app = create_app(PlainEncoder(args.model, args.threads))
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
