"""Serving-overhead calibration: measured from bench run records, carried by the cost model,
applied by the simulator, and the `lenbatch calibrate` command end to end on a fake report."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lenbatch.cli import main
from lenbatch.config import BatchingConfig, Strategy
from lenbatch.core.costfit import CostCoefficients
from lenbatch.plan.calibration import ServingOverhead, calibrated, measure_overhead
from lenbatch.plan.costmodel import CostModel
from lenbatch.plan.sim import simulate
from lenbatch.plan.trace import Trace

EXACT = 1e-9
COST = CostModel(
    const=0.02,
    per_row=0.001,
    per_token=0.0002,
    per_token_sq=1e-7,
    fit_error=0.05,
    memory_fit_error=0.1,
)


def _bucket(label: str, batches: int, requests: int, padded: int, exec_s: float) -> dict[str, Any]:
    return {
        "bucket": label,
        "batches": batches,
        "requests": requests,
        "padded_tokens": padded,
        "mean_exec_ms": 1000 * exec_s / batches if batches else 0.0,
    }


def _run_record(
    batch_extra: float,
    request_extra: float,
    server_p50_ms: float,
    slowdown: float = 1.0,
    cpu: tuple[float, float, int] | None = None,
    scale: float = 1.0,
) -> dict[str, Any]:
    """A lenbatch run whose server executed, beyond warm-up, 10 batches of 2 rows padded to 20
    tokens (bucket 1-32) and 5 of 1 row padded to 100 (bucket 33-128), each taking `scale`
    times COST's time plus `batch_extra` seconds, and then `slowdown` times slower; clients
    saw the server's median plus `request_extra`. `cpu`: (server loop CPU s, driver CPU s,
    cores) over the 25 s run."""
    before = {
        "p50_ms": 1.0,
        "per_bucket": [_bucket("1-32", 1, 1, 20, 0.5), _bucket("33-128", 0, 0, 0, 0.0)],
    }
    after = {
        "p50_ms": server_p50_ms,
        "per_bucket": [
            _bucket(
                "1-32",
                11,
                21,
                20 + 10 * 2 * 20,
                0.5 + 10 * (scale * COST.latency(2, 20) + batch_extra) * slowdown,
            ),
            _bucket(
                "33-128", 5, 5, 5 * 100, 5 * (scale * COST.latency(1, 100) + batch_extra) * slowdown
            ),
        ],
    }
    n = 25
    sent = np.arange(n, dtype=float)
    latency = server_p50_ms / 1000 + request_extra
    record: dict[str, Any] = {
        "name": "bucketed",
        "kind": "strategy",
        "rate": 0.5,
        "summary": {},
        "result": {
            "sent": sent.tolist(),
            "done": (sent + latency).tolist(),
            "status": [200] * n,
            "stats_before": before,
            "stats_after": after,
            "wall_s": 25.0,
        },
    }
    if cpu is not None:
        loop, driver, cores = cpu
        record["summary"] = {"server_cpu": {"loop_s": loop, "process_s": 9.0}, "cpu_count": cores}
        record["result"]["driver_cpu_s"] = driver
    return record


def test_overheads_measured_exactly_from_the_runs_own_counters() -> None:
    """Warm-up counters are subtracted; the model's time for the same shapes is subtracted."""
    o = measure_overhead(_run_record(0.007, 0.012, 40.0), COST)
    assert o.batch_s == pytest.approx(0.007, abs=EXACT)
    assert o.request_s == pytest.approx(0.012, abs=EXACT)
    assert (o.batches, o.requests) == (15, 25)
    assert o.source == "bucketed at rate x0.5"


