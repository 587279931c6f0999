"""The Ray Serve application: an ingress and N lenbatch engine replicas, and how to run it.

    HTTP ─► Ray's proxy ─► Ingress (1 replica: tokenize, length ranges, OpenAI routes)
                              └─ handle, LengthRangeRouter ─► EngineReplica × N (embeddings)
                                                            or LMReplica × N (causal LMs)

`build_app` binds the two deployments; `run` starts (or joins) Ray, deploys, prints where it
serves and, on SIGTERM or Ctrl-C, drains (the ingress refuses new requests and waits for the
admitted ones, then every replica's engine drains as Ray stops it) before it shuts down.
Ray stays on the addresses it is given: a local Ray binds 127.0.0.1, without dashboard or usage
statistics.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lenbatch.config import Settings

if TYPE_CHECKING:
    from lenbatch.runners.base import ModelInfo
    from lenbatch.scaleout.board import RoutingBoard
    from lenbatch.scaleout.frontend import Frontend
    from lenbatch.scaleout.lmfrontend import LMFrontend

__all__ = [
    "APP_NAME",
    "ENGINES",
    "Ingress",
    "RayOptions",
    "app_builder",
    "build_app",
    "init_local_ray",
    "run",
]

log = logging.getLogger("lenbatch.scaleout")

APP_NAME = "lenbatch"
ENGINES = "LenbatchEngine"  # the engine deployment's name; its routing board has this key


@dataclass(frozen=True)
class RayOptions:
    """How the app is laid out on Ray."""

    replicas: int = 2
    groups: int | None = None  # length ranges; None: one per replica
    routing: str = "length"  # "length" (LengthRangeRouter) or "pow2" (Ray's default policy)
    threads: int = 1  # torch threads and Ray CPUs per engine replica
    spill_at: int = 64  # calls in flight on every owner before a call spills
    spill_wait: float = 0.2  # seconds the owners' expected wait may exceed another replica's
    max_ongoing: int = 1024  # per engine replica (Ray's default of 5 would cap batches at 5)


class Ingress:
    """The HTTP ingress deployment: lenbatch's own app (embeddings, or completions and chat for
    a causal LM) over a `Frontend` / `LMFrontend`, the services of `scaleout.ingress`.

    It loads the model's tokenizer only, never its weights: the model's facts come from a
    replica (`info()`)."""

    # Ray Serve awaits an async constructor (it asks a replica for the model's facts).
    async def __init__(  # type: ignore[misc]
        self, engines: Any, settings: dict[str, Any], routing: str, groups: int
    ) -> None:
        from lenbatch.scaleout.board import board_for
        from lenbatch.scaleout.replica import model_info

        self.settings = Settings.model_validate(settings)
        facts = await engines.info.remote()
        board = board_for(ENGINES, groups)
        self.frontend = self._frontend(
            engines, board, model_info(facts), facts["boundaries"], routing
        )
        log.info("%s; replicas: %s", self.frontend.describe(), facts["describe"])

    def _frontend(
        self,
        engines: Any,
        board: RoutingBoard,
        info: ModelInfo,
        boundaries: list[int],
        routing: str,
    ) -> Frontend | LMFrontend:
        """The service for the replicas' model, over the same tokenizer (and chat template):
        completions and chat for a causal LM, else embeddings."""
        from lenbatch.generate.prompts import Prompts
        from lenbatch.runners.loading import load_tokenizer
        from lenbatch.runners.tokenizer import TextTokenizer
        from lenbatch.scaleout.frontend import Frontend
        from lenbatch.scaleout.lmfrontend import LMFrontend

        s = self.settings
        timeout = s.admission.request_timeout_s
        if info.kind == "generate":
            text = load_tokenizer(s.model.name, info.max_length)  # cuts where they cut
            if not isinstance(text, TextTokenizer):
                raise ValueError(
                    f"model {s.model.name!r} is served as a causal LM but has no tokenizer"
                )
            prompts = Prompts(text, info, s.generation)
            return LMFrontend(
                engines, board, prompts, boundaries, routing=routing, request_timeout=timeout
            )
        tokenizer = load_tokenizer(s.model.name, info.max_length)  # cuts where the replicas cut
        return Frontend(
            engines,
            board,
            tokenizer.tokenize,
            info,
            boundaries,
            routing=routing,
            default_truncate=s.model.truncate,
            request_timeout=timeout,
        )

    def __serve_build_asgi_app__(self) -> Any:
        from lenbatch.scaleout.figures import FreshFigures
        from lenbatch.scaleout.lmfrontend import LMFrontend

        # The single server's app, unchanged, over the ingress's service.
        if isinstance(self.frontend, LMFrontend):
            from lenbatch.generate.api import create_llm_app

            app = create_llm_app(self.frontend, self.settings)
        else:
            from lenbatch.embed.api import create_app

            app = create_app(self.frontend, self.settings)
        app.add_middleware(FreshFigures, refresh=self.frontend.refresh)
        return app

    async def drain(self, timeout: float | None = None) -> int:
        """Refuse new requests and wait for the admitted ones; returns how many were still
        open at the timeout (they are answered 503)."""
        front = self.frontend
        front.begin_drain()
        if await front.wait_idle(
            self.settings.server.drain_timeout_s if timeout is None else timeout
        ):
            return 0
        left = front.unanswered
        await front.drain(0)  # the timeout has passed: answer what is left
        return left

    async def routing(self) -> dict[str, Any]:
        """The routing counters and every replica's figures (as `/stats`)."""
        await self.frontend.refresh()
        return self.frontend.stats()


