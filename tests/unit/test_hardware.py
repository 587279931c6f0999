"""Precision resolution and processor keys (lenbatch.runners.hardware)."""

from __future__ import annotations

import pytest
import torch

from lenbatch.runners import hardware


@pytest.fixture
def flags(monkeypatch: pytest.MonkeyPatch):
    def set_flags(*names: str) -> None:
        monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset(names))

    return set_flags


def test_auto_picks_bf16_only_with_native_support(flags) -> None:
    flags("avx2", "avx512f", "amx_bf16")
    p = hardware.resolve_precision("auto")
    assert p.dtype is torch.bfloat16 and "AMX" in p.reason
    flags("avx512f", "avx512_bf16")
    assert hardware.resolve_precision("auto").dtype is torch.bfloat16
    flags("avx2", "avx512f")
    p = hardware.resolve_precision("auto")
    assert p.dtype is torch.float32 and "neither" in p.reason


def test_explicit_choices(flags) -> None:
    flags("avx2")
    assert hardware.resolve_precision("float32").dtype is torch.float32
    slow = hardware.resolve_precision("bfloat16")
    assert slow.dtype is torch.bfloat16 and "slow" in slow.reason
    with pytest.raises(ValueError, match="float16 is not supported on CPU"):
        hardware.resolve_precision("float16")
    with pytest.raises(ValueError, match="expected one of"):
        hardware.resolve_precision("int4")


def test_processor_key_names_this_cpu() -> None:
    key = hardware.processor_key()
    assert key.startswith("cpu:") and hardware.cpu_model() in key
    assert key.endswith(f"x{torch.get_num_threads()}")
