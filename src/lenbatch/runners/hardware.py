"""What the machine under the runner is, and which float type and quantization to run a model in.

The project's machine changes between runs (an AMD EPYC one round, an Intel Xeon with AMX the
next), so nothing may assume one processor: cost models are keyed by `processor_key()` (vendor,
family, model number, the ISA flags the kernels use, threads; see `core.costkey.ProcessorKey`),
and `--dtype auto` picks bfloat16 only where the hardware runs it natively. A quantization is
served only by a runner that implements it (`check_quantization`).
"""

from __future__ import annotations

import platform
import re
from collections.abc import Collection
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from lenbatch.core.costkey import ProcessorKey

__all__ = [
    "DTYPE_NAMES",
    "KERNEL_FLAGS",
    "QUANTIZATION_NAMES",
    "Precision",
    "check_quantization",
    "cpu_flags",
    "cpu_model",
    "processor_from_cpuinfo",
    "processor_key",
    "resolve_precision",
    "runner_quantizations",
    "this_processor",
]

DTYPE_NAMES = ("float32", "bfloat16", "float16", "auto")

_TORCH_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@cache
def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


@cache
def cpu_model() -> str:
    """The CPU's model name as the OS reports it (e.g. 'AMD EPYC', 'Intel(R) Xeon(R) ...')."""
    found = re.search(r"^model name\s*:\s*(.+)$", _cpuinfo(), re.MULTILINE)
    return found.group(1).strip() if found else (platform.processor() or platform.machine())


@cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (`/proc/cpuinfo`), empty where the OS does not say."""
    found = re.search(r"^flags\s*:\s*(.+)$", _cpuinfo(), re.MULTILINE)
    return frozenset(found.group(1).split()) if found else frozenset()


# The ISA flags that change what the model's kernels cost: 256- and 512-bit vectors, bf16 and
# int8 dot products, AMX tiles (x86, cpuinfo `flags`); dot products, bf16, int8 matrix
# multiply and SVE (Arm, cpuinfo `Features`). A processor key lists those present.
KERNEL_FLAGS = (
    "avx2",
    "avx512f",
    "avx512_bf16",
    "avx512_vnni",
    "avx_vnni",
    "amx_bf16",
    "amx_int8",
    "asimddp",
    "bf16",
    "i8mm",
    "sve",
    "sve2",
)


def _fields(cpuinfo: str) -> dict[str, str]:
    """The `key : value` lines of the first processor's block of a cpuinfo text."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            if fields:
                break  # the next processor's block: all processors of one machine agree
            continue
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    return fields


def _number(text: str | None) -> int | None:
    """A decimal or `0x` hexadecimal cpuinfo number, None when absent or unreadable."""
    try:
        return None if text is None else int(text, 0)
    except ValueError:
        return None


def processor_from_cpuinfo(cpuinfo: str, threads: int | None, name: str = "") -> ProcessorKey:
    """The processor key of a `/proc/cpuinfo` text: vendor, family, model number, the
    `KERNEL_FLAGS` present and `threads`. x86 reports `vendor_id`, `cpu family`, `model`,
    `model name` and `flags`; Arm `CPU implementer`, `CPU architecture`, `CPU part` and
    `Features`. `name` stands in for a missing `model name`."""
    f = _fields(cpuinfo)
    if "vendor_id" in f or "cpu family" in f:
        vendor = f.get("vendor_id", "")
        family, model = _number(f.get("cpu family")), _number(f.get("model"))
        flags = f.get("flags", "")
    else:  # Arm: an implementer code (0x41 is Arm Ltd) and a part number
        implementer = f.get("CPU implementer")
        vendor = f"arm-implementer-{implementer}" if implementer else ""
        family, model = _number(f.get("CPU architecture")), _number(f.get("CPU part"))
        flags = f.get("Features", "")
    present = set(flags.split())
    return ProcessorKey(
        device="cpu",
        name=f.get("model name") or name or "unknown CPU",
        vendor=re.sub(r"\s+", "_", vendor) or "unknown",
        family=family,
        model=model,
        isa=tuple(sorted(present.intersection(KERNEL_FLAGS))),
        threads=threads,
    )