def build_app(settings: Settings, options: RayOptions) -> Any:
    """The bound Ray Serve application (ingress over `options.replicas` engine replicas)."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from lenbatch.config import Strategy
    from lenbatch.runners.causal import resolve_causal_model
    from lenbatch.scaleout.replica import EngineReplica, LMReplica
    from lenbatch.scaleout.router import LengthRangeRouter

    if options.routing not in ("length", "pow2"):
        raise ValueError(f"routing must be 'length' or 'pow2', got {options.routing!r}")
    groups = options.groups or options.replicas
    if not 1 <= groups <= options.replicas:
        raise ValueError(f"groups must be in [1, replicas={options.replicas}], got {groups}")
    causal = resolve_causal_model(settings.model.name) is not None
    if causal and settings.batching.strategy is Strategy.ADAPTIVE:
        raise ValueError("strategy adaptive serves embedding models; for a causal LM use bucketed")
    replica_class: Any = LMReplica if causal else EngineReplica
    payload = settings.model_dump(mode="json")
    drain_s = settings.server.drain_timeout_s
    # Ray Serve logs every call of every replica at INFO; follow lenbatch's log level instead.
    level = settings.server.log_level.upper()
    logging_config = {"log_level": level, "enable_access_log": level in ("DEBUG", "INFO")}
    engines = serve.deployment(
        replica_class,
        name=ENGINES,
        num_replicas=options.replicas,
        max_ongoing_requests=options.max_ongoing,
        ray_actor_options={"num_cpus": options.threads},
        graceful_shutdown_timeout_s=drain_s + 5,
        health_check_period_s=2.0,
        logging_config=logging_config,
        request_router_config=RequestRouterConfig(
            request_router_class=LengthRangeRouter,
            request_router_kwargs={
                "board": ENGINES,
                "groups": groups,
                "policy": options.routing,
                "spill_at": options.spill_at,
                "spill_wait": options.spill_wait,
            },
        ),
    ).bind(payload, options.threads)
    ingress = serve.deployment(
        serve.ingress()(Ingress),
        name="LenbatchIngress",
        num_replicas=1,
        max_ongoing_requests=8192,
        ray_actor_options={"num_cpus": 0},
        logging_config=logging_config,
        graceful_shutdown_timeout_s=drain_s + 5,
    )
    return ingress.bind(engines, payload, options.routing, groups)


def app_builder(args: dict[str, Any]) -> Any:
    """The application for a Serve config file or a KubeRay `RayService`
    (`import_path: lenbatch.scaleout.app:app_builder`). `args`: `config` (a lenbatch config
    file; `LENBATCH_*` variables apply too), `replicas`, `groups`, `routing`, `threads`,
    `spill_wait`."""
    from lenbatch.config import load_settings

    settings = load_settings(args.get("config"), os.environ)
    options = RayOptions(
        replicas=int(args.get("replicas", 2)),
        groups=int(args["groups"]) if args.get("groups") else None,
        routing=str(args.get("routing", "length")),
        threads=int(args.get("threads", 1)),
        spill_wait=float(args.get("spill_wait", RayOptions.spill_wait)),
    )
    return build_app(settings, options)


def init_local_ray(num_cpus: int) -> None:
    """Start a single-node Ray bound to 127.0.0.1 only, without dashboard or usage stats.

    Ray turns a loopback `_node_ip_address` into the host's reachable address, except where it
    runs without multi-node clusters (its macOS/Windows mode, `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER
    =0`): that mode is switched on here, for the processes Ray starts (the variable) and for
    this one (the constant, read when `ray` was imported). The API server Ray always starts
    (usage-stats module only) gets a free loopback port instead of the default 8265.
    """
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    import ray
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        api_port = int(s.getsockname()[1])
    ray.init(
        num_cpus=num_cpus,
        include_dashboard=False,
        dashboard_port=api_port,
        log_to_driver=False,
        _node_ip_address="127.0.0.1",
    )


def run(settings: Settings, options: RayOptions) -> int:
    """Start a local Ray on 127.0.0.1 (or join `RAY_ADDRESS`), deploy, serve until SIGTERM or
    Ctrl-C, drain, and stop what was started."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    from ray import serve

    address = os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=False)
    else:
        init_local_ray(max(os.cpu_count() or 1, options.replicas * options.threads))
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):  # after ray.init, which sets its own
        signal.signal(sig, lambda *_: stop.set())
    host, port = settings.server.host, settings.server.port
    try:
        serve.start(http_options={"host": host, "port": port})
        handle = serve.run(build_app(settings, options), name=APP_NAME, route_prefix="/")
        print(
            f"lenbatch on Ray Serve: http://{host}:{port} ({options.replicas} engine replicas, "
            f"routing {options.routing}; Ray at {address or 'local 127.0.0.1'})",
            flush=True,
        )
        stop.wait()
        log.info("shutdown requested: draining")
        left = handle.drain.remote().result(timeout_s=settings.server.drain_timeout_s + 30)
        if left:
            log.warning("%d requests still open at the drain timeout: answered 503", left)
    finally:
        try:
            if address:
                serve.delete(APP_NAME)  # a shared cluster: remove only this app
            else:
                serve.shutdown()
        finally:
            ray.shutdown()
    return 0
