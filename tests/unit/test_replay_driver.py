"""The open-loop driver against a loopback server whose latencies and answers are known."""

from __future__ import annotations

import json

import numpy as np
import pytest

from lenbatch.plan.summary import OUTCOME_ERROR, OUTCOME_OK, OUTCOME_REJECTED
from lenbatch.replay.driver import ReplayPlan, ReplayResult, replay, summarize_replay
from lenbatch.replay.endpoints import EmbeddingsEndpoint
from tests.unit.replay_fakes import FakeServer, serving


def _plan(times: list[float], bodies: list[dict[str, object]], lengths: list[int]) -> ReplayPlan:
    return ReplayPlan(
        scheduled=np.asarray(times, dtype=np.float64),
        lengths=np.asarray(lengths, dtype=np.int64),
        bodies=[json.dumps(b).encode() for b in bodies],
    )


@pytest.mark.slow
async def test_slow_answer_does_not_delay_later_sends() -> None:
    """Open loop: a request taking 2 s does not hold back the ones scheduled after it."""
    n = 20
    times = [0.05 * i for i in range(n)]
    bodies = [{"input": f"r{i}", "delay": 2.0 if i == 0 else 0.0} for i in range(n)]
    fake = FakeServer()
    with serving(fake) as url:
        res = await replay(
            url, _plan(times, bodies, [5] * n), EmbeddingsEndpoint(), clients=1, progress=False
        )
    arrived = {b["input"]: t for t, b in fake.arrivals}
    assert len(arrived) == n
    t_first = arrived["r0"]
    offsets = np.asarray([arrived[f"r{i}"] - t_first for i in range(n)])
    # Every later request reached the server near its own schedule, long before r0 finished.
    assert offsets[-1] < 1.5
    assert np.all(np.abs(offsets - np.asarray(times)) < 0.3)
    assert res.latencies[0] >= 2.0
    assert np.all(res.outcomes == OUTCOME_OK)


async def test_sends_follow_the_schedule() -> None:
    """Each send happens at its scheduled offset (lateness is small and non-negative)."""
    times = [0.0, 0.1, 0.1, 0.3, 0.6]
    bodies = [{"input": f"r{i}"} for i in range(len(times))]
    with serving(FakeServer()) as url:
        res = await replay(url, _plan(times, bodies, [4] * 5), EmbeddingsEndpoint(), progress=False)
    assert np.all(res.sent >= np.asarray(times))
    assert np.all(res.sent - np.asarray(times) < 0.25)
    s = summarize_replay(res)
    assert s["driver"]["send_lateness_max_ms"] == pytest.approx(1000 * res.lateness.max())
    assert s["driver"]["cpu_s"] >= 0


async def test_latency_is_the_servers_delay() -> None:
    """Measured latency covers the server's known delay and not much more."""
    delays = [0.2, 0.4, 0.0]
    bodies = [{"input": f"r{i}", "delay": d} for i, d in enumerate(delays)]
    with serving(FakeServer()) as url:
        res = await replay(
            url, _plan([0.0, 0.0, 0.0], bodies, [3, 3, 3]), EmbeddingsEndpoint(), progress=False
        )
    lat = res.latencies
    assert np.all(lat >= np.asarray(delays))
    assert np.all(lat < np.asarray(delays) + 0.3)


async def test_outcomes_and_summary_are_exact() -> None:
    """429/503 count as rejected, 500 as errors; the summary's figures follow from the columns."""
    statuses = [200, 200, 429, 500, 200, 503, 200, 200]
    lengths = [10, 20, 30, 40, 50, 60, 70, 80]
    bodies = [{"input": f"r{i}", "status": s} for i, s in enumerate(statuses)]
    times = [0.02 * i for i in range(len(statuses))]
    with serving(FakeServer()) as url:
        res = await replay(url, _plan(times, bodies, lengths), EmbeddingsEndpoint(), progress=False)
    assert res.status.tolist() == statuses
    ok_, rej, err = OUTCOME_OK, OUTCOME_REJECTED, OUTCOME_ERROR
    expect = [ok_, ok_, rej, err, ok_, rej, ok_, ok_]
    assert res.outcomes.tolist() == expect
    assert res.errors[3] == "HTTP 500: fake error 500"
    s = summarize_replay(res)
    ok = res.outcomes == OUTCOME_OK
    assert (s["requests"], s["completed"], s["errors"], s["rejected"]) == (8, 5, 1, 2)
    assert s["error_rate"] == pytest.approx(3 / 8)
    lat_ms = 1000 * (res.done - res.sent)[ok]
    assert s["p50_ms"] == pytest.approx(np.percentile(lat_ms, 50, method="inverted_cdf"))
    assert s["p99_ms"] == pytest.approx(lat_ms.max())
    duration = res.done[ok].max() - res.sent.min()
    assert s["duration_s"] == pytest.approx(duration)
    assert s["real_tokens_per_s"] == pytest.approx((10 + 20 + 50 + 70 + 80) / duration)
    assert s["padding_waste"] is None  # this server has no /stats


