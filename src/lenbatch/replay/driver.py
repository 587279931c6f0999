"""Open-loop load driver: send each request of a trace at its timestamp, whatever the server does.

    trace ─► ReplayPlan (bodies built before the run) ─► replay() ─► ReplayResult ─► summary()

Open loop means a slow server never delays later sends: every request is launched at its
scheduled time as its own task, so queueing shows up as latency, not as a lower offered rate.
The run is bounded: by the plan's length, a per-request timeout, and a cap on requests in
flight (a request that would exceed it is not sent and counts as a client-side error).

The driver shares the CPUs with the server under test, so it is built to stay cheap: bodies are
serialised before the run, answers are not decoded beyond their status (except streamed
completions), and the HTTP client is aiohttp's: with ~3,000 requests in flight,
`httpx.AsyncClient`s cost 2.5 ms of CPU per request (1.2 ms spread over 256 clients: their pools
are searched connection by connection) and aiohttp's 0.5 ms, which left the server under test
~25 % more of the two cores it shared with the driver (bench/results/waterfall-long.md). It
measures itself: CPU time used during the run and how late each send was.
"""

from __future__ import annotations

import asyncio
import contextlib
import resource
import ssl
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import numpy as np

from lenbatch.plan.summary import OUTCOME_ERROR
from lenbatch.plan.trace import FloatArray, IntArray, Trace
from lenbatch.replay.endpoints import CallResult, Endpoint
from lenbatch.replay.results import ReplayResult, summarize_replay

__all__ = [
    "ReplayPlan",
    "ReplayResult",
    "fetch_stats",
    "plan_from_trace",
    "replay",
    "summarize_replay",
]


@dataclass(frozen=True)
class ReplayPlan:
    """What to send and when: one serialised body per request, sorted by send time."""

    scheduled: FloatArray  # seconds from the start of the run
    lengths: IntArray  # real input tokens of each body (checked with the model's tokenizer)
    bodies: list[bytes]
    output_lengths: IntArray | None = None
    notes: tuple[str, ...] = ()
    span_s: float | None = None  # seconds the plan covers at rate x1 (`--span`), if fixed

    def __len__(self) -> int:
        return len(self.bodies)


def plan_from_trace(
    trace: Trace,
    endpoint: Endpoint,
    inputs: list[str] | list[list[int]],
    lengths: IntArray,
    *,
    duration_s: float | None = None,
    notes: tuple[str, ...] = (),
    span_s: float | None = None,
) -> ReplayPlan:
    """A plan from a mapped trace and its pre-built inputs (see `replay.bodies.TextBuilder`).
    `duration_s` keeps only requests scheduled before it; `span_s` is the stretch of time the
    plan stands for (a fixed window of the trace), kept for offered-rate figures."""
    if trace.arrivals is None:
        raise ValueError("this trace has no timestamps; use a scenario to give it arrivals")
    if len(inputs) != len(trace):
        raise ValueError(f"{len(inputs)} inputs for a trace of {len(trace)} requests")
    keep = np.ones(len(trace), dtype=bool)
    if duration_s is not None:
        keep = trace.arrivals < duration_s
    idx = np.flatnonzero(keep)
    outs = None if trace.output_lengths is None else trace.output_lengths[idx]
    bodies = [
        endpoint.body(inputs[i], None if outs is None else int(outs[j]))
        for j, i in enumerate(idx.tolist())
    ]
    extra = () if duration_s is None else (f"first {duration_s:g} s: {len(idx)} requests",)
    return ReplayPlan(
        scheduled=trace.arrivals[idx].astype(np.float64),
        lengths=np.asarray(lengths, dtype=np.int64)[idx],
        bodies=bodies,
        output_lengths=outs,
        notes=(*trace.notes, *notes, *extra),
        span_s=span_s,
    )


