"""Infinity (michaelfeil/infinity) as a peer: `--peer infinity`, embeddings only.

Its torch engine, as a user would run it from the docs, with what it takes to serve the same
model on the same route here: OpenAI's `/v1/embeddings` only with `--url-prefix /v1`, mean
pooling named explicitly (it does not read sentence-transformers' pooling file), no
`torch.compile` (`--no-compile`: compiling costs minutes at start for no gain on this CPU),
the bench's batch cap as its `--batch-size`, and no access log (as lenbatch runs with
`--log-level warning`). `infinity` runs float32 (its default), `infinity-bf16` bfloat16: the
fair match for lenbatch's `--dtype auto` on a CPU with native bf16, as `vllm-bf16` is. Usage
statistics are off through `OFFLINE_ENV` (`DO_NOT_TRACK`, `INFINITY_ANONYMOUS_USAGE_STATS=0`).

Infinity's `usage.prompt_tokens` counts characters unless `--lengths-via-tokenize`; the bench
counts real tokens from its own bodies, so that does not change any figure.
"""

from __future__ import annotations

from lenbatch.replay.peers.external import PeerContext, PeerLaunch, VenvSpec
from lenbatch.runners import resolve_model

__all__ = ["INFINITY", "INFINITY_BF16", "InfinityPeer"]


class InfinityPeer:
    """`infinity_emb v2` with the torch engine on 127.0.0.1, weights in `dtype`."""

    endpoints = ("embeddings",)
    venv = VenvSpec(
        name="infinity",
        requirements=("torch==2.13.0", "infinity-emb[server,torch]==0.0.78"),
        report_versions=("infinity-emb", "torch", "transformers", "sentence-transformers"),
    )

    def __init__(self, name: str, dtype: str = "float32") -> None:
        self.name = name
        self.dtype = dtype

    def launch(self, ctx: PeerContext) -> PeerLaunch:
        """The `infinity_emb v2` command for the bench's model and batch cap."""
        folder, name = resolve_model(ctx.model)
        argv = (
            str(ctx.venv / "bin" / "infinity_emb"), "v2",
            "--model-id", str(folder), "--served-model-name", name,
            "--host", "127.0.0.1", "--port", "{port}", "--url-prefix", "/v1",
            "--engine", "torch", "--device", "cpu", "--dtype", self.dtype,
            "--pooling-method", "mean", "--no-compile", "--no-bettertransformer",
            "--batch-size", str(ctx.max_batch), "--log-level", "warning",
        )  # fmt: skip
        return PeerLaunch(
            argv=argv,
            health_path="/health",
            notes=(
                f"torch engine, {self.dtype}, mean pooling, --no-compile, "
                f"--batch-size {ctx.max_batch} (the bench's batch cap)",
            ),
        )


INFINITY = InfinityPeer("infinity")
INFINITY_BF16 = InfinityPeer("infinity-bf16", dtype="bfloat16")