async def test_server_stats_are_counted_over_the_run_only() -> None:
    """Padding waste and batch size come from /stats after minus before the run."""

    def stats(batches: int, reqs: int, real: int, padded: int) -> dict[str, object]:
        row = {
            "bucket": "1-16", "batches": batches, "requests": reqs, "real_tokens": real,
            "padded_tokens": padded, "mean_exec_ms": 10.0, "queue_wait_p50_ms": 3.0,
        }  # fmt: skip
        over = dict(row, bucket="overlong(17-32)", batches=0, requests=0, real_tokens=0,
                    padded_tokens=0)  # fmt: skip
        return {
            "strategy": "bucketed", "boundaries": [16], "per_bucket": [row, over],
            "memory": {"peak_rss_mb": 321.0}, "queue_wait_p50_ms": 3.0,
        }  # fmt: skip

    fake = FakeServer(stats=[stats(2, 8, 100, 200), stats(5, 20, 400, 800)])
    with serving(fake) as url:
        res = await replay(
            url, _plan([0.0, 0.01], [{"input": "a"}, {"input": "b"}], [4, 20]),
            EmbeddingsEndpoint(), progress=False,
        )  # fmt: skip
    s = summarize_replay(res)
    assert s["padding_waste"] == pytest.approx(1 - 300 / 600)
    assert s["mean_batch_size"] == pytest.approx(12 / 3)
    assert s["peak_memory_mb"] == 321.0
    assert [b["bucket"] for b in s["per_bucket"]] == ["1-16", "overlong(17-32)"]
    assert [b["requests"] for b in s["per_bucket"]] == [1, 1]
    assert s["per_bucket"][0]["padding_waste"] == pytest.approx(0.5)
    assert s["server"]["batches"] == 3


async def test_transport_errors_and_timeouts_are_answers() -> None:
    """A request that times out is an error with a reason; nothing is silently dropped."""
    bodies = [{"input": "slow", "delay": 1.0}, {"input": "fast"}]
    with serving(FakeServer()) as url:
        res = await replay(
            url, _plan([0.0, 0.0], bodies, [3, 3]), EmbeddingsEndpoint(), timeout_s=0.3,
            progress=False,
        )  # fmt: skip
    assert res.outcomes.tolist() == [OUTCOME_ERROR, OUTCOME_OK]
    assert res.errors[0] is not None and res.errors[0].startswith("timeout")
    res2 = await replay(
        "http://127.0.0.1:9", _plan([0.0], [{"input": "x"}], [3]), EmbeddingsEndpoint(),
        progress=False,
    )  # fmt: skip
    assert res2.outcomes.tolist() == [OUTCOME_ERROR]
    assert res2.errors[0] is not None and res2.errors[0].startswith("transport error")


async def test_in_flight_cap_is_reported_not_hidden() -> None:
    """Requests over the in-flight cap are not sent and are counted as errors."""
    bodies = [{"input": f"r{i}", "delay": 0.5} for i in range(4)]
    with serving(FakeServer()) as url:
        res = await replay(
            url, _plan([0.0] * 4, bodies, [3] * 4), EmbeddingsEndpoint(), max_in_flight=2,
            progress=False,
        )  # fmt: skip
    assert int(np.isnan(res.sent).sum()) == 2
    assert summarize_replay(res)["driver"]["not_sent"] == 2
    assert sum(e is not None and e.startswith("not sent") for e in res.errors) == 2


def test_result_round_trips_through_json() -> None:
    """A saved run loads back with the same columns."""
    res = ReplayResult(
        scheduled=np.array([0.0, 1.0]), sent=np.array([0.0, np.nan]), done=np.array([0.5, np.nan]),
        lengths=np.array([3, 4]), status=np.array([200, 0]), outcomes=np.array([0, 1]),
        errors=[None, "x"], first_token=np.array([np.nan, np.nan]), output_tokens=np.array([0, 0]),
        token_gaps=np.array([]), wall_s=1.0, driver_cpu_s=0.1, clients=2,
    )  # fmt: skip
    back = ReplayResult.from_json(json.loads(json.dumps(res.to_json())))
    assert np.array_equal(back.sent, res.sent, equal_nan=True)
    assert back.errors == res.errors and back.lengths.tolist() == [3, 4]
