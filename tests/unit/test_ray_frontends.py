"""The Ray front-ends without Ray: fake deployment handles stand in for the engine replicas.

They are services the routes accept as they are (no cast), every admitted call is a ledger
ticket (answered once, drained, 503 at a drain timeout, cancelled on the replica when its
caller leaves), a call whose replica dies goes to another one, and the ingress builds no model:
the tokenizer alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import warnings
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lenbatch.config import GenerationConfig, Settings
from lenbatch.core.errors import LenbatchError, Unavailable
from lenbatch.generate.prompts import Prompts
from lenbatch.runners.base import ModelInfo
from lenbatch.runners.fake import FakeRunner
from lenbatch.scaleout.board import RoutingBoard
from lenbatch.scaleout.frontend import Frontend
from lenbatch.scaleout.lmfrontend import LMFrontend
from lenbatch.serving.messages import SamplingParams
from lenbatch.serving.services import EmbeddingService, GenerationService

INFO = ModelInfo("fake", 64, 0, "right", False, FakeRunner.VOCAB, 8)
LM_INFO = dataclasses.replace(INFO, kind="generate", dim=0)


class Remote:
    """A handle method: `.remote(...)` calls `fn`."""

    def __init__(self, fn: Any) -> None:
        self.remote = fn


class FakeStream:
    """A streaming handle call: the items of `items`, then (if `cut`) the replica dies."""

    def __init__(self, items: list[dict[str, Any]], gate: asyncio.Event | None, cut: bool) -> None:
        self.items, self.gate, self.cut = items, gate, cut
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True

    async def __aiter__(self) -> AsyncIterator[dict[str, Any]]:
        from ray.exceptions import ActorDiedError

        for i, item in enumerate(self.items):
            if i == 2 and self.gate is not None:  # after the first delta: held mid-stream
                await self.gate.wait()
            yield item
        if self.cut:
            raise ActorDiedError()


class FakeEngines:
    """The engine deployment's handle: embeddings from a `FakeRunner`, streams of fixed
    deltas; calls can be held on `gate`, and the first `deaths` calls meet a dead replica."""

    def __init__(self) -> None:
        self.runner = FakeRunner()
        self.gate: asyncio.Event | None = None
        self.deaths = 0
        self.groups: list[int | None] = []
        self.streams: list[FakeStream] = []
        self.embed = Remote(self._embed)
        self.generate = Remote(self._generate)

    def options(self, **_: Any) -> FakeEngines:
        return self

    async def _embed(self, ids: list[list[int]], *args: Any, group: int | None, cost: float) -> Any:
        from ray.exceptions import ActorDiedError

        self.groups.append(group)
        if self.gate is not None:
            await self.gate.wait()
        if self.deaths:
            self.deaths -= 1
            raise ActorDiedError()
        return {"vectors": [self.runner.vector(x) for x in ids], "tokens": sum(map(len, ids))}

    def _generate(self, prompt: list[int], *args: Any, group: int | None, cost: float) -> Any:
        dies = self.deaths > 0
        self.deaths -= dies
        items: list[dict[str, Any]] = [
            {"admitted": "r1"},
            {"ids": [5], "text": "a", "finish_reason": None},
            {"ids": [6], "text": "b", "finish_reason": "stop", "timings": {"e2e": 1.0}},
        ]
        stream = FakeStream(items[:2] if dies else items, self.gate, cut=dies)
        self.streams.append(stream)
        return stream


class WordTokenizer:
    """A prompt tokenizer without a model: `FakeRunner`'s words, no chat template."""

    has_chat_template = False

    def tokenize(self, texts: list[str], truncate: bool) -> list[list[int]]:
        return FakeRunner().tokenize(texts, truncate)

    def chat_prompt(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        raise ValueError("no chat template")


def embeddings(engines: FakeEngines) -> Frontend:
    board = RoutingBoard(2)
    board.set_replicas(["a", "b"])
    return Frontend(engines, board, FakeRunner().tokenize, INFO, [16], refresh_s=0)


def generation(engines: FakeEngines) -> LMFrontend:
    board = RoutingBoard(2)
    board.set_replicas(["a", "b"])
    prompts = Prompts(WordTokenizer(), LM_INFO, GenerationConfig())
    return LMFrontend(engines, board, prompts, [16], refresh_s=0)


def test_the_ray_front_ends_are_the_services_the_routes_take() -> None:
    """`Frontend` is an `EmbeddingService` and `LMFrontend` a `GenerationService`."""
    assert isinstance(embeddings(FakeEngines()), EmbeddingService)
    assert isinstance(generation(FakeEngines()), GenerationService)


async def test_an_embeddings_call_is_answered_once_through_the_ledger() -> None:
    """Vectors in input order, each group's inputs on its owner; nothing left open after."""
    pytest.importorskip("ray")
    engines = FakeEngines()
    front = embeddings(engines)
    await front.start()
    texts = ["short one", " ".join(["long"] * 30)]
    done = await front.embed_with_usage(texts)
    want = FakeRunner().tokenize(texts, False)
    for v, x in zip(done.vectors, want, strict=True):
        np.testing.assert_array_equal(v, FakeRunner().vector(x))
    assert sorted(g for g in engines.groups if g is not None) == [0, 1]
    assert done.prompt_tokens == sum(map(len, want)) and front.unanswered == 0
    await front.stop()


async def test_a_call_whose_replica_dies_is_sent_again() -> None:
    """A dead replica costs a retry, not the call."""
    pytest.importorskip("ray")
    engines = FakeEngines()
    engines.deaths = 1
    front = embeddings(engines)
    await front.start()
    done = await front.embed_with_usage([[101, 2000, 102]])
    assert len(done.vectors) == 1 and front.calls.retries == 1
    await front.stop()


async def test_a_drain_timeout_answers_open_calls_503_and_a_leaver_cancels() -> None:
    """A drain waits for admitted calls, then answers what is left 503 `shutdown`; a caller
    that leaves is counted cancelled and its call stops."""
    pytest.importorskip("ray")
    engines = FakeEngines()
    engines.gate = asyncio.Event()
    front = embeddings(engines)
    await front.start()
    left = asyncio.create_task(front.embed_with_usage([[101, 2000, 102]]))
    held = asyncio.create_task(front.embed_with_usage([[101, 2001, 102]]))
    while front.unanswered < 2:
        await asyncio.sleep(0)
    left.cancel()
    await asyncio.gather(left, return_exceptions=True)
    assert front.unanswered == 1
    await front.stop(timeout=0.01)
    err = (await asyncio.gather(held, return_exceptions=True))[0]
    assert isinstance(err, Unavailable) and err.code == "shutdown"
    assert front.unanswered == 0 and not front.ready
    with pytest.raises(Unavailable):
        await front.embed_with_usage([[101, 102]])


async def test_a_stream_is_relayed_and_a_dead_replica_ends_it_explicitly() -> None:
    """Deltas come through in order with the replica's timings; a replica that dies before
    a token went out gets the prompt sent again, one that dies after ends the stream with
    `replica_failed`."""
    pytest.importorskip("ray")
    engines = FakeEngines()
    front = generation(engines)
    await front.start()
    params = SamplingParams(max_tokens=4)
    [seq] = front.submit_all([[1, 2000, 2]], params)
    got = [d async for d in front.stream(seq)]
    assert [d.text for d in got] == ["a", "b"] and got[-1].finish_reason == "stop"
    assert seq.completion_tokens == 2 and seq.timings_ms() == {"e2e": 1.0}
    engines.deaths = 1  # dies after its first delta went out: no retry
    [seq] = front.submit_all([[1, 2001, 2]], params)
    with pytest.raises(LenbatchError) as info:
        async for _ in front.stream(seq):
            pass
    assert info.value.code == "replica_failed" and front.calls.retries == 0
    assert front.unanswered == 0
    await front.stop()


async def test_a_stream_left_early_cancels_the_replica_call() -> None:
    """Leaving a stream mid-way ends its ticket cancelled and cancels the handle call."""
    pytest.importorskip("ray")
    engines = FakeEngines()
    engines.gate = asyncio.Event()
    front = generation(engines)
    await front.start()
    [seq] = front.submit_all([[1, 2000, 2]], SamplingParams(max_tokens=4))
    async with contextlib.aclosing(front.stream(seq)) as deltas:
        async for _ in deltas:
            break  # the caller leaves after the first delta
    await asyncio.sleep(0)
    assert front.unanswered == 0 and engines.streams[0].cancelled
    await front.stop()


def _models() -> int:
    """`torch.nn.Module`s alive in the process."""
    import torch

    with warnings.catch_warnings():  # some of torch's deprecated objects warn when inspected
        warnings.simplefilter("ignore")
        return sum(1 for o in gc.get_objects() if isinstance(o, torch.nn.Module))


async def _ingress(facts: dict[str, Any], settings: Settings) -> Any:
    from lenbatch.scaleout.app import Ingress

    async def info() -> dict[str, Any]:
        return facts

    engines = FakeEngines()
    engines.info = Remote(info)  # type: ignore[attr-defined]
    ingress = object.__new__(Ingress)  # Ray Serve awaits its constructor
    await ingress.__init__(engines, settings.model_dump(mode="json"), "length", 2)
    return ingress


async def test_the_embeddings_ingress_loads_the_tokenizer_alone() -> None:
    """MiniLM's ingress tokenizes as the model does, with its model facts from a replica, and
    no `torch.nn.Module` is built."""
    info = ModelInfo("all-MiniLM-L6-v2", 256, 0, "right", False, 30522, 384)
    facts = {"model": dataclasses.asdict(info), "boundaries": [16, 64], "describe": "replica"}
    before = _models()
    ingress = await _ingress(facts, Settings())
    assert _models() == before
    front = ingress.frontend
    assert isinstance(front, Frontend) and front.info == info
    assert front.inputs.token_ids(["hello world"]) == [[101, 7592, 2088, 102]]


async def test_the_llm_ingress_builds_prompts_on_the_tokenizer_alone(tiny_llama_dir: Path) -> None:
    """A causal LM's ingress answers prompts and limits from the tokenizer and a replica's
    facts, and no `torch.nn.Module` is built."""
    from lenbatch.runners.tokenizer import TextTokenizer

    info = ModelInfo("tiny", 128, 0, "left", True, 1000, kind="generate")
    facts = {"model": dataclasses.asdict(info), "boundaries": [16], "describe": "replica"}
    settings = Settings.model_validate({"model": {"name": str(tiny_llama_dir)}})
    before = _models()
    ingress = await _ingress(facts, settings)
    assert _models() == before
    front = ingress.frontend
    assert isinstance(front, LMFrontend) and isinstance(front.prompts.tokenizer, TextTokenizer)
    assert front.context_left(100) == 28
    want = TextTokenizer.load(tiny_llama_dir, 128, keep="tail").tokenize(["hi there"])
    assert await front.prompt_ids("hi there") == want
