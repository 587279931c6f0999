"""The fault-injecting runner fails exactly when configured to, and passes through otherwise."""

from __future__ import annotations

import numpy as np
import pytest

from lenbatch.core.collate import collate
from lenbatch.core.errors import RunnerCrashed, is_out_of_memory
from lenbatch.runners import load_runner
from lenbatch.runners.fake import FakeRunner
from lenbatch.runners.faulty import FaultyRunner, PoisonInput, runner_from_spec


def _batch(*rows: list[int]):  # type: ignore[no-untyped-def]
    return collate(list(rows), pad_id=0)


def test_passes_through_to_the_wrapped_runner() -> None:
    """Without a fault, the output is the wrapped runner's, row for row."""
    fake = FakeRunner()
    out = FaultyRunner(fake, poison_token=7).embed(_batch([101, 5, 102], [101, 6, 6, 102]))
    np.testing.assert_array_equal(out[1], fake.vector([101, 6, 6, 102]))


def test_poison_token_and_length_raise_without_quoting_the_input() -> None:
    """A row with the poison token id, or of the poison length, makes the batch raise."""
    faulty = FaultyRunner(FakeRunner(), poison_token=7, poison_length=5)
    with pytest.raises(PoisonInput) as info:
        faulty.embed(_batch([101, 5, 102], [101, 7, 102]))
    assert "7" not in str(info.value).replace("of 2", "")
    with pytest.raises(PoisonInput):
        faulty.embed(_batch([101, 1, 2, 3, 102]))
    faulty.embed(_batch([101, 0, 102]))  # the pad id 0 inside a real row is not token 7
    assert faulty.faults == {"poison": 2}


@pytest.mark.parametrize("kind", ["memory", "cuda"])
def test_oom_over_padded_tokens(kind: str) -> None:
    """A batch over `oom_tokens` padded tokens raises an error the engine sees as OOM."""
    faulty = FaultyRunner(FakeRunner(), oom_tokens=8, oom_kind=kind)  # type: ignore[arg-type]
    faulty.embed(_batch([1, 2, 3, 4], [1, 2]))  # 2 x 4 = 8: fits
    with pytest.raises(Exception) as info:
        faulty.embed(_batch([1, 2, 3], [1, 2, 3, 4, 5]))  # 2 x 5 = 10
    assert is_out_of_memory(info.value)
    if kind == "cuda":
        import torch

        assert isinstance(info.value, torch.cuda.OutOfMemoryError)


def test_crash_after_k_batches_fatal_and_sticky() -> None:
    """After `crash_after` calls every call fails: RunnerCrashed, or a plain RuntimeError."""
    fatal = FaultyRunner(FakeRunner(), crash_after=2)
    fatal.embed(_batch([1]))
    fatal.embed(_batch([1]))
    for _ in range(2):
        with pytest.raises(RunnerCrashed):
            fatal.embed(_batch([1]))
    sticky = FaultyRunner(FakeRunner(), crash_after=0, crash_kind="sticky")
    with pytest.raises(RuntimeError) as info:
        sticky.embed(_batch([1]))
    assert not isinstance(info.value, RunnerCrashed) and not is_out_of_memory(info.value)


def test_is_out_of_memory_does_not_match_other_errors() -> None:
    """Only memory errors count as out-of-memory."""
    assert is_out_of_memory(MemoryError())
    assert is_out_of_memory(RuntimeError("CUDA out of memory. Tried to allocate 2 GiB"))
    assert not is_out_of_memory(RuntimeError("CUDA error: device-side assert triggered"))
    assert not is_out_of_memory(ValueError("out of memory"))


def test_spec_builds_fake_and_faulty_runners() -> None:
    """`fake?...` specs build a costed fake, wrapped in faults only when asked."""
    plain = load_runner("fake?batch_ms=20&token_us=1000&max_length=64")
    assert isinstance(plain, FakeRunner) and plain.info.max_length == 64
    assert plain.cost is not None and plain.cost(2, 10) == pytest.approx(0.02 + 0.02)
    faulty = runner_from_spec("fake?poison_token=9&oom_tokens=100&oom_kind=cuda&crash_after=3")
    assert isinstance(faulty, FaultyRunner)
    assert (faulty.poison_token, faulty.oom_tokens, faulty.crash_after) == (9, 100, 3)
    assert faulty.oom_kind == "cuda"


@pytest.mark.parametrize(
    "spec", ["fake?bogus=1", "fake?batch_ms=fast", "fake?oom_kind=disk", "fake?poison_token"]
)
def test_bad_spec_is_a_clear_value_error(spec: str) -> None:
    """Unknown keys or bad values name the problem."""
    with pytest.raises(ValueError, match=r"fake runner|oom_kind"):
        runner_from_spec(spec)
