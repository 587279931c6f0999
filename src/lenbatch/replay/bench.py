"""`lenbatch bench`: replay the same traffic against every strategy and the peers, in one run.

For each target — a `lenbatch serve --strategy S` process or a peer server — and each rate:
start it on a free loopback port, wait for `/health`, send a few warm-up requests, replay the
plan open-loop, read `/stats`, stop it with SIGTERM (its whole process group if it lingers),
and keep the summary and per-request columns. The server's process-tree RSS is sampled while
it runs, so every target's peak memory is measured the same way. Then `report.write_report`.

The request bodies are built once, before any server starts, so every target gets the very
same requests at the very same offsets.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from lenbatch.replay.driver import ReplayPlan, ReplayResult, replay, summarize_replay
from lenbatch.replay.endpoints import Endpoint
from lenbatch.replay.peers.external import (
    OFFLINE_ENV,
    ExternalPeer,
    PeerContext,
    PeerVenv,
    peers_dir,
)
from lenbatch.replay.report import RunRecord, write_report

__all__ = [
    "BenchConfig",
    "ServerProcess",
    "Target",
    "machine_description",
    "prepare_target",
    "run_bench",
    "targets_for",
]

Predictor = Callable[[str, float], dict[str, Any] | None]  # (strategy, rate) -> summary


@dataclass(frozen=True)
class Target:
    """A server to benchmark: a lenbatch strategy or a peer.

    A peer from another project (`external`) has no command line until `prepare_target`
    has made its venv and asked it how to launch; then `argv`, `env`, `health_path` and
    `info` (versions, flags, install record: for the report) are filled in.
    """

    name: str
    kind: str  # "strategy" or "peer"
    argv: tuple[str, ...]  # command line; "{port}" is replaced by the port
    env: tuple[tuple[str, str], ...] = ()  # added to the environment
    health_path: str = "/health"
    external: ExternalPeer | None = field(default=None, compare=False)
    info: dict[str, Any] = field(default_factory=dict, compare=False)

    def command(self, port: int) -> list[str]:
        """The command line for `port`."""
        return [a.replace("{port}", str(port)) for a in self.argv]


_CLI = ("-c", "import sys; from lenbatch.cli import main; sys.exit(main())")


def targets_for(
    strategies: Sequence[str],
    peers: Sequence[str],
    *,
    model: str = "minilm",
    max_batch: int = 32,
    max_wait_ms: float = 10.0,
    serve_args: Sequence[str] = (),
) -> list[Target]:
    """Targets for the given strategies and peers, all with the same batch size and wait."""
    from lenbatch.config import Strategy
    from lenbatch.replay.peers.registry import EXTERNAL_PEERS, PEERS, external_peer

    out = []
    for s in strategies:
        Strategy.parse(s)
        argv = (
            sys.executable, *_CLI, "serve", "--model", model, "--strategy", s,
            "--port", "{port}", "--max-batch", str(max_batch), "--max-wait-ms", f"{max_wait_ms:g}",
            "--log-level", "warning", *serve_args,
        )  # fmt: skip
        out.append(Target(s, "strategy", argv))
    for p in peers:
        if p in EXTERNAL_PEERS:
            out.append(Target(p, "peer", (), external=external_peer(p)))
            continue
        if p not in PEERS:
            known = ", ".join([*PEERS, *EXTERNAL_PEERS])
            raise ValueError(f"unknown peer {p!r}; choose from: {known}")
        argv = (sys.executable, "-m", PEERS[p], "--model", model, "--port", "{port}")
        if p == "ray":
            argv += ("--max-batch", str(max_batch), "--max-wait-ms", f"{max_wait_ms:g}")
        out.append(Target(p, "peer", argv))
    return out


def prepare_target(
    target: Target,
    *,
    model: str,
    endpoint: str,
    max_batch: int,
    log: Callable[[str], None] = print,
    root: Path | None = None,
) -> Target:
    """The target ready to launch: for a peer from another project, its venv made (first use
    only: minutes) and its launch command, environment and report record filled in."""
    peer = target.external
    if peer is None or target.argv:  # a lenbatch target, or one prepared already
        return target
    if endpoint not in peer.endpoints:
        raise ValueError(
            f"peer {target.name} serves {', '.join(peer.endpoints)}, not {endpoint} "
            "(see --endpoint)"
        )
    venv = PeerVenv(peer.venv, root or peers_dir())
    record = venv.ensure(log)
    ctx = PeerContext(
        model=model, endpoint=endpoint, max_batch=max_batch, python=venv.python, venv=venv.path
    )
    launch = peer.launch(ctx)
    env = {**OFFLINE_ENV, **launch.env}
    info = {
        "versions": record.get("versions", {}),
        "python": record.get("python"),
        "requirements": record.get("requirements", []),
        "uninstalled": record.get("uninstalled", []),
        "install_s": record.get("install_s"),
        "disk_mb": record.get("disk_mb"),
        "env": env,
        "notes": list(launch.notes),
    }
    return replace(
        target, argv=launch.argv, env=tuple(env.items()), health_path=launch.health_path, info=info
    )


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tree_rss(root: int) -> int:
    """Resident bytes of `root` and all its descendants (Linux /proc; 0 elsewhere)."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
    try:
        entries = os.listdir("/proc")
    except OSError:
        return 0
    for e in entries:
        if not e.isdigit():
            continue
        try:
            with open(f"/proc/{e}/stat", encoding="ascii", errors="replace") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid = int(e)
        children.setdefault(int(fields[1]), []).append(pid)  # field 4: ppid
        rss[pid] = int(fields[21]) * page  # field 24: rss in pages
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += rss.get(pid, 0)
        todo.extend(children.get(pid, []))
    return total