def this_processor(device: str = "cpu", threads: int | None = None) -> ProcessorKey:
    """The key of the processor `device` runs on. `threads`: the torch thread count a run will
    use (default: this process's); a GPU's key has none, and its compute capability stands in
    for family and model number."""
    dev = torch.device(device)
    if dev.type == "cuda" and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(dev)
        return ProcessorKey("cuda", torch.cuda.get_device_name(dev), "NVIDIA", major, minor)
    return processor_from_cpuinfo(
        _cpuinfo(), threads or torch.get_num_threads(), name=platform.processor()
    )


def processor_key(device: str = "cpu", threads: int | None = None) -> str:
    """A stable name for the processor a measurement came from, e.g.
    `cpu:AMD EPYC 9654 96-Core Processor [AuthenticAMD family 25 model 17; avx2 avx512_bf16
    avx512_vnni avx512f] x2` (the string form of `this_processor`). Cost models and profiles
    are stored and looked up under it."""
    return str(this_processor(device, threads))


@dataclass(frozen=True, slots=True)
class Precision:
    """The float type a runner uses and why it was picked (logged at start-up)."""

    dtype: torch.dtype
    name: str
    reason: str


def native_bf16(device: str = "cpu") -> tuple[bool, str]:
    """Whether `device` runs bfloat16 matrix products natively, and the evidence."""
    dev = torch.device(device)
    if dev.type == "cuda":
        ok = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        return ok, "GPU supports bf16" if ok else "GPU lacks bf16"
    flags = cpu_flags()
    if "amx_bf16" in flags:
        return True, "CPU has AMX-BF16"
    if "avx512_bf16" in flags:
        return True, "CPU has AVX512-BF16 (no AMX)"
    return False, "CPU has neither AMX-BF16 nor AVX512-BF16"


def resolve_precision(requested: str, device: str = "cpu") -> Precision:
    """Turn `float32|bfloat16|float16|auto` into a torch dtype for `device`, with the reason.

    `auto` is bfloat16 where the hardware runs it natively, else float32. An explicit
    `bfloat16` is honoured even without native support (it is then slower, and the reason
    says so); `float16` is refused on CPU, where torch runs it through slow fallbacks.
    """
    if requested not in DTYPE_NAMES:
        raise ValueError(f"dtype {requested!r}: expected one of {', '.join(DTYPE_NAMES)}")
    native, why = native_bf16(device)
    if requested == "auto":
        if native:
            return Precision(torch.bfloat16, "bfloat16", f"auto: {why}")
        return Precision(torch.float32, "float32", f"auto: {why}, so float32")
    if requested == "float16" and torch.device(device).type == "cpu":
        raise ValueError("dtype float16 is not supported on CPU: use bfloat16 or float32")
    if requested == "bfloat16" and not native:
        return Precision(torch.bfloat16, "bfloat16", f"requested; {why}: expect it to be slow")
    return Precision(_TORCH_DTYPES[requested], requested, "requested")


QUANTIZATION_NAMES = ("auto", "none", "int8", "int4")


def runner_quantizations(runner_class: type) -> tuple[str, ...]:
    """The quantizations a runner class implements: its `quantizations` class attribute, or
    only `none` where it has none."""
    return tuple(getattr(runner_class, "quantizations", ("none",)))


def check_quantization(requested: str, runner: str, supported: Collection[str] = ("none",)) -> str:
    """`requested` when the runner called `runner` implements it (`supported`), else a
    ValueError naming the runner, the quantization and what the runner does implement:
    a quantization is never silently ignored. `auto` is what the runner resolves it to where
    it lists `auto` itself (it then keeps `auto` and resolves it at load), else `none`: auto
    only ever runs weights as the model ships them."""
    if requested not in QUANTIZATION_NAMES:
        raise ValueError(
            f"quantization {requested!r}: expected one of {', '.join(QUANTIZATION_NAMES)}"
        )
    if requested == "auto" and requested not in supported:
        return "none"
    if requested not in supported:
        raise ValueError(
            f"{runner} does not support quantization {requested} (it runs: "
            f"{', '.join(sorted(supported)) or 'nothing'}); serve with --quantize none"
        )
    return requested