def test_a_server_slower_in_proportion_to_the_model_is_fitted_as_a_scale() -> None:
    """Batches at 1.5x the model's time plus 2 ms: a constant alone would charge the long
    bucket's batches too little and the short one's too much; the fit recovers both terms,
    and the calibrated model's batch time and the adaptive prior carry them."""
    o = measure_overhead(_run_record(0.002, 0.012, 40.0, scale=1.5), COST)
    assert o.batch_scale == pytest.approx(1.5, abs=1e-6)
    assert o.batch_s == pytest.approx(0.002, abs=1e-9)
    cal = calibrated(COST, o)
    assert cal.latency(4, 64) == COST.latency(4, 64)  # the model's compute is unchanged
    assert cal.batch_seconds(4, 64) == pytest.approx(1.5 * COST.latency(4, 64) + 0.002)
    assert "x1.50 the model's time +2.0 ms" in cal.calibration
    prior = CostCoefficients.from_profile(cal.to_json())
    assert prior.seconds(4, 64) == pytest.approx(
        1.5 * (COST.latency(4, 64) - COST.per_row * 4) + 0.002  # the prior has no per-row term
    )


def test_the_batch_fit_takes_every_run_of_the_same_server() -> None:
    """A light run of one shape per bucket and a loaded run: the fit is over both runs'
    buckets, each run's own CPU slowdown taken out first."""
    light = _run_record(0.003, 0.012, 40.0, scale=1.2, cpu=(0.5, 1.0, 2), slowdown=1 / 0.97)
    loaded = _run_record(0.003, 0.012, 40.0, scale=1.2, cpu=(2.0, 4.0, 2), slowdown=1 / 0.88)
    loaded["rate"] = 4.0
    loaded["result"]["sent"] = list(np.linspace(0.0, 24.9, 100))
    loaded["result"]["done"] = [t + 0.052 for t in loaded["result"]["sent"]]
    loaded["result"]["status"] = [200] * 100
    o = measure_overhead(light, COST, [light, loaded])
    assert o.batch_runs == 2 and o.batches == 30
    assert o.batch_scale == pytest.approx(1.2, abs=1e-6)
    assert o.batch_s == pytest.approx(0.003, abs=1e-9)


def test_cpu_per_request_measured_and_its_slowdown_taken_out_of_the_batch_constant() -> None:
    """25 requests in 25 s with 0.5 s server-loop and 1.0 s driver CPU: 60 ms per request on
    2 cores is a 3 % share, so batches ran 1/0.97 slower; the per-batch constant excludes it."""
    share = 1.0 * (0.5 + 1.0) / 25 / 2
    o = measure_overhead(
        _run_record(0.007, 0.012, 40.0, slowdown=1 / (1 - share), cpu=(0.5, 1.0, 2)), COST
    )
    assert o.loop_cpu_s == pytest.approx(0.02, abs=EXACT)
    assert o.driver_cpu_s == pytest.approx(0.04, abs=EXACT)
    assert o.cpu_per_request_s == pytest.approx(0.06, abs=EXACT)
    assert o.cores == 2
    assert o.batch_s == pytest.approx(0.007, abs=EXACT)
    cal = calibrated(COST, o)
    assert (cal.cpu_per_request_s, cal.cpu_cores) == (pytest.approx(0.06), 2)
    assert cal.slowdown(1.0) == pytest.approx(1 / (1 - share))
    assert "server loop + load driver" in cal.calibration
    server_only = calibrated(COST, o, with_driver=False)
    assert server_only.cpu_per_request_s == pytest.approx(0.02, abs=EXACT)
    assert "(server loop) on 2 cores" in server_only.calibration


def test_a_run_recorded_without_cpu_times_calibrates_the_constants_only() -> None:
    o = measure_overhead(_run_record(0.007, 0.012, 40.0), COST)
    assert o.cpu_per_request_s is None
    cal = calibrated(COST, o)
    assert cal.cpu_per_request_s == 0.0 and cal.slowdown(100.0) == 1.0
    assert "CPU per request not measured" in cal.calibration


def test_slowdown_is_the_cores_left_to_the_model_and_is_capped() -> None:
    cost = CostModel(const=0.1, cpu_per_request_s=0.05, cpu_cores=2)
    assert cost.slowdown(0.0) == 1.0
    assert cost.slowdown(10.0) == pytest.approx(2 / (2 - 0.5))
    assert cost.slowdown(1000.0) == pytest.approx(10.0)
    assert CostModel(const=0.1).slowdown(1000.0) == 1.0


