"""lenbatch's C++ ops: a decode step's attention over each row's real columns, and more.

`decode_attention(q, keys, values, mask, scale)` computes, for one query per row, attention
over the KV window's columns that `mask` marks real, for every query head of a key/value head
at once (grouped-query attention), in float32 whatever the input dtype. The op
(`decode_attention.cpp`) is built just in time with `torch.utils.cpp_extension.load` the first
time it is asked for, with `-O3 -march=native`, into a folder inside the running venv
(`<sys.prefix>/lenbatch-ext/`), keyed by torch's version, the source's hash and the CPU's
flags, so a second start loads it in milliseconds and another CPU builds its own.

It is used only where it can be: an x86 CPU with AVX-512 (`avx512f` in `/proc/cpuinfo`) or with
AVX2 and FMA (a Zen 3), a C++ compiler, and a build that succeeds. Anything else falls back to
`F.scaled_dot_product_attention` (the caller's path) with one line in the log saying why. An
AVX2 build holds the attention loop (in float32 with 256-bit vectors: 1.4-1.5x the portable
loop it ran before on a Zen 3, a step's cache streamed from memory;
`bench/results/zen3-model1/decode-attention-avx2.md`), the fused passes, `group_linear`, the
int8 passes and a float32 `packed_attention` (encoders), not the bfloat16 ops (`bf16_linear`,
`bf16_gate_up_silu`, `decode_layers`, `chunk_attention`): callers look each op up by name and
run torch's where it is missing.
`LENBATCH_DECODE_ATTENTION=sdpa` forces the fallback (tests use it); `=kernel` requires the op
and raises where it cannot be built.

On a CPU with the AMX tile unit (a Sapphire Rapids class Xeon: `amx_bf16` in `/proc/cpuinfo`;
no AMD processor has one) the build also holds a bfloat16 `packed_attention` on the tiles, used
where Linux grants the process the tile registers; `LENBATCH_AMX=off` keeps it on AVX-512.

The same build holds the lean Llama path's fused passes (`add_rms_norm`, `rope`, `silu_mul`),
its weight-only products in groups of 32 with float32 activations (`group_linear`, behind
`runners/rowlinears.py`'s `GroupLinear`), its bfloat16 products of a few rows (`bf16_linear`,
behind `Bf16Gemv`) and the packed encoder's attention
(`packed_attention`: each sequence of a packed batch attends to its own tokens, straight from
the fused Q/K/V rows; `runners/packed.py`).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from lenbatch.runners.hardware import cpu_flags

__all__ = ["amx_allowed", "build_lock", "build_name", "decode_attention_op", "kernel_unavailable"]

log = logging.getLogger("lenbatch.runner")

_SOURCE = Path(__file__).with_name("decode_attention.cpp")
_ENV = "LENBATCH_DECODE_ATTENTION"
_AMX_ENV = "LENBATCH_AMX"
_lock = threading.Lock()
_loaded: dict[str, Any] = {}


def kernel_unavailable() -> str | None:
    """Why the op cannot be used on this machine (None when it can be built and run)."""
    choice = os.environ.get(_ENV, "auto").strip().lower()
    if choice == "sdpa":
        return f"{_ENV}=sdpa"
    if choice not in ("auto", "kernel"):
        return f"{_ENV}={choice!r} (expected auto, kernel or sdpa)"
    flags = cpu_flags()
    if "avx512f" not in flags and not {"avx2", "fma"} <= flags:
        return "this CPU has neither AVX-512 nor AVX2 with FMA"
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return "no C++ compiler"
    if _ninja() is None:
        return "no ninja (pip install ninja)"
    if not _SOURCE.exists():
        return f"{_SOURCE.name} is missing"
    return None


def amx_allowed() -> bool:
    """Whether the ops may use the AMX tile unit where the build and the CPU have one
    (`LENBATCH_AMX=off` keeps bfloat16 packed attention on AVX-512, for A/B runs)."""
    choice = os.environ.get(_AMX_ENV, "auto").strip().lower()
    if choice not in ("auto", "off"):
        raise ValueError(f"{_AMX_ENV}={choice!r} (expected auto or off)")
    return choice == "auto"


def _ninja() -> str | None:
    """The ninja that cpp_extension will run: on PATH, else the venv's own (the `ninja`
    dependency installs it beside this Python, which is not on PATH outside an activated venv)."""
    return shutil.which("ninja") or shutil.which("ninja", path=str(Path(sys.executable).parent))


def _build_dir(name: str) -> Path:
    folder = Path(sys.prefix) / "lenbatch-ext" / name
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@contextlib.contextmanager
def build_lock(folder: Path) -> Iterator[None]:
    """Hold an exclusive lock on `folder` for one build, across processes, and clear torch's
    own marker there if an interrupted build left it. torch's `cpp_extension.load` marks a
    build in progress with a plain `lock` file that it deletes when done, and any later
    `load` of the same folder waits for it to go: a server stopped during its first build
    (Ctrl-C at start-up) left it behind, and every later start hung there without a word.
    The kernel releases this lock when its holder dies, and every lenbatch build takes it
    first, so a marker found while holding it is stale."""
    with (folder / ".lenbatch-build.lock").open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        marker = folder / "lock"
        if marker.exists():
            log.warning("removed %s, left by an interrupted build of the C++ ops", marker)
            marker.unlink(missing_ok=True)
        yield


def build_name() -> str:
    """The op's build name (and folder name): keyed by its source, torch's version and this
    CPU's flags."""
    source = _SOURCE.read_bytes()
    flags = " ".join(sorted(cpu_flags()))
    key = hashlib.sha256(source + torch.__version__.encode() + flags.encode()).hexdigest()[:12]
    return f"lenbatch_decode_attention_{key}"


def _build() -> Any:
    from torch.utils.cpp_extension import load

    if shutil.which("ninja") is None:  # cpp_extension runs `ninja` from PATH
        os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    name = build_name()
    folder = _build_dir(name)
    with build_lock(folder):
        return load(
            name=name,
            sources=[str(_SOURCE)],
            extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            build_directory=str(folder),
            verbose=False,
        )


def decode_attention_op() -> Any | None:
    """The built op (`op.decode_attention(q, keys, values, mask, scale)`, and
    `op.add_rms_norm(h, delta, weight, eps)`, `op.rope(x, cos, sin, heads)`,
    `op.silu_mul(gu)`, `op.group_linear(x, q, scale, lo)`, and for packed encoders
    `op.packed_attention(qkv, offsets, heads, scale, use_amx=True)`, `op.has_amx()`), or None
    where it cannot be used here (logged once). Builds on the first call (tens of seconds), then
    loads from the venv's cache."""
    with _lock:
        if "op" in _loaded:
            return _loaded["op"]
        why = kernel_unavailable()
        op: Any | None = None
        if why is None:
            try:
                op = _build()
            except Exception as exc:  # a failed build falls back; the log says why
                if os.environ.get(_ENV, "").strip().lower() == "kernel":
                    raise
                why = f"build failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        if op is None:
            log.info("C++ ops off, attention by torch SDPA (%s)", why)
        else:
            amx = op.has_amx() and amx_allowed()
            # Only an AVX-512 build holds the bfloat16 ops; an AVX2 one runs float32 only.
            isa = "AVX-512" if hasattr(op, "bf16_linear") else "AVX2, float32"
            log.info(
                "C++ ops (%s, built for this CPU): decode attention over real columns, "
                "packed encoder attention%s, fused Llama passes",
                isa, " (bfloat16 on AMX tiles)" if amx else "",
            )  # fmt: skip
        _loaded["op"] = op
        return op
