"""`lenbatch bench`: replay the same traffic against every strategy and the peers, in one run.

For each target (`replay.targets`: a `lenbatch serve --strategy S` process or a peer server) and
each rate: start it on a free loopback port and wait for its health path (`replay.process`),
send a few warm-up requests, replay the plan open-loop, read `/stats`, stop it, and keep the
summary and per-request columns. The server's process-tree RSS is sampled while it runs, so
every target's peak memory is measured the same way. Then `report.write_report`.

The request bodies are built once, before any server starts, so every target gets the very
same requests at the very same offsets. Each rate of a sweep may have its own bodies
(`BenchConfig.rate_plans`: the same offsets and lengths, other text), so that a server that
caches prompt prefixes answers no rate from what an earlier one sent it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from lenbatch.replay.driver import ReplayPlan, ReplayResult, replay, summarize_replay
from lenbatch.replay.endpoints import Endpoint
from lenbatch.replay.process import ServerProcess, free_port, tree_rss
from lenbatch.replay.records import RunRecord
from lenbatch.replay.report import write_report
from lenbatch.replay.targets import Target, prepare_target

__all__ = [
    "BenchConfig",
    "lengths_summary",
    "machine_description",
    "run_bench",
    "run_on_one_server",
    "run_one",
    "software_description",
]

Predictor = Callable[[str, float], dict[str, Any] | None]  # (strategy, rate) -> summary


@dataclass
class BenchConfig:
    """One `lenbatch bench` run."""

    plan: ReplayPlan
    endpoint: Endpoint
    targets: list[Target]
    report_dir: Path
    rates: Sequence[float] = (1.0,)
    clients: int = 16
    timeout_s: float = 60.0
    max_in_flight: int = 4096
    boundaries: tuple[int, ...] | None = None  # per-bucket rows of the report
    max_length: int | None = None
    warmup: Sequence[bytes] = ()
    predictor: Predictor | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    progress: bool = True
    model: str = "minilm"  # what peers from other projects are launched with
    max_batch: int = 32
    keep_server: bool = False  # start each target once for the whole rate sweep
    # One plan per rate of `rates` (see `cli.traffic.Traffic.rate_plans`); empty: `plan` at
    # every rate.
    rate_plans: Sequence[ReplayPlan] = ()

    def plan_at(self, rate: float) -> ReplayPlan:
        """What is replayed at `rate`: its own plan where the sweep has one, else `plan`."""
        if self.rate_plans and rate in self.rates:
            return self.rate_plans[list(self.rates).index(rate)]
        return self.plan


def machine_description() -> str:
    """CPU model, core count, memory and load average, for the report."""
    model = "unknown CPU"
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    mem = ""
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo", encoding="utf-8") as f:
        kb = int(f.readline().split()[1])
        mem = f", {kb / 2**20:.0f} GiB RAM"
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    cores = os.cpu_count()
    return f"{model}, {cores} cores{mem}; load average at start {load}"


def software_description() -> str:
    """Versions that change the figures: Python, torch, transformers, and whether uvicorn
    finds uvloop/httptools (httptools is a dependency, the Ray extra installs uvloop; they
    speed up every server)."""
    import importlib.metadata as md
    import platform

    def version(name: str) -> str:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return "absent"

    return (
        f"Python {platform.python_version()}, torch {version('torch')}, transformers "
        f"{version('transformers')}, uvicorn {version('uvicorn')} (uvloop {version('uvloop')}, "
        f"httptools {version('httptools')}), ray {version('ray')}"
    )


def _scaled(plan: ReplayPlan, rate: float) -> ReplayPlan:
    if rate == 1.0:
        return plan
    return replace(plan, scheduled=plan.scheduled / rate, notes=(*plan.notes, f"rate x{rate:g}"))


def _cpu_spent(
    before: dict[str, float] | None, after: dict[str, float] | None
) -> dict[str, float] | None:
    """The server's CPU seconds between two readings; None where /proc could not tell."""
    if before is None or after is None:
        return None
    spent = {k: after[k] - before[k] for k in after}
    # The process's figure counts whole clock ticks and the loop's nanoseconds: the process
    # spent at least what its loop did.
    spent["process_s"] = max(spent["process_s"], spent["loop_s"])
    return spent


def _offered_rps(plan: ReplayPlan, rate: float) -> float | None:
    """Requests per second the plan offers at `rate`: over its span when it has one (a fixed
    stretch of trace time), else from the first to the last send."""
    span = plan.span_s
    if span is None and len(plan) > 1:
        span = float(plan.scheduled[-1] - plan.scheduled[0])
    if not span:
        return None
    return len(plan) * rate / span


def _warm_up(url: str, endpoint: Endpoint, bodies: Sequence[bytes]) -> None:
    with httpx.Client(base_url=url, trust_env=False, timeout=120.0) as c:
        for b in bodies:
            c.post(endpoint.path, content=b, headers={"content-type": "application/json"})


def run_one(cfg: BenchConfig, target: Target, rate: float) -> RunRecord:
    """Start `target`, replay the plan at `rate`, stop it; its record (saved as JSON too)."""
    return run_on_one_server(cfg, target, [rate])[0]


