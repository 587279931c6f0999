"""What `lenbatch serve` runs for each model: its runner, engine and app (`build_model`), with
the cost model the engine starts from and the CPU batch layout it runs."""

from __future__ import annotations

import logging
from typing import Any

from lenbatch.config import ModelTask, Quantization, Settings, Strategy

log = logging.getLogger("lenbatch")


def build_model(settings: Settings, length_log: Any = None, *, alone: bool = False) -> Any:
    """One model's engine and the app it has alone, as a `serving.multi.ServedModel` (what
    `serve` runs, alone or beside other models). An encoder served `alone` on a CPU takes the
    automatic batch layout where none is given (`Settings.with_cpu_layout`). Built on the
    process's torch thread (`serving.torchthread`), so the main thread, which runs the event
    loop, never starts an OpenMP pool of its own and the generation engine runs on the thread
    that loaded it."""
    from lenbatch.serving.torchthread import on_torch_thread

    return on_torch_thread(_build_model, settings, length_log, alone)


def _build_model(settings: Settings, length_log: Any = None, alone: bool = False) -> Any:
    from lenbatch.runners import load_runner
    from lenbatch.runners.causal import resolve_causal_model
    from lenbatch.runners.tasks import resolve_task
    from lenbatch.serving.multi import ServedModel

    m = settings.model
    causal = resolve_causal_model(m.name)
    if causal is not None:
        app, gen_engine = _llm_app(settings, causal, length_log)
        name = settings.server.served_model_name or gen_engine.info.name
        return ServedModel(name, ["generate"], gen_engine, app, {m.name, gen_engine.info.name})
    if alone:
        settings = _cpu_layout(settings)
        m = settings.model
    execution = m.execution
    if execution == "auto" and settings.batching.strategy is Strategy.STATIC:
        # `static` pads every batch to the model limit on purpose (the naive baseline): a
        # packed runner would compute real tokens only and hide what padding costs.
        execution = "padded"
        log.info("execution auto: padded, because strategy static pads on purpose")
    task = resolve_task(m.name, m.task)
    if task in (ModelTask.SCORE, ModelTask.CLASSIFY):
        return _build_scorer(settings, execution, length_log)
    from lenbatch.embed.api import create_app
    from lenbatch.embed.engine import Engine

    runner = load_runner(
        m.name,
        execution=execution,
        default_prompt_name=m.default_prompt_name,
        **_runner_options(m),
    )
    cost = _serve_cost(
        m.cost_model,
        m.device,
        runner,
        calibrate=settings.batching.strategy is Strategy.ADAPTIVE,
        max_tokens=settings.batching.max_batch_tokens,
    )
    engine = Engine(runner, **_engine_options(settings, length_log, cost))
    log.info(
        "model %s: max_length=%d dim=%d padding=%s",
        runner.info.name,
        runner.info.max_length,
        runner.info.dim,
        runner.info.padding_side,
    )
    _log_precision(runner)
    log.info(engine.describe())
    app = create_app(engine, settings, getattr(runner, "text", None))
    name = settings.server.served_model_name or runner.info.name
    return ServedModel(name, ["embed"], engine, app, {m.name, runner.info.name})


def _build_scorer(settings: Settings, execution: str, length_log: Any) -> Any:
    """A `*ForSequenceClassification` folder: rerank and score (one label) or classify."""
    from lenbatch.embed.score_api import create_scoring_app
    from lenbatch.embed.scoring import ScoringEngine
    from lenbatch.runners import load_runner
    from lenbatch.runners.base import ScoringRunner
    from lenbatch.serving.multi import ServedModel

    m = settings.model
    runner = load_runner(m.name, execution=execution, head=True, **_runner_options(m))
    assert isinstance(runner, ScoringRunner)
    cost = _serve_cost(m.cost_model, m.device, runner)
    engine = ScoringEngine(runner, **_engine_options(settings, length_log, cost))
    log.info(
        "model %s: max_length=%d labels=%s activation=%s",
        runner.info.name,
        runner.info.max_length,
        ",".join(runner.labels),
        runner.activation,
    )
    _log_precision(runner)
    log.info(engine.describe())
    app = create_scoring_app(engine, settings, getattr(runner, "text", None))
    name = settings.server.served_model_name or runner.info.name
    tasks = ["score", "classify"] if len(runner.labels) == 1 else ["classify"]
    card = {"labels": list(runner.labels)}
    return ServedModel(name, tasks, engine, app, {m.name, runner.info.name}, card)


