"""llama.cpp (through llama-cpp-python's server) as a peer: `--peer llamacpp`, completions.

PyPI `llama-cpp-python[server]` has no wheel for this platform, so it is built from source on
first use (minutes on 2 cores; it compiles llama.cpp for this CPU). It loads the GGUF file
itself (SmolLM2 ships as one, Q4_1), so unlike lenbatch and vLLM, which run the weights
dequantized in float32, it computes on the quantized weights: a different trade of accuracy
for speed that the report states. Its server runs one request at a time (no batching across
requests); `--n_threads` is every core, the context is 2048 tokens.

On CPUs with AMX (Intel Xeon, Sapphire Rapids on) the stock server segfaulted at the first
completion in llama.cpp's AMX weight repacking. Turning off llama.cpp's extra buffer types
(`llama_model_params.use_extra_bufts`, which this server has no flag for) avoids it, so on a CPU
with AMX the server is started through a two-line wrapper that sets it (`NO_EXTRA_BUFTS`). On
CPUs without AMX (this AMD EPYC Zen 5) the stock server ran fine and nothing is changed.
"""

from __future__ import annotations

from pathlib import Path

from lenbatch.replay.peers.external import PeerContext, PeerLaunch, VenvSpec

__all__ = ["LLAMACPP", "NO_EXTRA_BUFTS", "LlamaCppPeer", "cpu_has_amx"]

# `python -c NO_EXTRA_BUFTS ARGS...`: the stock server with extra buffer types (weight
# repacking) off; `Llama` reads the defaults through the module attribute patched here.
NO_EXTRA_BUFTS = (
    "import llama_cpp.llama_cpp as c\n"
    "_defaults = c.llama_model_default_params\n"
    "def _params():\n"
    "    p = _defaults()\n"
    "    p.use_extra_bufts = False\n"
    "    return p\n"
    "c.llama_model_default_params = _params\n"
    "from llama_cpp.server.__main__ import main\n"
    "main()\n"
)


def cpu_has_amx(cpuinfo: str | None = None) -> bool:
    """True when /proc/cpuinfo lists AMX (amx_tile)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
        except OSError:
            return False
    return any(line.startswith("flags") and " amx_tile" in line for line in cpuinfo.splitlines())


class LlamaCppPeer:
    """`python -m llama_cpp.server` on 127.0.0.1."""

    name = "llamacpp"
    endpoints = ("completions",)
    venv = VenvSpec(
        name="llamacpp",
        requirements=("llama-cpp-python[server]==0.3.36",),
        report_versions=("llama-cpp-python", "uvicorn", "fastapi"),
        build_env={"CMAKE_BUILD_PARALLEL_LEVEL": "2"},
    )

    def __init__(self, amx: bool | None = None) -> None:
        self.amx = amx  # None: read from this CPU at launch

    def launch(self, ctx: PeerContext) -> PeerLaunch:
        """The server command on the model's GGUF file."""
        from lenbatch.runners.causal import resolve_causal_model

        ref = resolve_causal_model(ctx.model)
        if ref is None or ref.gguf_file is None:
            raise ValueError(f"peer llamacpp needs a GGUF model; {ctx.model!r} is not one")
        gguf = ref.folder / ref.gguf_file
        amx = cpu_has_amx() if self.amx is None else self.amx
        start = ("-c", NO_EXTRA_BUFTS) if amx else ("-m", "llama_cpp.server")
        argv: tuple[str, ...] = (
            str(ctx.python), *start, "--model", str(gguf),
            "--model_alias", ref.name, "--host", "127.0.0.1", "--port", "{port}",
            "--n_ctx", "2048", "--n_threads", str(ctx.cpus), "--n_threads_batch", str(ctx.cpus),
            "--verbose", "false",
        )  # fmt: skip
        notes = [f"{gguf.name} (quantized weights), {ctx.cpus} threads, one request at a time"]
        if amx:
            notes.append("CPU has AMX: extra buffer types (weight repacking) off")
        return PeerLaunch(argv=argv, health_path="/v1/models", notes=tuple(notes))


LLAMACPP = LlamaCppPeer()
