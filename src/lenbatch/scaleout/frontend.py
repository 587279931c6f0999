"""The ingress's embeddings service: tokenize once, route each input by its length, gather.

`create_app` (the embeddings API of `lenbatch serve`) is served unchanged over a `Frontend`
instead of a local engine, so the Ray app speaks exactly the same protocol (validation, error
shape, API key, base64, `/health`, `/metrics`, `/stats`, `/v1/models`). What
`embed_with_usage` does here:

    texts ─► tokenize (once, in a worker thread; the text is dropped) ─► owner group per input
          ─► one handle call per group, `group=` for the request router ─► replica engines
          ─► vectors back in input order

The inputs are read exactly as the single server's engine reads them (`embed.inputs`), with
the model's tokenizer alone: the ingress never loads the weights. A call whose replica dies is
sent again (`scaleout.calls`); lifecycle, ledger and figures are `scaleout.ingress`'s.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any, Unpack

import numpy as np

from lenbatch.embed.inputs import InputReader, Tokenize
from lenbatch.runners.base import ModelInfo
from lenbatch.scaleout.board import RoutingBoard
from lenbatch.scaleout.calls import RelayedError
from lenbatch.scaleout.ingress import IngressSettings, RayFrontend
from lenbatch.serving.messages import CallOptions, Embedded, Inputs, Vector

__all__ = ["Frontend"]


class Frontend(RayFrontend[Embedded]):
    """The `EmbeddingService` of the ingress: routes inputs to the engine replicas by length."""

    def __init__(
        self,
        handle: Any,
        board: RoutingBoard,
        tokenize: Tokenize,
        info: ModelInfo,
        boundaries: Iterable[int],
        *,
        default_truncate: bool = False,
        **settings: Unpack[IngressSettings],
    ) -> None:
        """`tokenize` is the model's tokenizer's (`TextTokenizer.tokenize`)."""
        super().__init__(handle, board, info, boundaries, **settings)
        self.inputs = InputReader(
            tokenize, info.max_length, info.vocab_size, default_truncate=default_truncate
        )

    def _release(self) -> None:
        self.inputs.close()

    async def embed_with_usage(self, inputs: Inputs, **options: Unpack[CallOptions]) -> Embedded:
        """Embed each input on the replica group owning its length; vectors in input order."""
        self.check_running()
        arrival = self.clock.now()
        truncate = self.inputs.truncating(options.get("truncate"))
        ids = await self.inputs.read(inputs, truncate)
        self.check_running()  # drained while this call was tokenizing
        lengths = [len(x) for x in ids]
        by_group: dict[int, list[int]] = {}
        for i, owner in enumerate(self.place(lengths)):
            by_group.setdefault(owner, []).append(i)
        timeout = options.get("timeout")
        if timeout is None:
            timeout = self.request_timeout
        priority = options.get("priority", 0)

        async def gather() -> Embedded:
            parts = await asyncio.gather(
                *(
                    self._embed_group(g, [ids[i] for i in idx], truncate, timeout, priority)
                    for g, idx in by_group.items()
                )
            )
            got: dict[int, Vector] = {}
            for idx, (vectors, _) in zip(by_group.values(), parts, strict=True):
                got.update(zip(idx, vectors, strict=True))
            return Embedded([got[i] for i in range(len(ids))], sum(n for _, n in parts))

        return await self._answered(sum(lengths), arrival, gather())

    async def _embed_group(
        self, owner: int, ids: list[list[int]], truncate: bool, timeout: float | None, priority: int
    ) -> tuple[list[Vector], int]:
        """The vectors of one group's inputs, and the tokens they took, from a replica."""
        cost = self.cost_of(len(x) for x in ids)
        group = self.calls.group(owner)

        async def attempt() -> tuple[list[Vector], int]:
            out = await self.handle.embed.remote(
                ids, truncate, timeout, priority, group=group, cost=cost
            )
            if "error" in out:
                raise RelayedError(out["error"])
            return list(np.asarray(out["vectors"], dtype=np.float32)), int(out["tokens"])

        return await self.calls.send(attempt)
