"""Serving overhead: what a live server adds around the model's compute, measured from one
`lenbatch bench` run.

A cost model from `lenbatch profile` times the model alone, back to back. A live server adds:

* per batch: collation, the hand-off to the worker thread, pooling and fanning results out,
  and a model that runs slower in the server than when profiled back to back (caches gone cold
  between batches, two batches sharing the memory system, the interpreter lock). Measured as
  the server's own execution time per batch (`/stats`: the counters after a run minus those
  before) against the cost model's time for the same batch shapes (each bucket's mean batch
  size and mean padded length): a scale and a constant, `live = scale x model + constant`,
  fitted by non-negative least squares over every bucket of the run and of the same server's
  runs at other rates. A constant alone fits one light run, where every batch is about one
  row, but not a loaded one: on the Xeon (family 6 model 167) of the `adaptive-goodput`
  bench, `bucketed`'s batches took 1.9-2.4x the model's time at every rate, one row or
  twenty-five;
* per request, outside the queue: HTTP parsing, tokenization, JSON encoding, the client's own
  work. Measured as the client's median latency minus the server's own median (from arrival at
  the engine to the answer).

* how much one batch's time varies around the fit: the requests of the run that ran alone
  (nothing else in flight from their sending to their answer) were each one batch of one row,
  and their latency, less the server's median queue wait and the per-request time above, over
  the fit's time for their length gives one sample each of live / predicted. Its quantiles,
  scaled to mean 1, are `batch_spread` (`core.costfit.spread_quantiles`: at least 30 such
  requests, else none). The fit gives
  the mean batch; the spread gives the tail that a light load's P95 is made of. A run where
  too few requests ran alone (one that starts past capacity) takes the spread an `adaptive`
  server of the same report measured itself instead (`/stats`
  `adaptive.cost_model.batch_spread`: its last batches' measured / predicted times, scaled to
  mean 1 the same way): without one, every simulated batch took its mean time and the shed
  share past capacity came out ~10 points low (a Zen 3, at 2x).

* CPU time per request outside the model, on the same cores: the server's event-loop thread
  (HTTP, JSON, tokenization, scheduling) and, when it shares the machine as in `lenbatch bench`,
  the load driver. Under load this work takes a share of the cores from the model, which then
  runs `cores / (cores - rate * cpu)` times slower: what makes a server near capacity slower
  than any constant predicts.

All are measured on one run, by default at a light rate where little queues, then stored in the
cost model (`batch_overhead_s`, `request_overhead_s`, `cpu_per_request_s`, `cpu_cores`) so that
`simulate`, `sweep` and `tune` predict what a client sees. Pure: works on the run records
`lenbatch bench` writes (`runs/*.json`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from lenbatch.core.costfit import SPREAD_WINDOW, spread_quantiles
from lenbatch.plan.costmodel import CostModel
from lenbatch.serving.metrics import bucket_totals, bucket_work

__all__ = [
    "ServingOverhead",
    "calibrated",
    "measure_overhead",
    "spread_p10_p90",
    "spread_source",
]


@dataclass(frozen=True)
class ServingOverhead:
    """A live server's extra time per batch and per request over the cost model's."""

    batch_s: float  # the constant of `live = batch_scale x model + batch_s` per batch
    request_s: float
    batches: int  # batches the per-batch fit is over (every run it used)
    requests: int  # answered requests the per-request figure comes from
    source: str  # which run, for the cost model's `calibration` note
    loop_cpu_s: float | None = None  # server event-loop CPU seconds per request
    driver_cpu_s: float | None = None  # load-driver CPU seconds per request
    cores: int | None = None  # the machine's cores
    cpu_baseline_cores: float | None = None  # idle CPU (cores) the fit set apart
    cpu_runs: int = 0  # runs the CPU figures come from
    batch_scale: float = 1.0  # the scale of `live = batch_scale x model + batch_s` per batch
    batch_runs: int = 1  # runs the per-batch fit comes from
    batch_spread: tuple[float, ...] = ()  # quantiles of live / fitted batch time, mean 1
    spread_requests: int = 0  # requests that ran alone, which the spread comes from
    spread_batches: int = 0  # or: batches of an adaptive server's own spread (`/stats`)

    @property
    def cpu_per_request_s(self) -> float | None:
        """CPU seconds per request outside the model (server loop + driver), if measured."""
        if self.loop_cpu_s is None or self.driver_cpu_s is None:
            return None
        return self.loop_cpu_s + self.driver_cpu_s


def measure_overhead(
    run: Mapping[str, Any],
    cost: CostModel,
    cpu_runs: Sequence[Mapping[str, Any]] = (),
    spread_runs: Sequence[Mapping[str, Any]] = (),
) -> ServingOverhead:
    """The serving overhead seen in one bench run of a lenbatch server (a `runs/*.json` record).
    The CPU per request (when they span two or more rates) and the per-batch scale and
    constant are fitted over `run` and `cpu_runs` (the same server at other rates); the
    per-request time outside the queue comes from `run` alone; the batch spread from the
    requests of `run` that ran alone, else from the first `adaptive` server's own among `run`,
    `cpu_runs` and `spread_runs` (the report's other servers, on the same machine).

    Raises ValueError if the record lacks the server's `/stats` or ran no batch.
    """
    result = run["result"]
    cores = run.get("summary", {}).get("cpu_count")
    others = [r for r in cpu_runs if r is not run]
    cpu = _cpu_fit([run, *others])
    probe = None
    if cpu is not None and cores:
        probe = CostModel(const=0.0, cpu_per_request_s=cpu[0] + cpu[1], cpu_cores=int(cores))
    rows = _batch_rows(run, cost, probe)  # raises when the run has no /stats (a peer's)
    if not rows:
        raise ValueError(f"run {run.get('name')!r} ran no batch between its /stats readings")
    sent = np.asarray(result["sent"], dtype=np.float64)
    done = np.asarray(result["done"], dtype=np.float64)
    ok = np.asarray(result["status"]) == 200
    if not ok.any():
        raise ValueError(f"run {run.get('name')!r} has no answered request")
    client_p50 = float(np.median(done[ok] - sent[ok]))
    server_p50 = result["stats_after"].get("p50_ms")
    if server_p50 is None:
        raise ValueError(f"run {run.get('name')!r}: the server reported no latency")
    rate = run.get("rate", 1.0)
    runs_used = 1
    for other in others:
        try:
            more = _batch_rows(other, cost, probe)
        except (KeyError, TypeError, ValueError):
            continue  # a run without /stats (a peer's) says nothing about this server
        if more:
            rows += more
            runs_used += 1
    scale, constant = _batch_fit(rows)
    request_s = client_p50 - float(server_p50) / 1000.0
    spread, alone = _batch_spread(run, cost, scale, constant, request_s)
    server_batches = 0
    if not spread:
        spread, server_batches = _server_spread([run, *others, *spread_runs])
    return ServingOverhead(
        batch_s=constant,
        request_s=request_s,
        batches=int(sum(n for _, n, _ in rows)),
        requests=int(ok.sum()),
        source=f"{run.get('name')} at rate x{rate:g}",
        loop_cpu_s=None if cpu is None else cpu[0],
        driver_cpu_s=None if cpu is None else cpu[1],
        cores=int(cores) if cores else None,
        cpu_baseline_cores=None if cpu is None else cpu[2],
        cpu_runs=0 if cpu is None else cpu[3],
        batch_scale=scale,
        batch_runs=runs_used,
        batch_spread=spread,
        spread_requests=alone,
        spread_batches=server_batches,
    )


def spread_source(overhead: ServingOverhead) -> str:
    """Where `overhead.batch_spread` comes from, in words."""
    if overhead.spread_batches:
        return f"the adaptive server's own last {overhead.spread_batches} batches, its /stats"
    return f"{overhead.spread_requests} requests that ran alone"


def spread_p10_p90(spread: Sequence[float]) -> tuple[float, float]:
    """The 10th and 90th percentiles of a `batch_spread` (21 quantiles, 0 to 100 %)."""
    return spread[len(spread) // 10], spread[-1 - len(spread) // 10]


def _batch_spread(
    run: Mapping[str, Any], cost: CostModel, scale: float, constant: float, request_s: float
) -> tuple[tuple[float, ...], int]:
    """(quantiles of live / fitted batch time, mean 1; requests they come from) over the
    requests of `run` that ran alone (see the module docstring); no quantiles when the record
    has no lengths or too few requests ran alone (`core.costfit.spread_quantiles`)."""
    result = run["result"]
    lengths = result.get("lengths")
    if lengths is None:
        return (), 0
    sent = np.asarray(result["sent"], dtype=np.float64)
    done = np.asarray(result["done"], dtype=np.float64)
    ok = np.asarray(result["status"]) == 200
    order = np.argsort(sent, kind="stable")
    s, d = sent[order], done[order]
    # In flight before i: the latest answer among those sent earlier; after i: the next send.
    latest_before = np.maximum.accumulate(np.concatenate([[-np.inf], d[:-1]]))
    next_sent = np.concatenate([s[1:], [np.inf]])
    alone_sorted = (latest_before <= s) & (next_sent >= d)
    alone = np.zeros(len(sent), dtype=bool)
    alone[order] = alone_sorted
    alone &= ok & np.isfinite(done)
    wait = float(result.get("stats_after", {}).get("queue_wait_p50_ms") or 0.0) / 1000.0
    n = np.asarray(lengths, dtype=np.float64)[alone]
    fitted = scale * np.array([cost.latency(1, x) for x in n]) + constant
    live = done[alone] - sent[alone] - wait - request_s
    return tuple(spread_quantiles(np.maximum(live, 0.0) / fitted)), int(alone.sum())


def _server_spread(runs: Sequence[Mapping[str, Any]]) -> tuple[tuple[float, ...], int]:
    """(the batch spread an `adaptive` server measured itself, the batches it is over): from
    the `/stats` after the first of `runs` that has one; empty and 0 if none has."""
    for run in runs:
        stats = (run.get("result") or {}).get("stats_after") or {}
        model = (stats.get("adaptive") or {}).get("cost_model") or {}
        spread = model.get("batch_spread") or []
        if spread:
            batches = min(int(model.get("observed_batches") or 0), SPREAD_WINDOW)
            return tuple(float(x) for x in spread), batches
    return (), 0


def _batch_rows(
    run: Mapping[str, Any], cost: CostModel, probe: CostModel | None
) -> list[tuple[float, float, float]]:
    """(the cost model's seconds, batches, the server's seconds) for each bucket that ran a
    batch between the run's two `/stats` readings, the server's seconds taken back to what
    they would have been without the run's own request rate (`probe.slowdown`)."""
    result = run["result"]
    before, after = result.get("stats_before"), result.get("stats_after")
    if not before or not after:
        raise ValueError(f"run {run.get('name')!r} has no /stats before and after (a peer?)")
    slowdown = 1.0
    duration = float(result.get("wall_s") or 0.0)
    if probe is not None and duration > 0:
        slowdown = probe.slowdown(len(result["sent"]) / duration)
    rows = []
    for work in bucket_work(bucket_totals(before), bucket_totals(after)).values():
        # latency() is linear in B for a given L, so the mean batch size gives the mean time
        # exactly; the mean padded length only up to the L^2 term's spread within one bucket.
        model = work.batches * cost.latency(work.mean_batch, work.mean_padded_len)
        rows.append((model, work.batches, work.exec_s / slowdown))
    return rows


def _batch_fit(rows: Sequence[tuple[float, float, float]]) -> tuple[float, float]:
    """(scale, seconds per batch) of `live = scale x model + constant x batches` over `rows`
    (see `_batch_rows`), both non-negative. With a single bucket the two cannot be told apart:
    the scale stays 1 and the constant takes the difference, as a constant alone always did."""
    from lenbatch.plan.profile import nnls

    model = np.array([r[0] for r in rows])
    batches = np.array([r[1] for r in rows])
    live = np.array([r[2] for r in rows])
    if len(rows) < 2:
        return 1.0, max(0.0, float((live.sum() - model.sum()) / batches.sum()))
    scale, constant = nnls(np.column_stack([model, batches]), live)
    return float(scale), float(constant)


def _cpu_fit(runs: Sequence[Mapping[str, Any]]) -> tuple[float, float, float, int] | None:
    """(server-loop CPU s per request, driver CPU s per request, idle CPU in cores, runs used).

    With runs at two or more rates, CPU time = idle x wall time + per-request x requests is
    fitted by least squares, so the idle work (timers, polling) that dominates a light run is
    not charged to its requests; with one run, its CPU time divided by its requests."""
    rows = []
    for r in runs:
        res, cpu = r["result"], r.get("summary", {}).get("server_cpu")
        if cpu and res.get("driver_cpu_s") is not None and res.get("wall_s"):
            n = len(res["sent"])
            rows.append((float(res["wall_s"]), n, float(cpu["loop_s"]), float(res["driver_cpu_s"])))
    if not rows:
        return None
    rates = {round(n / wall, 3) for wall, n, _, _ in rows}
    if len(rates) == 1:
        n = sum(row[1] for row in rows)
        loop, driver = sum(row[2] for row in rows), sum(row[3] for row in rows)
        return loop / n, driver / n, 0.0, len(rows)
    a = np.array([[wall, n] for wall, n, _, _ in rows], dtype=np.float64)
    fits = []
    for col in (2, 3):
        y = np.array([row[col] for row in rows], dtype=np.float64)
        idle, per_request = np.linalg.lstsq(a, y, rcond=None)[0]
        if idle < 0 or per_request < 0:  # noise: fall back to the plain ratio
            idle, per_request = 0.0, float(y.sum() / a[:, 1].sum())
        fits.append((float(idle), float(per_request)))
    (loop_idle, loop_w), (driver_idle, driver_w) = fits
    return loop_w, driver_w, loop_idle + driver_idle, len(rows)


def calibrated(
    cost: CostModel, overhead: ServingOverhead, *, with_driver: bool = True
) -> CostModel:
    """`cost` with the measured overheads (negative measurements count as 0). Without
    `with_driver`, the load driver's CPU is left out: for predicting a server whose clients
    run elsewhere."""
    cpu = overhead.cpu_per_request_s
    if cpu is not None and not with_driver:
        cpu = overhead.loop_cpu_s
    runs = f" of {overhead.batch_runs} runs" if overhead.batch_runs > 1 else ""
    note = (
        f"{overhead.source}: batches x{overhead.batch_scale:.2f} the model's time "
        f"+{1000 * overhead.batch_s:.1f} ms (over {overhead.batches} batches{runs}), "
        f"+{1000 * overhead.request_s:.1f} ms per request (median over {overhead.requests})"
    )
    if cpu is None:
        note += "; CPU per request not measured"
    else:
        who = "server loop + load driver" if with_driver else "server loop"
        note += f", {1000 * cpu:.1f} ms CPU per request ({who}) on {overhead.cores} cores"
    spread = overhead.batch_spread
    if spread:
        p10, p90 = spread_p10_p90(spread)
        note += (
            f"; a batch x{p10:.2f}-x{p90:.2f} its predicted time (P10-P90 over "
            f"{spread_source(overhead)})"
        )
    return dataclasses.replace(
        cost,
        batch_scale=max(0.0, overhead.batch_scale),
        batch_overhead_s=max(0.0, overhead.batch_s),
        request_overhead_s=max(0.0, overhead.request_s),
        cpu_per_request_s=max(0.0, cpu or 0.0),
        cpu_cores=overhead.cores or 1,
        calibration=note,
        batch_spread=list(spread),
    )
