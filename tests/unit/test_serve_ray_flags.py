"""`lenbatch serve --ray`: what it refuses before it starts anything."""

from __future__ import annotations

import pytest

from lenbatch.cli import main


def test_ray_refuses_causal_models(caplog: pytest.LogCaptureFixture) -> None:
    assert main(["serve", "--ray", "--model", "smollm2"]) == 2
    assert "embedding models only" in caplog.text


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
