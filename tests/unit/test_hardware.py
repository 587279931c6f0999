"""Precision resolution and processor keys (lenbatch.runners.hardware)."""

from __future__ import annotations

import pytest
import torch

from lenbatch.core.costkey import ProcessorKey
from lenbatch.runners import hardware
from tests.unit import cpuinfo_samples


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


@pytest.mark.parametrize(
    ("sample", "vendor", "family", "model", "isa"),
    [
        (cpuinfo_samples.ZEN1, "AuthenticAMD", 23, 1, ("avx2",)),
        (cpuinfo_samples.ZEN3, "AuthenticAMD", 25, 1, ("avx2",)),
        (
            cpuinfo_samples.ZEN4,
            "AuthenticAMD",
            25,
            17,
            ("avx2", "avx512_bf16", "avx512_vnni", "avx512f"),
        ),
        (
            cpuinfo_samples.ZEN5,
            "AuthenticAMD",
            26,
            2,
            ("avx2", "avx512_bf16", "avx512_vnni", "avx512f", "avx_vnni"),
        ),
        (
            cpuinfo_samples.SAPPHIRE_RAPIDS,
            "GenuineIntel",
            6,
            143,
            (
                "amx_bf16",
                "amx_int8",
                "avx2",
                "avx512_bf16",
                "avx512_vnni",
                "avx512f",
                "avx_vnni",
            ),
        ),
        (
            cpuinfo_samples.GRAVITON3,
            "arm-implementer-0x41",
            8,
            0xD40,
            ("asimddp", "bf16", "i8mm", "sve"),
        ),
    ],
)
def test_processor_key_reads_vendor_family_model_and_kernel_flags(
    sample: str, vendor: str, family: int, model: int, isa: tuple[str, ...]
) -> None:
    """Each processor's key holds its vendor, family, model number and the kernel ISA flags
    it has (and none of the others), and its string form reads back to the same key."""
    key = hardware.processor_from_cpuinfo(sample, threads=4)
    assert (key.vendor, key.family, key.model, key.isa, key.threads) == (
        vendor,
        family,
        model,
        isa,
        4,
    )
    assert ProcessorKey.parse(str(key)) == key


def test_zen3_and_zen4_share_a_family_but_not_a_key() -> None:
    """The two CPUs the old key confused: same family, different model number and AVX-512."""
    zen3 = hardware.processor_from_cpuinfo(cpuinfo_samples.ZEN3, threads=2)
    zen4 = hardware.processor_from_cpuinfo(cpuinfo_samples.ZEN4, threads=2)
    assert zen3.family == zen4.family == 25
    assert str(zen3) != str(zen4)
    diffs = "; ".join(zen3.differences(zen4))
    assert "model number 1 vs 17" in diffs and "avx512f" in diffs


def test_a_cpuinfo_without_model_number_gives_a_key_that_matches_nothing() -> None:
    """Where the OS names no model number the key says `?` and differs even from itself."""
    key = hardware.processor_from_cpuinfo(cpuinfo_samples.NO_MODEL, threads=1)
    assert key.model is None and "family ? model ?" in str(key)
    assert ProcessorKey.parse(str(key)) == key
    assert key.differences(key)


def test_this_machines_key_is_its_cpuinfo() -> None:
    """`processor_key()` is the string form of `this_processor()`, which reads /proc/cpuinfo."""
    key = hardware.this_processor(threads=3)
    assert hardware.processor_key(threads=3) == str(key)
    assert key.device == "cpu" and key.threads == 3
    assert set(key.isa) <= set(hardware.KERNEL_FLAGS)


def test_quantization_is_refused_by_a_runner_without_it() -> None:
    """A runner that does not implement a quantization refuses it, naming both; a runner
    class declares what it implements in `quantizations` (default: none only)."""

    class Plain:
        pass

    class Int8:
        quantizations = ("none", "int8")

    assert hardware.runner_quantizations(Plain) == ("none",)
    assert hardware.check_quantization("none", "Plain") == "none"
    # auto is none for a runner that does not resolve it itself (it lists no `auto`)
    assert hardware.check_quantization("auto", "Plain") == "none"
    assert hardware.check_quantization("auto", "Int8", hardware.runner_quantizations(Int8)) == (
        "none"
    )
    with pytest.raises(ValueError, match="Plain does not support quantization int8"):
        hardware.check_quantization("int8", "Plain", hardware.runner_quantizations(Plain))
    assert hardware.check_quantization("int8", "Int8", hardware.runner_quantizations(Int8))
    with pytest.raises(ValueError, match="expected one of"):
        hardware.check_quantization("fp8", "Int8", hardware.runner_quantizations(Int8))
