"""Several models in one config (`[[models]]`), quantization, and `task = "auto"`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from lenbatch.cli import main
from lenbatch.config import ModelConfig, ModelTask, Quantization, Settings, load_settings
from lenbatch.runners.tasks import resolve_task, task_from_config

TWO_MODELS = """
[[models]]
name = "minilm"
served_name = "embedder"
dtype = "float32"

[[models]]
name = "/models/ms-marco-MiniLM-L-6-v2"
task = "score"
quantization = "int8"
"""


def _toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.toml"
    path.write_text(text)
    return path


def test_models_tables_are_a_list_of_model_configs(tmp_path: Path) -> None:
    """`[[models]]` in TOML and `models:` in YAML give the same list, each entry with the
    fields of `[model]` and its defaults."""
    toml = load_settings(_toml(tmp_path, TWO_MODELS), {})
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text(
        "models:\n"
        "  - {name: minilm, served_name: embedder, dtype: float32}\n"
        "  - {name: /models/ms-marco-MiniLM-L-6-v2, task: score, quantization: int8}\n"
    )
    yaml = load_settings(yaml_file, {})
    assert toml.served_models() == yaml.served_models()
    first, second = toml.served_models()
    assert (first.served_name, first.dtype, first.task) == ("embedder", "float32", ModelTask.AUTO)
    assert (second.task, second.quantization) == (ModelTask.SCORE, Quantization.INT8)
    assert second.served_name is None and second.default_served_name() == "ms-marco-MiniLM-L-6-v2"


def test_a_single_model_table_is_a_list_of_one() -> None:
    """`[model]` alone is served as one model, named by `[server] served_model_name` when
    that is what names it."""
    s = Settings.model_validate({"model": {"name": "minilm"}})
    assert s.served_models() == (s.model,)
    named = Settings.model_validate({"server": {"served_model_name": "emb"}})
    assert [m.served_name for m in named.served_models()] == ["emb"]
    assert Settings().served_models() == (ModelConfig(),)


def test_for_model_gives_the_settings_of_one_server(tmp_path: Path) -> None:
    """A `[[models]]` entry becomes `[model]` (and its served name `[server]`'s), for the
    single-model code paths."""
    s = load_settings(_toml(tmp_path, TWO_MODELS), {})
    one = s.for_model(s.served_models()[0])
    assert one.model.name == "minilm" and one.models == ()
    assert one.server.served_model_name == "embedder"
    assert one.served_models() == (s.served_models()[0],)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            {"model": {"name": "minilm"}, "models": [{"name": "a"}]},
            r"\[model\] \(name\) and \[\[models\]\] are both given",
        ),
        (
            {"models": [{"name": "a", "served_name": "x"}, {"name": "b", "served_name": "x"}]},
            "'a' and 'b' are both served as 'x'",
        ),
        (
            {"models": [{"name": "/m/one/encoder"}, {"name": "/m/two/encoder"}]},
            "both served as 'encoder'.*without served_name",
        ),
        (
            {"models": [{"name": "a"}], "server": {"served_model_name": "s"}},
            "set served_name in each",
        ),
        (
            {"model": {"served_name": "a"}, "server": {"served_model_name": "b"}},
            "served_name='a' and .*served_model_name='b'",
        ),
        ({"models": [{"name": "a", "quantization": "fp8"}]}, "none.*int8.*int4"),
        ({"models": [{"name": "a", "task": "rerank"}]}, "embed.*generate.*score.*classify"),
    ],
)
def test_cross_field_errors_name_the_values(data: dict[str, object], message: str) -> None:
    """Conflicting or duplicate model settings are errors naming what conflicts."""
    with pytest.raises(ValidationError, match=message):
        Settings.model_validate(data)


def test_models_cannot_come_from_the_environment() -> None:
    """A list of tables has no `LENBATCH_<SECTION>__<FIELD>` form: the variable is refused."""
    with pytest.raises(ValueError, match=r"LENBATCH_MODELS__NAME: \[\[models\]\]"):
        load_settings(None, {"LENBATCH_MODELS__NAME": "minilm"})


def test_serve_checks_every_model_before_loading(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`serve` takes several models; one that does not exist stops it before anything loads,
    naming it. `--ray` serves one model and refuses a list, naming them."""
    status = main(["serve", "--config", str(_toml(tmp_path, TWO_MODELS))])
    err = capsys.readouterr().err
    assert status == 2 and "'/models/ms-marco-MiniLM-L-6-v2' is neither an alias" in err
    status = main(["serve", "--ray", "--config", str(_toml(tmp_path, TWO_MODELS))])
    err = capsys.readouterr().err
    assert status == 2 and "--ray serves one model" in err


def test_serve_refuses_model_flags_beside_models_tables(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A model flag sets `[model]`, which a `[[models]]` config cannot also have."""
    status = main(["serve", "--config", str(_toml(tmp_path, TWO_MODELS)), "--dtype", "float32"])
    assert status == 2 and "both given" in capsys.readouterr().err


@pytest.mark.parametrize(("model", "runner"), [("minilm", "EncoderRunner")])
@pytest.mark.parametrize("quantize", ["int4"])
def test_serve_refuses_a_quantization_no_runner_implements(
    model: str, runner: str, quantize: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--quantize` is never silently ignored: the runner that lacks it is named."""
    assert main(["serve", "--model", model, "--quantize", quantize]) == 2
    err = capsys.readouterr().err
    assert f"{runner} does not support quantization {quantize}" in err


def test_serve_refuses_int8_encoders_beside_bfloat16(capsys: pytest.CaptureFixture[str]) -> None:
    """An encoder's int8 products run with float32 around them: an explicit bfloat16 is
    refused before loading, saying which dtypes go with int8."""
    assert main(["serve", "--model", "minilm", "--quantize", "int8", "--dtype", "bfloat16"]) == 2
    err = capsys.readouterr().err
    assert "quantization int8" in err and "--dtype float32 or auto, not bfloat16" in err


def test_serve_refuses_a_task_it_does_not_serve(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An explicit task the server cannot serve for the model is refused before loading."""
    assert main(["serve", "--config", str(_toml(tmp_path, '[model]\ntask = "score"\n'))]) == 2
    assert "task score" in capsys.readouterr().err
    assert main(["serve", "--config", str(_toml(tmp_path, '[model]\ntask = "generate"\n'))]) == 2
    assert "is not a causal LM" in capsys.readouterr().err


def _folder(tmp_path: Path, name: str, config: dict[str, object]) -> str:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.mark.parametrize(
    ("config", "task"),
    [
        ({"architectures": ["LlamaForCausalLM"]}, ModelTask.GENERATE),
        ({"architectures": ["GPT2LMHeadModel"]}, ModelTask.GENERATE),
        (
            {"architectures": ["BertForSequenceClassification"], "id2label": {"0": "LABEL_0"}},
            ModelTask.SCORE,
        ),
        ({"architectures": ["BertForSequenceClassification"], "num_labels": 1}, ModelTask.SCORE),
        (
            {
                "architectures": ["XLMRobertaForSequenceClassification"],
                "id2label": {"0": "negative", "1": "neutral", "2": "positive"},
            },
            ModelTask.CLASSIFY,
        ),
        ({"architectures": ["BertForSequenceClassification"]}, ModelTask.CLASSIFY),
        ({"architectures": ["BertModel"]}, ModelTask.EMBED),
        ({}, ModelTask.EMBED),
    ],
)
def test_auto_task_comes_from_the_folders_config(
    tmp_path: Path, config: dict[str, object], task: ModelTask
) -> None:
    """A causal LM generates, a classification head with one label scores, with more
    classifies (two when unsaid, as in transformers), anything else embeds."""
    assert task_from_config(config) is task
    assert resolve_task(_folder(tmp_path, "m", config)) is task


def test_auto_task_of_names_and_explicit_tasks(tmp_path: Path) -> None:
    """Built-in names and .gguf files need no folder; an explicit task is kept as given; a
    folder without config.json is an error naming it."""
    assert resolve_task("minilm") is ModelTask.EMBED
    assert resolve_task("smollm2") is ModelTask.GENERATE
    assert resolve_task(str(tmp_path / "model.Q4_1.gguf")) is ModelTask.GENERATE
    assert resolve_task("anything", ModelTask.CLASSIFY) is ModelTask.CLASSIFY
    with pytest.raises(ValueError, match=r"no config\.json"):
        resolve_task(str(tmp_path))
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a JSON object"):
        resolve_task(str(bad))


def test_a_models_own_batch_token_cap() -> None:
    """`max_batch_tokens` in a [[models]] table is that model's batching cap; the others keep
    the shared one."""
    s = Settings.model_validate(
        {
            "models": [{"name": "minilm"}, {"name": "/m/reranker", "max_batch_tokens": 2048}],
            "batching": {"max_batch_tokens": 4096},
        }
    )
    first, second = (s.for_model(m) for m in s.served_models())
    assert first.batching.max_batch_tokens == 4096
    assert second.batching.max_batch_tokens == 2048
