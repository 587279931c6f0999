"""`lenbatch serve`: load a model and serve it over HTTP with length-aware batching."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from lenbatch.cli.build import build_model
from lenbatch.cli.common import (
    adaptive_overrides,
    add_adaptive_options,
    add_batching_options,
    add_precision_options,
    add_quantize_option,
    batching_overrides,
)
from lenbatch.config import (
    DecodeMode,
    ModelConfig,
    ModelTask,
    Quantization,
    Settings,
    Strategy,
    load_settings,
)

log = logging.getLogger("lenbatch")


def register(sub: Any) -> None:
    """Add the `serve` subcommand."""
    p = sub.add_parser(
        "serve",
        help="serve one or several models over HTTP (embeddings, rerank, score, classify, "
        "completions)",
        description="Serve a model with length-bucketed dynamic batching. Settings merge, "
        "lowest first: defaults, --config FILE (TOML/YAML), LENBATCH_<SECTION>__<FIELD> "
        "environment variables, then these flags.",
    )
    p.add_argument(
        "--model",
        action="append",
        help="'minilm' (bundled all-MiniLM-L6-v2, the default), 'smollm2' (the demo LLM, "
        "SmolLM2-135M-Instruct), a path to a local Hugging Face model folder, or a .gguf file. "
        "Causal LMs (config.json architectures *ForCausalLM / *LMHeadModel) are served with "
        "/v1/completions and /v1/chat/completions, *ForSequenceClassification folders with "
        "/v1/rerank, /v1/score (one label) and /classify, other models with /v1/embeddings. "
        "Give it several times to serve several models in one process (each request's "
        "`model` field picks one; they share the CPU)",
    )
    p.add_argument(
        "--served-model-name",
        action="append",
        metavar="NAME",
        help="the name clients call the model by (default: its folder's name; minilm: "
        "all-MiniLM-L6-v2); with several --model, give it once per --model, in the same order",
    )
    p.add_argument(
        "--default-prompt-name",
        metavar="NAME",
        help="embedding models: the sentence-transformers prompt (config_sentence_transformers"
        ".json) put before inputs whose call names no prompt_name or input_type (default: the "
        "folder's default_prompt_name, if any)",
    )
    p.add_argument("--config", metavar="FILE", help="config file (.toml, .yaml)")
    p.add_argument(
        "--strategy",
        choices=[s.value for s in Strategy],
        help="batching strategy (default: bucketed)",
    )
    add_batching_options(p)
    add_adaptive_options(p)
    g = p.add_argument_group("text generation (causal LMs)")
    g.add_argument(
        "--decode-mode",
        choices=DecodeMode.choices(),
        help="lockstep per-bucket batches (alias: static) or continuous batching (default "
        "continuous)",
    )
    g.add_argument(
        "--max-running",
        type=int,
        help="continuous: most sequences decoding at once (default 64)",
    )
    g.add_argument(
        "--step-tokens",
        type=int,
        help="continuous: token budget per step; longer prefills are chunked (default 256)",
    )
    g.add_argument(
        "--tool-call-parser",
        choices=["hermes", "pythonic"],
        help="the model's own tool-call format, read out of its text under tool_choice auto "
        "(hermes: <tool_call>{...}</tool_call> blocks; pythonic: [f(a=1)]); default none: "
        "auto is refused",
    )
    g.add_argument(
        "--prefix-cache-mb",
        type=int,
        help="most MiB of prompt prefixes' keys and values kept for prompts that start the "
        "same way (a shared system prompt prefills once); 0: off (default 512)",
    )
    g.add_argument(
        "--compile",
        action="store_true",
        default=None,
        help="fixed shapes (bucket bound x row class, row class x cache width) compiled with "
        "torch.compile at start-up; off by default: on a 2-core AVX2 CPU it costs minutes per "
        "shape and was slower (bench/results/llm_decode_cpu.md)",
    )
    p.add_argument("--host", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="TCP port (default 8000)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (all but /health)")
    p.add_argument(
        "--length-log",
        metavar="FILE",
        help="append a privacy-safe JSONL log of lengths and timings",
    )
    p.add_argument(
        "--truncate",
        action="store_true",
        default=None,
        help="truncate overlong inputs by default instead of rejecting them",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        metavar="S",
        help="default deadline per request in seconds; expired requests get 504 "
        "(default: none; the X-Request-Timeout header sets it per call)",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        metavar="S",
        help="on SIGTERM, how long admitted requests may take to finish (default 30)",
    )
    p.add_argument("--device", help="torch device (default cpu)")
    add_precision_options(p)
    add_quantize_option(p)
    p.add_argument(
        "--cost",
        metavar="FILE|auto|URL|generic",
        help="this deployment's cost model (JSON from `lenbatch profile` or `calibrate`; "
        "'auto': the one measured on this processor with this dtype/execution, from the "
        "user's cache ($XDG_CACHE_HOME/lenbatch, or $LENBATCH_CACHE_DIR), else "
        "$LENBATCH_COST_DIR (default the checkout's bench/results/), else, for strategy "
        "adaptive, measured at start-up (at most 30 s) and cached; or a live adaptive "
        "server's URL, its online fit; 'generic': a generic CPU guess, instant start): seeds "
        "adaptive's online cost model, which then learns from the engine's own batches "
        "(strategy adaptive without --cost: as 'auto'); start-up warns when a file was "
        "measured on another processor",
    )
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    p.add_argument(
        "--access-log",
        action="store_true",
        default=None,
        help="log one line per HTTP request (client, method, path, status; never a body); "
        "off by default: it costs the event loop CPU on every request",
    )
    p.add_argument(
        "--allocator",
        choices=["auto", "tcmalloc", "system"],
        help="the process's malloc (default auto: tcmalloc where installed, the server "
        "re-executing itself once with it preloaded, else glibc's; 'system': as launched)",
    )
    r = p.add_argument_group("scale-out on Ray Serve (needs `pip install 'lenbatch[ray]'`)")
    r.add_argument(
        "--ray",
        action="store_true",
        help="serve N lenbatch engine replicas behind a length-aware router on Ray Serve: a "
        "local Ray on 127.0.0.1, or the cluster at RAY_ADDRESS (embeddings, or completions and "
        "chat for a causal LM, routed by prompt length)",
    )
    r.add_argument("--replicas", type=int, default=2, help="--ray: engine replicas (default 2)")
    r.add_argument(
        "--ray-routing",
        choices=["length", "pow2"],
        default="length",
        help="--ray: route each input to the replica owning its length range (default), or "
        "Ray's default policy, power of two choices (for comparison)",
    )
    r.add_argument(
        "--ray-groups",
        type=int,
        help="--ray: length ranges the replicas are split into (default: one per replica; "
        "fewer gives each range several replicas)",
    )
    r.add_argument(
        "--ray-spill-wait",
        type=float,
        default=0.2,
        metavar="S",
        help="--ray: send a call outside its length range when its owners' expected queue wait "
        "(model seconds in flight, from the cost model fitted on the replicas' batches) exceeds "
        "another replica's by more than S seconds (default 0.2)",
    )
    r.add_argument(
        "--replica-threads",
        type=int,
        default=1,
        help="--ray: torch threads and Ray CPUs per replica (default 1)",
    )
    p.set_defaults(run=run)


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Merge config file, environment and flags into validated settings. Several `--model`
    flags become `[[models]]` entries (each with the model flags given), named in order by
    `--served-model-name`."""
    names = _as_list(args.model)
    served = _as_list(getattr(args, "served_model_name", None))
    if served and len(served) != len(names):
        raise ValueError(
            f"--served-model-name is given {len(served)} times for {len(names)} --model: "
            "give one per --model, in the same order"
        )
    model: dict[str, Any] = {
        "truncate": args.truncate,
        "device": args.device,
        "dtype": args.dtype,
        "quantization": args.quantize,
        "execution": args.execution,
        "cost_model": args.cost,
        "default_prompt_name": getattr(args, "default_prompt_name", None),
    }
    several: list[dict[str, Any]] | None = None
    if len(names) > 1:
        given = {k: v for k, v in model.items() if v is not None}
        several = [
            {"name": n, **given, "served_name": served[i] if served else None}
            for i, n in enumerate(names)
        ]
        several = [{k: v for k, v in entry.items() if v is not None} for entry in several]
        model = {}
    else:
        model["name"] = names[0] if names else None
    overrides: dict[str, Any] = {
        "model": model,
        "batching": {"strategy": args.strategy, **batching_overrides(args)},
        "generation": {
            "mode": args.decode_mode,
            "max_running": args.max_running,
            "step_tokens": args.step_tokens,
            "prefix_cache_mb": args.prefix_cache_mb,
            "tool_call_parser": args.tool_call_parser,
            "compile": args.compile,
        },
        "server": {
            "host": args.host,
            "port": args.port,
            "api_key": args.api_key,
            "length_log": args.length_log,
            "log_level": args.log_level,
            "access_log": args.access_log,
            "allocator": args.allocator,
            "drain_timeout_s": args.drain_timeout,
            "served_model_name": served[0] if len(served) == 1 and several is None else None,
        },
        "admission": {"request_timeout_s": args.request_timeout},
        "adaptive": adaptive_overrides(args),
    }
    if several is not None:
        overrides["models"] = several
    return load_settings(args.config, os.environ, overrides)