def _cpu_seconds(stat_path: str) -> float | None:
    """utime + stime of a /proc stat file, in seconds; None if unreadable."""
    try:
        with open(stat_path, encoding="ascii", errors="replace") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # fields 14, 15


class ServerProcess:
    """A server subprocess in its own process group, with a peak-RSS sampler."""

    def __init__(self, target: Target, port: int, log_path: Path) -> None:
        self.target = target
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        env = dict(os.environ, HF_HUB_OFFLINE="1", RAY_USAGE_STATS_ENABLED="0")
        if target.external is not None:  # another project's venv: nothing of lenbatch's
            for key in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME"):
                env.pop(key, None)
        env.update(dict(target.env))
        self._log = log_path.open("wb")
        self.proc = subprocess.Popen(
            target.command(port),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own group, so stop() can end every child it made
            env=env,
        )
        self.peak_rss = 0
        self._stop_sampling = threading.Event()
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()

    def _sample(self) -> None:
        while not self._stop_sampling.wait(0.25):
            self.peak_rss = max(self.peak_rss, _tree_rss(self.proc.pid))

    def cpu_seconds(self) -> dict[str, float] | None:
        """CPU seconds so far of the server's main thread (for `lenbatch serve`, its event
        loop: HTTP, JSON, tokenization, scheduling) and of its whole process; None where
        /proc cannot tell."""
        pid = self.proc.pid
        loop = _cpu_seconds(f"/proc/{pid}/task/{pid}/stat")
        process = _cpu_seconds(f"/proc/{pid}/stat")
        if loop is None or process is None:
            return None
        return {"loop_s": loop, "process_s": process}

    def log_tail(self, n: int = 2000) -> str:
        """The end of the server's output."""
        try:
            return self.log_path.read_bytes()[-n:].decode("utf-8", errors="replace")
        except OSError:
            return ""

    def wait_ready(self, timeout_s: float = 300.0) -> float:
        """Poll the target's health path until 200; returns seconds waited. Raises if the
        process exits."""
        t0 = time.monotonic()
        with httpx.Client(base_url=self.url, trust_env=False, timeout=5.0) as c:
            while time.monotonic() - t0 < timeout_s:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"{self.target.name} exited with {self.proc.returncode} before it was "
                        f"ready; its log ends:\n{self.log_tail()}"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if c.get(self.target.health_path).status_code == 200:
                        return time.monotonic() - t0
                time.sleep(0.25)
        raise RuntimeError(f"{self.target.name} not ready after {timeout_s:g} s")

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM, wait, then SIGKILL the whole group; nothing it started is left running."""
        self._stop_sampling.set()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout_s)
        pgid = self.proc.pid  # start_new_session: the group id is the leader's pid
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(pgid, 0)  # anyone left in the group?
            except ProcessLookupError:
                break
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, sig)
            time.sleep(2.0)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()
        return self.proc.returncode


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
    finds uvloop/httptools (the Ray extra installs them; they speed up every server)."""
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
                    _scaled(cfg.plan, rate),
                    cfg.endpoint,
                    clients=cfg.clients,
                    timeout_s=cfg.timeout_s,
                    max_in_flight=cfg.max_in_flight,
                    progress=cfg.progress,
                )
            )
            cpu_after = server.cpu_seconds()
            peak = max(server.peak_rss, _tree_rss(server.proc.pid))
            summary = summarize_replay(result, boundaries=cfg.boundaries, max_length=cfg.max_length)
            summary["server_reported_peak_rss_mb"] = summary["peak_memory_mb"]
            summary["peak_memory_mb"] = peak / 2**20 if peak else None
            summary["startup_s"] = ready_s
            summary["server_started_for_this_run"] = len(rates) == 1
            # The server's CPU time during the replay: the calibration's per-request CPU share.
            summary["server_cpu"] = (
                {k: cpu_after[k] - cpu_before[k] for k in cpu_after}
                if cpu_before is not None and cpu_after is not None
                else None
            )
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