def test_simulator_slows_batches_by_the_last_seconds_request_rate() -> None:
    """CPU 0.25 s per request on one core: the first batch starts with one arrival in the last
    second (x1/0.75), the second with two (x1/0.5)."""
    t = Trace(np.asarray([10, 10]), np.asarray([0.0, 0.5]))
    cfg = BatchingConfig(strategy=Strategy.FIFO, max_batch=1, max_wait_ms=10, prefetch_batches=0)
    run = simulate(t, CostModel(const=0.1, cpu_per_request_s=0.25, cpu_cores=1), cfg)
    assert run.execs == pytest.approx([0.1 / 0.75, 0.1 / 0.5], abs=EXACT)
    assert run.latencies == pytest.approx([0.1 / 0.75, 0.2], abs=EXACT)


def test_a_peer_run_without_stats_is_refused() -> None:
    record = _run_record(0.0, 0.0, 10.0)
    record["result"]["stats_before"] = None
    with pytest.raises(ValueError, match="no /stats"):
        measure_overhead(record, COST)


def test_calibrated_cost_keeps_the_model_and_clamps_negative_overheads(tmp_path: Path) -> None:
    cal = calibrated(COST, ServingOverhead(-0.001, 0.009, 10, 20, "fifo at rate x1"))
    assert (cal.batch_overhead_s, cal.request_overhead_s) == (0.0, 0.009)
    assert cal.latency(4, 64) == COST.latency(4, 64)  # the model's compute is unchanged
    assert cal.batch_seconds(4, 64) == COST.latency(4, 64)
    assert "fifo at rate x1" in cal.calibration
    cal.save(tmp_path / "c.json")
    assert CostModel.load(tmp_path / "c.json") == cal


def test_a_cost_model_written_before_calibration_existed_still_loads(tmp_path: Path) -> None:
    data = COST.to_json()
    for key in ("batch_overhead_s", "request_overhead_s", "calibration"):
        del data[key]
    (tmp_path / "old.json").write_text(json.dumps(data))
    assert CostModel.load(tmp_path / "old.json") == COST


def test_simulator_scales_the_models_time_by_the_calibrated_batch_scale() -> None:
    t = Trace(np.asarray([10, 50]), np.asarray([0.0, 5.0]))
    cfg = BatchingConfig(strategy=Strategy.FIFO, max_wait_ms=10)
    cost = CostModel(const=0.05, per_token=0.001, batch_scale=2.0, batch_overhead_s=0.004)
    run = simulate(t, cost, cfg)
    assert run.execs == pytest.approx([2 * 0.06 + 0.004, 2 * 0.1 + 0.004], abs=EXACT)


def test_simulator_adds_batch_overhead_to_service_and_request_overhead_to_latency() -> None:
    """Sparse arrivals, fifo with 10 ms max wait: latency = wait + model + batch overhead +
    request overhead, exactly; the runner is busy for model + batch overhead."""
    t = Trace(np.asarray([10, 50, 10]), np.asarray([0.0, 5.0, 10.0]))
    cfg = BatchingConfig(strategy=Strategy.FIFO, max_wait_ms=10)
    cost = CostModel(const=0.05, per_token=0.001, batch_overhead_s=0.004, request_overhead_s=0.02)
    run = simulate(t, cost, cfg)
    model = [0.05 + 0.001 * 10, 0.05 + 0.001 * 50, 0.05 + 0.001 * 10]
    assert run.latencies == pytest.approx([0.01 + m + 0.004 + 0.02 for m in model], abs=EXACT)
    assert run.execs == pytest.approx([m + 0.004 for m in model], abs=EXACT)


def test_batch_overhead_delays_requests_queued_behind_a_batch() -> None:
    """Two back-to-back full batches of one: the second starts when the first's model time and
    overhead have passed."""
    t = Trace(np.asarray([10, 10]), np.asarray([0.0, 0.0]))
    cfg = BatchingConfig(strategy=Strategy.FIFO, max_batch=1, max_wait_ms=10, prefetch_batches=0)
    run = simulate(t, CostModel(const=0.1, batch_overhead_s=0.01), cfg)
    assert run.latencies == pytest.approx([0.11, 0.22], abs=EXACT)


