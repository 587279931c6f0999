"""`lenbatch serve --ray`: what it refuses before it starts anything, and which replicas it
binds."""

from __future__ import annotations

from pathlib import Path

import pytest

from lenbatch.cli import main
from lenbatch.config import Settings


@pytest.mark.parametrize("flag", ["--replicas", "--replica-threads"])
def test_ray_refuses_zero_replicas_or_threads(flag: str, caplog: pytest.LogCaptureFixture) -> None:
    assert main(["serve", "--ray", flag, "0"]) == 2
    assert "at least 1" in caplog.text


def test_app_builder_binds_the_two_deployments_without_a_cluster() -> None:
    pytest.importorskip("ray", reason="needs the Ray extra: pip install 'lenbatch[ray]'")
    from ray.serve import Application

    from lenbatch.scaleout.app import app_builder

    app = app_builder({"replicas": 3, "groups": 2, "routing": "pow2"})
    assert isinstance(app, Application)
    ingress = app._bound_deployment
    engines = ingress.init_args[0]._bound_deployment  # the ingress is bound to the engines
    assert (ingress.name, ingress.num_replicas) == ("LenbatchIngress", 1)
    assert (engines.name, engines.num_replicas) == ("LenbatchEngine", 3)
    router = engines._deployment_config.request_router_config
    assert router.request_router_kwargs["groups"] == 2
    assert router.request_router_kwargs["policy"] == "pow2"
    with pytest.raises(ValueError, match="groups"):
        app_builder({"replicas": 2, "groups": 3})
    with pytest.raises(ValueError, match="routing"):
        app_builder({"routing": "random"})


@pytest.mark.slow
def test_a_causal_model_gets_lm_replicas(tiny_llama_dir: Path) -> None:
    """A causal LM is deployed on `LMReplica`s (completions and chat), an embedding model on
    `EngineReplica`s; adaptive batching, an embeddings strategy, is refused for a causal LM as
    `lenbatch serve` refuses it."""
    pytest.importorskip("ray", reason="needs the Ray extra: pip install 'lenbatch[ray]'")
    from lenbatch.scaleout.app import RayOptions, build_app

    def engine_class(settings: Settings) -> str:
        app = build_app(settings, RayOptions(replicas=2))
        engines = app._bound_deployment.init_args[0]._bound_deployment
        return str(engines.func_or_class.__name__)

    llm = {"model": {"name": str(tiny_llama_dir)}}
    assert engine_class(Settings.model_validate(llm)) == "LMReplica"
    assert engine_class(Settings()) == "EngineReplica"
    adaptive = dict(llm, batching={"strategy": "adaptive"})
    with pytest.raises(ValueError, match="causal LM"):
        build_app(Settings.model_validate(adaptive), RayOptions())
