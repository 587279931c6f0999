"""The process's one torch thread (`serving.torchthread`): where models load and generate."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from lenbatch.serving.torchthread import on_torch_thread, torch_executor


def test_work_runs_on_one_named_thread_and_nested_calls_do_not_deadlock() -> None:
    """Every call runs on the same thread (never the caller's); a call made from that thread
    runs directly instead of queueing behind itself; errors reach the caller."""
    main = threading.get_ident()
    first = on_torch_thread(threading.get_ident)
    assert first != main
    assert on_torch_thread(threading.get_ident) == first
    assert on_torch_thread(lambda: threading.current_thread().name).startswith("lenbatch-torch")
    nested = on_torch_thread(on_torch_thread, threading.get_ident)  # would hang if queued
    assert nested == first
    assert torch_executor() is torch_executor()

    def fail() -> None:
        raise ValueError("bad shape")

    with pytest.raises(ValueError, match="bad shape"):
        on_torch_thread(fail)


@pytest.mark.slow
async def test_generation_runs_on_the_torch_thread_and_leaves_it_running(
    llama_runner: Any,
) -> None:
    """A generation engine's units run on the torch thread (where `serve` loads the model), and
    stopping the engine leaves the shared thread usable for the next one."""
    from lenbatch.config import BatchingConfig, GenerationConfig
    from lenbatch.generate import GenerationEngine, SamplingParams

    torch_thread = on_torch_thread(threading.get_ident)
    seen: list[int] = []
    for _ in range(2):  # a second engine after the first stopped
        engine = GenerationEngine(
            llama_runner, BatchingConfig(max_wait_ms=1), None, GenerationConfig()
        )
        real_decode = engine.decoder.decode

        def spy(real: Any = real_decode) -> Any:
            seen.append(threading.get_ident())
            return real()

        engine.decoder.decode = spy  # type: ignore[method-assign]
        await engine.start()
        try:
            prompt = llama_runner.tokenize(["The cat sat"])[0]
            gen = engine.submit(
                prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
            )
            tokens = [t async for d in engine.stream(gen) for t in d.token_ids]
        finally:
            await engine.stop()
        assert len(tokens) == 4
    assert seen and set(seen) == {torch_thread}
    assert on_torch_thread(lambda: 1) == 1
