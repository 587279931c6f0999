"""The Ray Serve peer: the same model behind a Ray Serve deployment with `@serve.batch`.

This is how Ray Serve's docs batch a model: requests join one FIFO queue inside the replica and
are flushed at `max_batch_size` or after `batch_wait_timeout_s`, padded to the batch's longest
input (lenbatch's `fifo` strategy). To give it a fair chance on a CPU:

- `max_ongoing_requests` is raised from Ray's default of 5 (which caps every batch at 5) to
  `--max-ongoing` (default 1024), so batches can fill to `--max-batch`;
- the replica gets every CPU (`num_cpus`, torch threads) and runs the model in a worker thread
  so the replica keeps accepting requests while a batch runs;
- batch size and wait match lenbatch's defaults (32 and 10 ms).

Ray runs locally on 127.0.0.1 with usage stats off, no dashboard, and is shut down on SIGTERM
or SIGINT (no raylet left behind). Needs `pip install 'lenbatch[ray]'`.

    python -m lenbatch.replay.peers.ray_serve --port 8102 [--model minilm]
"""

# No `from __future__ import annotations` here: Ray pickles the deployment class into its
# replica, where FastAPI must see the handlers' annotations as real types, not strings.
import argparse
import asyncio
import os
import signal
import threading
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Start Ray and the deployment, serve until SIGTERM/SIGINT, then shut Ray down."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="minilm")
    p.add_argument("--port", type=int, default=8102)
    p.add_argument("--max-batch", type=int, default=32, help="@serve.batch max_batch_size")
    p.add_argument("--max-wait-ms", type=float, default=10.0, help="batch_wait_timeout_s in ms")
    p.add_argument(
        "--max-ongoing",
        type=int,
        default=1024,
        help="max_ongoing_requests of the replica (Ray's default 5 caps batches at 5)",
    )
    p.add_argument("--cpus", type=int, default=os.cpu_count() or 1, help="CPUs for the replica")
    args = p.parse_args(argv)

    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import ray
    from ray import serve

    from lenbatch.replay.peers.common import PlainEncoder, response, texts_of

    ray.init(
        num_cpus=args.cpus,
        include_dashboard=False,
        log_to_driver=False,
        _node_ip_address="127.0.0.1",
    )
    # After ray.init, which installs its own handlers: ours let `finally` shut Ray down.
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        app = FastAPI()

        class Embedder:
            def __init__(self, model: str, threads: int, max_batch: int, wait_s: float) -> None:
                self.encoder = PlainEncoder(model, threads)
                self.embed_batch.set_max_batch_size(max_batch)
                self.embed_batch.set_batch_wait_timeout_s(wait_s)

            @app.get("/health")
            def health(self) -> dict[str, str]:
                return {"status": "ok"}

            @app.post("/v1/embeddings")
            async def embeddings(self, request: Request) -> Any:
                try:
                    body = await request.json()
                    inputs = texts_of(body.get("input"))
                except (ValueError, AttributeError) as exc:
                    return JSONResponse({"error": {"message": str(exc)}}, status_code=400)
                vectors = await asyncio.gather(*(self.embed_batch(x) for x in inputs))
                return response(list(vectors), self.encoder.name, 0)

            @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.01)
            async def embed_batch(self, items: list[Any]) -> list[list[float]]:
                # The forward pass runs in a thread so new requests keep joining the queue.
                return await asyncio.to_thread(self.encoder.embed, items)

        deployment = serve.deployment(
            num_replicas=1,
            max_ongoing_requests=args.max_ongoing,
            ray_actor_options={"num_cpus": args.cpus},
        )(serve.ingress(app)(Embedder))
        serve.run(
            deployment.bind(args.model, args.cpus, args.max_batch, args.max_wait_ms / 1000),
            route_prefix="/",
        )
        print(
            f"ray serve peer ready on 127.0.0.1:{args.port} "
            f"(max_batch={args.max_batch}, max_wait_ms={args.max_wait_ms:g}, "
            f"max_ongoing_requests={args.max_ongoing})",
            flush=True,
        )
        while not stop.wait(0.5):
            pass
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