def run_on_one_server(cfg: BenchConfig, target: Target, rates: Sequence[float]) -> list[RunRecord]:
    """Start `target` once, replay the plan at each rate in turn (warm-up once, first), stop
    it; one record per rate (each saved as JSON too). Peak RSS is sampled per run, so a later
    run's figure includes what the server kept from the earlier ones."""
    runs = cfg.report_dir / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    tags = [target.name if rate == 1.0 else f"{target.name}@x{rate:g}" for rate in rates]
    server = ServerProcess(target, free_port(), runs / f"{tags[0]}.log")
    done: list[tuple[float, str, dict[str, Any], ReplayResult]] = []
    try:
        ready_s = server.wait_ready()
        _warm_up(server.url, cfg.endpoint, cfg.warmup)
        for rate, tag in zip(rates, tags, strict=True):
            server.peak_rss = 0
            cpu_before = server.cpu_seconds()
            result = asyncio.run(
                replay(
                    server.url,
                    _scaled(cfg.plan_at(rate), rate),
                    cfg.endpoint,
                    clients=cfg.clients,
                    timeout_s=cfg.timeout_s,
                    max_in_flight=cfg.max_in_flight,
                    progress=cfg.progress,
                )
            )
            cpu_after = server.cpu_seconds()
            peak = max(server.peak_rss, tree_rss(server.proc.pid))
            summary = summarize_replay(result, boundaries=cfg.boundaries, max_length=cfg.max_length)
            summary["server_reported_peak_rss_mb"] = summary["peak_memory_mb"]
            summary["peak_memory_mb"] = peak / 2**20 if peak else None
            summary["startup_s"] = ready_s
            summary["server_started_for_this_run"] = len(rates) == 1
            # The server's CPU time during the replay: the calibration's per-request CPU share.
            summary["server_cpu"] = _cpu_spent(cpu_before, cpu_after)
            summary["cpu_count"] = os.cpu_count()
            summary["offered_rps"] = _offered_rps(cfg.plan, rate)
            done.append((rate, tag, summary, result))
    finally:
        returncode = server.stop()
    records = []
    for rate, tag, summary, result in done:
        predicted = None
        if cfg.predictor is not None and target.kind == "strategy":
            predicted = cfg.predictor(target.name, rate)
        records.append(RunRecord(target.name, target.kind, rate, summary, result, predicted))
        (runs / f"{tag}.json").write_text(
            json.dumps(
                {
                    "name": target.name,
                    "kind": target.kind,
                    "rate": rate,
                    "command": target.command(server.port),
                    "env": dict(target.env),
                    "peer": target.info or None,
                    "pid": server.proc.pid,
                    "returncode": returncode,
                    "summary": summary,
                    "predicted": predicted,
                    "result": result.to_json(),
                }
            ),
            encoding="utf-8",
        )
    return records


def run_bench(cfg: BenchConfig, log: Callable[[str], None] = print) -> Path:
    """Run every target at every rate, then write the report; returns its path. Peers from
    other projects are installed (first use) and set up before anything is timed."""
    targets = [
        prepare_target(
            t, model=cfg.model, endpoint=cfg.endpoint.name, max_batch=cfg.max_batch, log=log
        )
        for t in cfg.targets
    ]
    records: list[RunRecord] = []
    if cfg.keep_server:  # one start per target, every rate against it
        batches = [(t, list(cfg.rates)) for t in targets]
    else:  # a fresh server for every run, rates outermost
        batches = [(t, [rate]) for rate in cfg.rates for t in targets]
    for target, rates in batches:
        rates_text = ", ".join(f"x{r:g}" for r in rates)
        log(f"bench: {target.name} at rate {rates_text} ({len(cfg.plan)} requests)")
        for rec in run_on_one_server(cfg, target, rates):
            s = rec.summary
            log(
                f"bench: {rec.label}: p50 {s['p50_ms'] or float('nan'):.0f} ms, "
                f"p95 {s['p95_ms'] or float('nan'):.0f} ms, "
                f"{s['real_tokens_per_s']:.0f} real tok/s, errors {s['error_rate']:.1%}"
            )
            records.append(rec)
    order = {t.name: i for i, t in enumerate(targets)}
    records.sort(key=lambda r: (cfg.rates.index(r.rate), order[r.name]))
    meta = dict(cfg.meta)
    peers = {t.name: {**t.info, "command": list(t.argv)} for t in targets if t.info}
    if peers:
        meta["peer_setup"] = peers
    meta.setdefault("machine", machine_description())
    meta.setdefault("software", software_description())
    return write_report(cfg.report_dir, records, meta)


def lengths_summary(lengths: np.ndarray[Any, Any]) -> str:
    """`n requests, p50/p95/max tokens` for the report."""
    if not len(lengths):
        return "0 requests"
    p50, p95 = np.percentile(lengths, [50, 95], method="inverted_cdf")
    return (
        f"{len(lengths)} requests, input tokens p50 {p50:.0f} / p95 {p95:.0f} / max {lengths.max()}"
    )