def _as_list(value: Any) -> list[str]:
    """A flag given once, several times (`append`), or not at all, as a list."""
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def run(args: argparse.Namespace) -> int:
    """Load the model (or each of several), build the engines and app, and run uvicorn until
    stopped."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    settings = settings_from_args(args)
    models = settings.served_models()
    if getattr(args, "ray", False):
        models = (_one_model(settings),)  # --ray serves one model: refuse a list first
    for m in models:
        _check_task_and_quantization(m)
    allocator = _choose_allocator(settings.server.allocator, getattr(args, "argv", None))
    logging.basicConfig(
        level=settings.server.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    log.info("memory allocator: %s", allocator)
    from lenbatch.serving.lengthlog import LengthLog
    from lenbatch.serving.server import serve_app

    if getattr(args, "ray", False):
        return _run_ray(args, settings.for_model(models[0]))
    length_log = LengthLog(settings.server.length_log) if settings.server.length_log else None
    if len(models) == 1:
        one = settings.for_model(models[0])
        built = build_model(one, length_log, alone=True)
        serve_app(built.app, built.engine, one)
        return 0
    from lenbatch.serving.budget import ComputeBudget
    from lenbatch.serving.multi import build_router

    served = []
    for m in models:
        built = build_model(settings.for_model(m), length_log)
        served.append(built)
    names = [b.name for b in served]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(
            f"several models would be served as {', '.join(map(repr, dupes))}: give each a "
            "distinct --served-model-name (or served_name in its [[models]] table)"
        )
    budget = ComputeBudget()
    for b in served:
        b.engine.use_budget(budget, b.name)
    app, group = build_router(served, settings, budget)
    log.info("serving %d models on one CPU budget: %s", len(served), ", ".join(names))
    serve_app(app, group, settings)
    return 0


def _choose_allocator(choice: str, argv: list[str] | None) -> str:
    """`lenbatch.runners.allocator.choose` for this command line (`argv`: its arguments; None
    where `main` was called with parsed arguments: then it goes on as launched)."""
    from lenbatch.runners.allocator import choose

    # `-c`, not `-m lenbatch.cli.main`: runpy warns when the package already imported main.
    entry = "import sys; from lenbatch.cli.main import main; sys.exit(main())"
    command = None if argv is None else [sys.executable, "-c", entry, *argv]
    return choose(choice, command)


def _one_model(settings: Settings) -> ModelConfig:
    """The one model `--ray` serves; several are refused, naming them."""
    models = settings.served_models()
    if len(models) > 1:
        names = ", ".join(repr(m.served_name or m.name) for m in models)
        raise ValueError(
            f"the config lists {len(models)} models ({names}): --ray serves one model; serve "
            "several in one process without --ray"
        )
    return models[0]


def _check_task_and_quantization(m: ModelConfig) -> None:
    """Refuse, before loading, a task this server does not serve for the model and a
    quantization its runner does not implement (neither is ever silently ignored)."""
    task = m.task
    quantized = m.quantization not in (Quantization.NONE, Quantization.AUTO)
    if task is ModelTask.AUTO and not quantized:
        return
    from lenbatch.runners.causal import resolve_causal_model

    causal = resolve_causal_model(m.name) is not None
    if task in (ModelTask.SCORE, ModelTask.CLASSIFY):
        from lenbatch.runners.tasks import resolve_task

        found = resolve_task(m.name, ModelTask.AUTO)
        if found not in (ModelTask.SCORE, ModelTask.CLASSIFY):
            raise ValueError(
                f"task {task.value}: {m.name!r} has no *ForSequenceClassification head "
                f"(its config.json says {found.value})"
            )
    if task is ModelTask.GENERATE and not causal:
        raise ValueError(f"task generate: {m.name!r} is not a causal LM")
    if task is ModelTask.EMBED and causal:
        raise ValueError(f"task embed: {m.name!r} is a causal LM (serve it with task generate)")
    if quantized:
        from lenbatch.runners.hardware import check_quantization, runner_quantizations

        runner: type
        if causal:
            from lenbatch.runners.causal import CausalLMRunner as runner
        else:
            from lenbatch.runners.encoder import EncoderRunner as runner
        check_quantization(m.quantization.value, runner.__name__, runner_quantizations(runner))
        if not causal:
            from lenbatch.runners.encoder import encoder_precision

            encoder_precision(m.dtype, m.device, m.quantization.value)  # int8 beside bfloat16


def _run_ray(args: argparse.Namespace, settings: Settings) -> int:
    """`--ray`: the Ray Serve app (lenbatch.scaleout) with the same settings."""
    if args.replicas < 1 or args.replica_threads < 1:
        log.error("--replicas and --replica-threads must be at least 1")
        return 2
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        log.error("--ray needs Ray Serve: pip install 'lenbatch[ray]'")
        return 2
    from lenbatch.scaleout.app import RayOptions, run

    options = RayOptions(
        replicas=args.replicas,
        groups=args.ray_groups,
        routing=args.ray_routing,
        threads=args.replica_threads,
        spill_wait=args.ray_spill_wait,
    )
    return run(settings, options)