def _llm_app(settings: Settings, ref: Any, length_log: Any) -> tuple[Any, Any]:
    """Load a causal LM and build the generation app (OpenAI completions)."""
    from lenbatch.generate.api import create_llm_app
    from lenbatch.generate.engine import GenerationEngine
    from lenbatch.runners.causal import CausalLMRunner

    m = settings.model
    log.info("loading causal LM %s from %s", ref.name, ref.gguf_file or ref.folder)
    runner = CausalLMRunner(
        ref.folder,
        gguf_file=ref.gguf_file,
        name=ref.name,
        **_runner_options(m),
    )
    engine = GenerationEngine(
        runner,
        settings.batching,
        settings.admission,
        settings.generation,
        length_log=length_log,
        adaptive=settings.adaptive,
    )
    log.info(
        "model %s: context=%d chat_template=%s",
        runner.info.name,
        runner.info.max_length,
        runner.has_chat_template,
    )
    _log_precision(runner)
    log.info(engine.describe())
    return create_llm_app(engine, settings, runner.text), engine


def _engine_options(settings: Settings, length_log: Any, cost: Any) -> dict[str, Any]:
    """What an encoder engine (`Engine`, `ScoringEngine`) takes besides its runner: the
    settings' sections, and the cost model it starts from (`_serve_cost`'s)."""
    return {
        "batching": settings.batching,
        "admission": settings.admission,
        "recovery": settings.recovery,
        "default_truncate": settings.model.truncate,
        "length_log": length_log,
        "adaptive": settings.adaptive,
        "cost_prior": _cost_prior(cost),
    }


def _cpu_layout(settings: Settings) -> Settings:
    """`settings` with the CPU batch layout filled in where the thread count is not given
    (`Settings.with_cpu_layout`), said in the log."""
    from lenbatch.serving.workers import usable_cores

    cores = usable_cores()
    laid = settings.with_cpu_layout(cores)
    if laid is not settings:
        log.info(
            "batch layout: %d batches at once on %d torch thread(s) each, on %d usable cores "
            "(model.torch_threads and batching.max_concurrent_batches choose another)",
            laid.batching.max_concurrent_batches,
            laid.model.torch_threads,
            cores,
        )
    return laid


def _runner_options(m: Any) -> dict[str, Any]:
    """What every runner takes from the model settings, under the settings' own names."""
    names = ("device", "max_length", "torch_threads", "dtype")
    return {**{name: getattr(m, name) for name in names}, "quantization": m.quantization.value}


def _serve_cost(
    spec: str | None, device: str, runner: Any, *, calibrate: bool = False, max_tokens: int = 8192
) -> Any:
    """The deployment's cost model (`--cost` FILE, auto, generic or a server URL; None for
    the generic prior). No `--cost` with `calibrate` (the strategy reads a cost model) is
    `auto`, `generic` is None (`plan.selfcal.serve_cost_spec`). `auto` is
    `plan.selfcal.auto_cost`: the cache, a matching file, else (`calibrate`) one measured now
    and cached. Says which was taken, and warns when a file came from another processor."""
    from lenbatch.plan.selfcal import serve_cost_spec

    spec, why = serve_cost_spec(spec, reads_cost=calibrate)
    if why:
        log.info(why)
    if not spec:
        return None
    if spec.strip().lower() == "auto":
        from lenbatch.plan.selfcal import auto_cost

        found = auto_cost(runner, device, calibrate=calibrate, max_tokens=max_tokens)
        if found is None:
            log.info("--cost auto: none measured on this processor; this strategy needs none")
            return None
        log.info("cost model: %s", found[1])
        return found[0]
    from lenbatch.plan.costmodel import processor_mismatch
    from lenbatch.plan.costsource import resolve_cost
    from lenbatch.runners.base import PackedEmbeddingRunner
    from lenbatch.runners.hardware import processor_key

    precision = getattr(runner, "precision", None)
    here = processor_key(device)
    choice = resolve_cost(
        spec,
        here,
        dtype=precision.name if precision is not None else None,
        execution="packed" if isinstance(runner, PackedEmbeddingRunner) else "padded",
        quantization=getattr(runner, "quantization", Quantization.NONE.value),
    )
    problem = processor_mismatch(choice.cost, here) if choice.from_file else None
    if problem:
        log.warning("%s: %s", choice.source, problem)
    else:
        log.info("cost model %s (%s)", choice.source, choice.reason)
    return choice.cost


def _cost_prior(cost: Any) -> Any:
    """The online cost model's prior from a cost model (None without one)."""
    if cost is None:
        return None
    from lenbatch.core.costfit import CostCoefficients

    return CostCoefficients.from_profile(cost.to_json())


def _log_precision(runner: Any) -> None:
    """Say which float type the model runs in and why (runners without one say nothing)."""
    precision = getattr(runner, "precision", None)
    if precision is not None:
        log.info("dtype %s (%s)", precision.name, precision.reason)
