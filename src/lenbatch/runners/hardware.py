"""What the machine under the runner is, and which float type to run a model in.

The project's machine changes between runs (an AMD EPYC one round, an Intel Xeon with AMX the
next), so nothing may assume one processor: cost models are keyed by `processor_key()`, and
`--dtype auto` picks bfloat16 only where the hardware runs it natively.
"""

from __future__ import annotations

import platform
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

__all__ = [
    "DTYPE_NAMES",
    "Precision",
    "cpu_flags",
    "cpu_model",
    "processor_key",
    "resolve_precision",
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


def processor_key(device: str = "cpu", threads: int | None = None) -> str:
    """A stable name for the processor a measurement came from: CPU model, family and cores,
    or the GPU's name. Cost models and profiles are stored and looked up under it. `threads`:
    the torch thread count a run will use (default: this process's)."""
    dev = torch.device(device)
    if dev.type == "cuda" and torch.cuda.is_available():
        return f"cuda:{torch.cuda.get_device_name(dev)}"
    info = _cpuinfo()
    family = re.search(r"^cpu family\s*:\s*(\d+)$", info, re.MULTILINE)
    fam = f" family {family.group(1)}" if family else ""
    return f"cpu:{cpu_model()}{fam} x{threads or torch.get_num_threads()}"


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