def _report(tmp_path: Path) -> Path:
    """A bench report folder with two bucketed runs of MiniLM (light and 4x) and a peer."""
    runs = tmp_path / "report" / "runs"
    runs.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for tag, rate in (("bucketed@x0.25", 0.25), ("bucketed", 1.0)):
        record = _run_record(0.006, 0.010, 45.0, slowdown=1 / (1 - 0.03), cpu=(0.5, 1.0, 2))
        n = len(record["result"]["sent"])
        record["rate"] = rate
        record["command"] = ["python", "-c", "...", "serve", "--model", "minilm",
                             "--strategy", "bucketed", "--max-batch", "32",
                             "--max-wait-ms", "10", "--port", "1"]  # fmt: skip
        record["result"]["scheduled"] = np.sort(rng.uniform(0, 10 / rate, n)).tolist()
        record["result"]["lengths"] = rng.integers(5, 200, n).tolist()
        record["summary"].update(p50_ms=60.0, p95_ms=120.0, throughput_rps=2.5)
        (runs / f"{tag}.json").write_text(json.dumps(record))
    (runs / "naive.json").write_text(json.dumps({"name": "naive", "kind": "peer"}))
    return tmp_path / "report"


def test_calibrate_command_measures_the_lightest_bucketed_run_and_writes_the_cost(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report = _report(tmp_path)
    COST.save(tmp_path / "cost.json")
    out = tmp_path / "calibrated.json"
    md = tmp_path / "cal.md"
    status = main(
        ["calibrate", str(report), "--cost", str(tmp_path / "cost.json"),
         "--out", str(out), "--markdown", str(md), "--server-only"]
    )  # fmt: skip
    assert status == 0
    printed = capsys.readouterr().out
    assert "measured on `bucketed@x0.25`" in printed
    assert "batches x1.00 the model's time +6.0 ms" in printed
    assert "+10.0 ms per request" in printed
    assert "60.0 ms CPU per request** outside the model on 2 cores" in printed
    assert "no spread of batch times (25 requests ran alone, 30 needed" in printed
    rows = [line for line in printed.splitlines() if line.startswith("| bucketed")]
    assert [r.split(" |")[0] for r in rows] == ["| bucketed@x0.25 (measured here)", "| bucketed"]
    assert md.read_text() in printed
    cal = CostModel.load(out)
    assert cal.batch_overhead_s == pytest.approx(0.006, abs=EXACT)
    assert cal.request_overhead_s == pytest.approx(0.010, abs=EXACT)
    assert cal.const == COST.const
    assert cal.cpu_per_request_s == pytest.approx(0.02, abs=EXACT)  # --server-only: loop only


def test_calibrate_command_names_the_runs_when_the_source_is_unknown(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report = _report(tmp_path)
    COST.save(tmp_path / "cost.json")
    status = main(
        ["calibrate", str(report), "--cost", str(tmp_path / "cost.json"), "--from", "fifo"]
    )
    assert status == 2
    err = capsys.readouterr().err
    assert "no lenbatch run 'fifo'" in err and "bucketed@x0.25" in err


def test_calibrate_checks_the_cost_file_at_the_served_thread_count(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A cost model measured here with the threads per batch the bench's servers ran (their
    /stats `workers`) calibrates without a warning, whatever this process's thread count;
    one measured with other threads still gets one."""
    import dataclasses

    from lenbatch.runners.hardware import processor_key

    report = _report(tmp_path)
    served = 7  # not this process's thread count
    for path in (report / "runs").glob("bucketed*.json"):
        record = json.loads(path.read_text())
        record["result"]["stats_after"]["workers"] = {"batches_at_once": 2, "torch_threads": served}
        path.write_text(json.dumps(record))
    for threads, warned in ((served, False), (served + 1, True)):
        cost = dataclasses.replace(COST, processor=processor_key("cpu", threads))
        cost.save(tmp_path / "cost.json")
        assert main(["calibrate", str(report), "--cost", str(tmp_path / "cost.json")]) == 0
        err = capsys.readouterr().err
        assert ("warning:" in err) is warned, err
        if warned:
            assert f"threads {served + 1} vs {served}" in err


def test_cpu_per_request_is_separated_from_idle_cpu_over_runs_at_two_rates() -> None:
    """Two runs of the same server: 25 requests in 25 s and 25 in 100 s. With 0.01 cores of
    idle loop CPU and 20 ms per request (driver: 0.02 cores, 40 ms), the fit recovers both;
    dividing the light run's CPU by its requests alone would charge the idle work to them."""

    def run(wall: float) -> dict[str, Any]:
        record = _run_record(0.0, 0.0, 40.0, cpu=(0.01 * wall + 0.02 * 25, 0.02 * wall + 1.0, 2))
        record["result"]["wall_s"] = wall
        return record

    light, busy = run(100.0), run(25.0)
    o = measure_overhead(light, COST, [light, busy])
    assert o.loop_cpu_s == pytest.approx(0.02, abs=1e-9)
    assert o.driver_cpu_s == pytest.approx(0.04, abs=1e-9)
    assert o.cpu_baseline_cores == pytest.approx(0.03, abs=1e-9)
    assert o.cpu_runs == 2
    alone = measure_overhead(light, COST)
    assert alone.cpu_runs == 1 and alone.loop_cpu_s == pytest.approx((1.0 + 0.5) / 25)


def _spread_record(factors: np.ndarray, crowd: int = 0) -> tuple[dict[str, Any], np.ndarray]:
    """A light run whose requests, one a second, each ran alone: its batch took `factors[i]`
    times the fitted time of its length (scale 1, +7 ms per batch, as `_run_record` counts
    them), behind a 10 ms queue wait and 12 ms per request. Then `crowd` requests sent 10 ms
    apart, each while the one before was in flight, five times slower: the spread must not
    count them. Returns the record and the lengths of the requests that ran alone."""
    wait, request_s = 0.010, 0.012
    n = len(factors)
    lengths = 20 + (np.arange(n) * 37) % 200
    fitted = np.array([COST.latency(1, int(x)) for x in lengths]) + 0.007
    sent = np.arange(n, dtype=float)
    done = sent + wait + request_s + factors * fitted
    crowd_sent = n + 10 + 0.01 * np.arange(crowd)
    crowd_done = crowd_sent + 5 * (wait + request_s + fitted[:crowd])
    all_sent = np.concatenate([sent, crowd_sent])
    all_done = np.concatenate([done, crowd_done])
    all_len = np.concatenate([lengths, lengths[:crowd]])
    # the server's median makes the client's median minus it exactly `request_s`
    server_p50_ms = 1000 * (float(np.median(all_done - all_sent)) - request_s)
    record = _run_record(0.007, request_s, server_p50_ms)
    record["result"].update(
        sent=all_sent.tolist(),
        done=all_done.tolist(),
        status=[200] * len(all_sent),
        lengths=all_len.tolist(),
    )
    record["result"]["stats_after"]["queue_wait_p50_ms"] = 1000 * wait
    return record, lengths


def test_the_batch_spread_is_measured_on_the_requests_that_ran_alone() -> None:
    """41 lone requests whose batches took 0.8-1.4x their fitted time: the spread is those
    factors' quantiles (scaled to mean 1); requests sent while another was in flight, five
    times slower, are left out."""
    factors = 1.1 + 0.3 * np.linspace(-1, 1, 41) ** 3  # mean 1.1: the spread is scaled to 1
    record, _ = _spread_record(factors, crowd=15)
    o = measure_overhead(record, COST)
    assert (o.batch_scale, o.batch_s) == (pytest.approx(1.0), pytest.approx(0.007))
    assert o.spread_requests == 41
    want = np.quantile(factors / factors.mean(), np.linspace(0, 1, 21))
    assert o.batch_spread == pytest.approx(want, abs=1e-3)
    cal = calibrated(COST, o)
    assert cal.batch_spread == pytest.approx(want, abs=1e-3)
    assert "over 41 requests that ran alone" in cal.calibration
    assert f"x{want[2]:.2f}-x{want[18]:.2f}" in cal.calibration


def test_too_few_lone_requests_give_no_spread() -> None:
    record, _ = _spread_record(np.ones(29))
    o = measure_overhead(record, COST)
    assert (o.batch_spread, o.spread_requests) == ((), 29)
    cal = calibrated(COST, o)
    assert cal.batch_spread == [] and "ran alone" not in cal.calibration
    assert cal.spread_factor(0.99) == 1.0


def test_without_lone_requests_the_spread_is_an_adaptive_servers_own() -> None:
    """A run where too few requests ran alone (one past capacity) takes the spread an
    `adaptive` server of the report measured itself (`/stats`), over the batches its window
    holds; the lone requests' spread wins when there is one, and a server without one (a
    fixed strategy's) gives none."""
    own = [round(0.6 + 0.04 * i, 4) for i in range(21)]
    busy, _ = _spread_record(np.ones(29))
    other, _ = _spread_record(np.ones(29))
    other["name"] = "adaptive"
    other["result"]["stats_after"]["adaptive"] = {
        "cost_model": {"batch_spread": own, "observed_batches": 2000}
    }
    o = measure_overhead(busy, COST, [busy], [busy, other])
    assert o.batch_spread == pytest.approx(own) and o.spread_requests == 29
    assert o.spread_batches == 512  # the window's last batches, not all 2,000
    cal = calibrated(COST, o)
    assert cal.batch_spread == pytest.approx(own)
    assert "over the adaptive server's own last 512 batches" in cal.calibration
    assert "ran alone" not in cal.calibration
    lone, _ = _spread_record(1.1 + 0.3 * np.linspace(-1, 1, 41) ** 3)
    kept = measure_overhead(lone, COST, [lone], [other])
    assert kept.spread_requests == 41 and kept.spread_batches == 0
    assert kept.batch_spread != pytest.approx(own)
    assert measure_overhead(busy, COST, [busy], [busy]).batch_spread == ()


def test_the_spread_factor_interpolates_between_quantiles() -> None:
    cost = CostModel(const=0.1, batch_spread=[0.5, 1.0, 1.5])
    assert [cost.spread_factor(u) for u in (0.0, 0.25, 0.5, 0.9, 1.0)] == pytest.approx(
        [0.5, 0.75, 1.0, 1.4, 1.5]
    )
    assert cost.spread_factor(-1.0) == 0.5 and cost.spread_factor(2.0) == 1.5
    assert CostModel(const=0.1, batch_spread=[1.2]).spread_factor(0.3) == 1.2


def test_the_simulator_draws_each_batch_time_from_the_spread_repeatably() -> None:
    """One request every second (each batch runs alone): with a spread every batch time is the
    model's times a factor within the spread's range, their mean near the model's, the same
    run for the same seed and another for another seed; without one, the model's time."""
    n = 400
    t = Trace(np.full(n, 10), np.arange(n, dtype=float))
    cfg = BatchingConfig(strategy=Strategy.FIFO, max_wait_ms=10)
    plain = CostModel(const=0.1)
    spread = CostModel(const=0.1, batch_spread=[0.6, 0.8, 1.0, 1.2, 1.4])
    assert simulate(t, plain, cfg).execs == pytest.approx([0.1] * n, abs=EXACT)
    first = np.asarray(simulate(t, spread, cfg).execs)
    assert first.min() >= 0.06 - EXACT and first.max() <= 0.14 + EXACT
    assert first.std() > 0.015  # spread out, not the model's time
    assert first.mean() == pytest.approx(0.1, rel=0.05)
    assert np.array_equal(first, simulate(t, spread, cfg).execs)
    assert not np.array_equal(first, simulate(t, spread, cfg, seed=1).execs)
    lat = np.asarray(simulate(t, spread, cfg).latencies)
    assert np.percentile(lat, 95) > 0.01 + 0.12  # the tail of the draws, not the model's 0.1


def test_the_calibration_table_says_how_much_a_batch_varies() -> None:
    from lenbatch.cli.calibrate import _spread_text

    record, _ = _spread_record(1.1 + 0.3 * np.linspace(-1, 1, 41) ** 3)
    o = measure_overhead(record, COST)
    text = _spread_text(o)
    assert f"**a batch x{o.batch_spread[2]:.2f}-x{o.batch_spread[18]:.2f} its predicted" in text
    assert "over 41 requests that ran alone" in text
