"""A stand-in for another project's server, run as a script by the fake-peer bench test.

Serves `POST /v1/embeddings` and a health check at `/ready` (not `/health`, so the test sees
the bench use the peer's own health path). It answers 200 only when the environment carries
`FAKE_PEER_TOKEN=ok` (what the peer's launch asked for) and `HF_HUB_OFFLINE=1` (what every peer
gets), so a bench that drops the peer's environment fails visibly.

    python tests/unit/fake_peer_server.py --port P
"""

from __future__ import annotations

import argparse
import os

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route


async def embeddings(request: Request) -> Response:
    await request.body()
    if os.environ.get("FAKE_PEER_TOKEN") != "ok" or os.environ.get("HF_HUB_OFFLINE") != "1":
        return JSONResponse({"error": {"message": "environment not passed"}}, status_code=500)
    return JSONResponse({"object": "list", "data": [{"index": 0, "embedding": [0.0]}]})


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args()
    app = Starlette(
        routes=[
            Route("/v1/embeddings", embeddings, methods=["POST"]),
            Route("/ready", lambda r: JSONResponse({"ok": True}), methods=["GET"]),
        ]
    )
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="error")


if __name__ == "__main__":
    main()