def _raise_fd_limit(wanted: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


async def fetch_stats(session: aiohttp.ClientSession, base: str) -> dict[str, Any] | None:
    """The server's `GET /stats` JSON at `base`, or None if it has none."""
    try:
        async with session.get(base + "/stats", timeout=aiohttp.ClientTimeout(10.0)) as resp:
            if resp.status != 200:
                return None
            data = await resp.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None
    return data if isinstance(data, dict) else None


async def replay(
    url: str,
    plan: ReplayPlan,
    endpoint: Endpoint,
    *,
    clients: int = 16,
    timeout_s: float = 60.0,
    max_in_flight: int = 4096,
    progress: bool = True,
    lead_s: float = 0.2,
) -> ReplayResult:
    """Send `plan` to the server at `url` open-loop and collect every answer.

    Each request is sent at `start + scheduled[i]` on client `i % clients`, never waiting for
    earlier answers. A request gets `timeout_s` to complete; one that would push the number in
    flight over `max_in_flight` is not sent and is recorded as an error.
    """
    from tqdm import tqdm

    if clients < 1:
        raise ValueError(f"clients must be at least 1, got {clients}")
    n = len(plan)
    _raise_fd_limit(max_in_flight + 256)
    base = url.rstrip("/")
    tls = ssl.create_default_context()  # built once: each client building its own costs ~0.1 s
    # No connection cap in the clients (the driver caps requests in flight) and no client
    # timeout (each request gets `timeout_s` below).
    pool = [
        aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, ssl=tls),
            timeout=aiohttp.ClientTimeout(total=None),
        )
        for _ in range(clients)
    ]
    sent = np.full(n, np.nan)
    done = np.full(n, np.nan)
    first = np.full(n, np.nan)
    status = np.zeros(n, dtype=np.int64)
    outcomes = np.full(n, OUTCOME_ERROR, dtype=np.int64)
    out_tokens = np.zeros(n, dtype=np.int64)
    errors: list[str | None] = [None] * n
    gaps: list[float] = []
    bar = tqdm(total=n, unit="req", mininterval=1.0, disable=not progress, desc="replay")
    in_flight = 0
    t0 = 0.0

    async def one(i: int, client: aiohttp.ClientSession) -> None:
        nonlocal in_flight
        start = time.perf_counter()
        sent[i] = start - t0
        try:
            async with asyncio.timeout(timeout_s):
                res: CallResult = await endpoint.call(client, base, plan.bodies[i])
            status[i] = res.status
            outcomes[i] = res.outcome
            errors[i] = res.error
            done[i] = res.done - t0
            out_tokens[i] = res.output_tokens
            if res.first_token is not None:
                first[i] = res.first_token - t0
            gaps.extend(res.token_gaps)
        except TimeoutError:
            errors[i] = f"timeout: no complete answer within {timeout_s:g} s"
            done[i] = time.perf_counter() - t0
        except aiohttp.ClientError as exc:
            errors[i] = f"transport error: {type(exc).__name__}"
            done[i] = time.perf_counter() - t0
        finally:
            in_flight -= 1
            bar.update(1)

    stats_before = await fetch_stats(pool[0], base)
    tasks: list[asyncio.Task[None]] = []
    cpu0 = time.process_time()
    t0 = time.perf_counter() + lead_s
    try:
        for i in range(n):
            delay = t0 + plan.scheduled[i] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if in_flight >= max_in_flight:
                errors[i] = f"not sent: {max_in_flight} requests already in flight (driver cap)"
                bar.update(1)
                continue
            in_flight += 1
            tasks.append(asyncio.create_task(one(i, pool[i % clients])))
        if tasks:
            await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        wall = time.perf_counter() - t0
        cpu = time.process_time() - cpu0
        bar.close()
        stats_after = await fetch_stats(pool[0], base)
        for c in pool:
            await c.close()
    return ReplayResult(
        scheduled=plan.scheduled.astype(np.float64),
        sent=sent,
        done=done,
        lengths=plan.lengths,
        status=status,
        outcomes=outcomes,
        errors=errors,
        first_token=first,
        output_tokens=out_tokens,
        token_gaps=np.asarray(gaps, dtype=np.float64),
        wall_s=wall,
        driver_cpu_s=cpu,
        clients=clients,
        stats_before=stats_before,
        stats_after=stats_after,
        notes=list(plan.notes),
    )
