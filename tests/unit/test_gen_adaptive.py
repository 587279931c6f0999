"""Strategy adaptive for causal LMs (`generate.adaptive`): the running cap, the prefill chunk,
admit / refuse at the door, shed from the queue, with cost models fixed by their priors (no
clock, no model)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from lenbatch.config import AdaptiveConfig, GenerationConfig
from lenbatch.core.costfit import CostCoefficients
from lenbatch.core.errors import Overloaded, Unavailable
from lenbatch.core.request import Request
from lenbatch.generate.adaptive import (
    AdaptiveGenPolicy,
    RunningRow,
    delivered,
    door_state,
    prefill_tokens,
)
from lenbatch.generate.costs import GenCosts

# decode: 30 ms + 10 us per row x cache column; prefill: 10 ms + 1 ms per prompt token
DECODE = CostCoefficients(0.03, 1e-5, 0.0)
PREFILL = CostCoefficients(0.01, 1e-3, 0.0)


def _policy(max_running: int = 64, **adaptive: Any) -> AdaptiveGenPolicy:
    costs = GenCosts("m", prefill_prior=PREFILL, decode_prior=DECODE)
    costs.width = 100.0
    cfg = AdaptiveConfig(**{"slo_ms": 1000.0, "itl_slo_ms": 150.0, **adaptive})
    return AdaptiveGenPolicy(GenerationConfig(max_running=max_running), cfg, costs)


def _queued(lengths: list[int], priority: int = 0, arrival: float = 0.0) -> list[Request]:
    return [Request(n, arrival, [1] * n, priority=priority) for n in lengths]


@dataclass
class _Job:
    rows: int
    remaining: int
    max_cols: int | None = None
    gens: list[Any] = field(default_factory=list)
    alone: bool = False


@dataclass
class _Core:
    jobs: deque[Any] = field(default_factory=deque)
    running_rows: int = 0
    mixer: Any = None

    @property
    def pending_rows(self) -> int:
        return sum(j.rows for j in self.jobs)


@dataclass
class _Unit:
    """A unit's figures (`generate.jobs.UnitResult`'s fields the cost models read)."""

    kind: str
    rows: int
    padded: int
    compute_s: float
    tokens: int = 0
    prefill_rows: int = 0
    prefill_padded: int = 0
    prefill_tokens: int = 0


def test_row_cap_is_the_most_rows_whose_step_fits_the_inter_token_budget() -> None:
    """decode(r) = 30 ms + 1 ms x r must stay within 60 % of 150 ms: 60 rows, and never above
    max_running; capacity counts running and pending rows."""
    assert _policy(max_running=64).row_cap() == 60
    assert _policy(max_running=32).row_cap() == 32
    p = _policy(max_running=64)
    assert p.capacity(_Core(jobs=deque([_Job(5, 10)]), running_rows=50)) == 5
    assert p.capacity(_Core(running_rows=70)) == 0


def test_row_cap_shrinks_when_decode_steps_are_measured_slower() -> None:
    """The cap follows the online fit: steps measured 3x the prior's time cut it."""
    p = _policy()
    before = p.row_cap()
    for rows in (1, 4, 8, 16, 32) * 20:
        p.costs.observe(_Unit("decode", rows, rows * 100, 3 * DECODE.seconds(rows, 100)))
    assert p.row_cap() < before / 2


def test_chunk_fits_beside_a_decode_step_and_a_lone_prompt_runs_whole() -> None:
    """With rows decoding, chunk + step <= the inter-token SLO; with none, the whole prompt."""
    p = _policy()
    cols = p.chunk_cols(1, 20)
    assert p.costs.prefill_s(1, cols) + p.costs.decode_s(20) <= 0.150 + 1e-9
    assert p.costs.prefill_s(1, cols + 2) + p.costs.decode_s(20) > 0.150
    job = _Job(1, 500)
    unit = p.next_unit(_Core(jobs=deque([job])), None)  # type: ignore[arg-type]
    assert unit is not None and unit.kind == "prefill" and unit.cols == 500
    unit = p.next_unit(_Core(jobs=deque([job]), running_rows=20), "decode")  # type: ignore[arg-type]
    assert unit is not None and unit.kind == "prefill" and unit.cols == cols
    unit = p.next_unit(_Core(jobs=deque([job]), running_rows=20), "prefill")  # type: ignore[arg-type]
    assert unit is not None and unit.kind == "decode"


def test_rows_that_decoded_ahead_of_the_objective_let_a_bigger_chunk_run() -> None:
    """Rows that got 10 tokens in 0.5 s (50 ms a gap against 150) can take a unit of
    10 x 0.15 - 0.5 = 1.0 s and keep their mean within the objective even were the next token
    their last: the chunk fills that instead of one gap. The row with the least slack rules;
    a row with no token yet leaves the one-gap budget."""
    p = _policy()
    one_gap = p.chunk_cols(1, 2)
    p.observe_rows(10.0, [(10, 9.5), (40, 5.0)])  # slack 1.0 s and 6.0 - 5.0 = 1.0 s
    assert p.unit_allowance == pytest.approx(1.0)
    cols = p.chunk_cols(1, 2)
    assert p.costs.prefill_s(1, cols) + p.costs.decode_s(2) <= 1.0 + 1e-9
    assert p.costs.prefill_s(1, cols + 2) + p.costs.decode_s(2) > 1.0
    assert cols > 5 * one_gap
    p.observe_rows(10.0, [(10, 9.5), (1, 9.99)])  # a row that just began: one gap
    assert p.chunk_cols(1, 2) == one_gap
    p.observe_rows(10.0, [(10, 9.5), (0, float("nan"))])
    assert p.chunk_cols(1, 2) == one_gap
    p.observe_rows(10.0, [(3, 8.0)])  # behind the objective: never below one gap
    assert p.unit_allowance == 0.0 and p.chunk_cols(1, 2) == one_gap


def test_delivered_reads_tokens_and_first_token_time_of_running_rows() -> None:
    def gen(times: list[float], done: bool = False) -> Any:
        return SimpleNamespace(done=done, timings=SimpleNamespace(token_times=times))

    got = delivered([gen([1.0, 1.1, 1.2]), gen([]), gen([0.5], done=True)])
    assert got[0] == (3, 1.0)
    assert got[1][0] == 0 and got[1][1] != got[1][1]  # NaN before the first token
    assert len(got) == 2


def test_with_a_mixing_runner_the_priced_chunk_rides_with_the_decode_step() -> None:
    """Where one forward can carry both, the same priced chunk runs as a mixed unit whatever
    ran last; a job marked alone alternates; a lone prompt still runs whole as a prefill."""
    p = _policy()
    cols = p.chunk_cols(1, 20)
    job = _Job(1, 500)
    for last in ("decode", "prefill", "mixed"):
        core = _Core(jobs=deque([job]), running_rows=20, mixer=object())
        unit = p.next_unit(core, last)  # type: ignore[arg-type]
        assert unit is not None and unit.kind == "mixed" and unit.cols == cols
    alone = _Core(jobs=deque([_Job(1, 500, alone=True)]), running_rows=20, mixer=object())
    assert p.next_unit(alone, "prefill").kind == "decode"  # type: ignore[arg-type,union-attr]
    idle = _Core(jobs=deque([job]), mixer=object())
    unit = p.next_unit(idle, None)  # type: ignore[arg-type]
    assert unit is not None and unit.kind == "prefill" and unit.cols == 500


def test_a_mixed_unit_teaches_the_prefill_model_what_the_chunk_added() -> None:
    """A mixed unit's time minus the decode model's step goes to the prefill model: chunks
    measured to add 2 ms + 0.2 ms per token beside a step are learnt as that, and the decode
    model is left as it was."""
    p = _policy()
    decode_before = p.costs.decode.seconds(16, 100)
    for cols in (16, 32, 64, 128, 200) * 30:
        step = DECODE.seconds(16, 100)
        p.costs.observe(_Unit("mixed", 16, 1600, step + 0.002 + 2e-4 * cols, 0, 1, cols))
    assert p.costs.prefill.seconds(1, 100) == pytest.approx(0.002 + 0.02, rel=0.1)
    assert p.costs.decode.seconds(16, 100) == pytest.approx(decode_before)


@pytest.mark.parametrize("kind", ["prefill", "mixed"])
def test_a_chunk_is_priced_by_its_real_tokens_where_padding_runs_through_no_product(
    kind: str,
) -> None:
    """Chunks of 4 prompts, 40 % of each chunk padding, that took 10 ms + 1 ms per real token
    (beside a decode step, for a mixed unit): with `real_tokens` the prefill model learns 1 ms
    per token, so a lone 100-token prompt is priced ~110 ms; by padded shape the same units
    teach ~0.6 ms per padded token, and the lone prompt would be priced ~70 ms, too low by a
    third. /stats says which basis is in use."""
    predicted = {}
    for real_tokens in (True, False):
        costs = GenCosts("m", real_tokens=real_tokens, prefill_prior=PREFILL, decode_prior=DECODE)
        for cols in (50, 100, 150, 200) * 40:
            padded, real = 4 * cols, round(0.6 * 4 * cols)
            took = 0.01 + 1e-3 * real
            if kind == "prefill":
                costs.observe(_Unit("prefill", 4, padded, took, tokens=real))
            else:
                step = DECODE.seconds(8, 100)
                costs.observe(_Unit("mixed", 8, 800, step + took, 700, 4, padded, real))
        predicted[real_tokens] = costs.prefill.seconds(1, 100)
        basis = costs.describe()["prefill_priced_by"]
        assert basis == ("real tokens" if real_tokens else "padded shape")
    assert predicted[True] == pytest.approx(0.11, rel=0.05)
    assert predicted[False] < 0.75 * predicted[True]


def test_a_chunk_of_padding_alone_teaches_nothing() -> None:
    """A prefill chunk whose columns are all padding (a short prompt's first chunk beside a
    long one) ran no product: with `real_tokens` it leaves the prefill model as it was."""
    costs = GenCosts("m", real_tokens=True, prefill_prior=PREFILL, decode_prior=DECODE)
    costs.observe(_Unit("prefill", 2, 64, 0.5, tokens=0))
    assert costs.prefill.observed == 0


def test_admits_what_makes_its_first_token_and_refuses_what_cannot_with_retry_after() -> None:
    """An idle server admits a 200-token prompt (~0.2 s); behind 2,000 queued prompt tokens
    (> 2 s of prefill) the same prompt gets a 429 whose Retry-After covers the excess."""
    p = _policy()
    assert p.refusal(200, 0, 0.0, [], 0, [], 0) is None
    err = p.refusal(200, 0, 0.0, _queued([400] * 5), 0, [RunningRow(10)] * 4, 0)
    assert isinstance(err, Overloaded) and err.status == 429
    assert err.retry_after is not None and err.retry_after >= 1.0
    assert p.refused == 1


def test_time_already_waited_counts_against_the_objective() -> None:
    """A prompt predicted at ~0.5 s is admitted fresh, refused after 0.7 s of tokenizing."""
    p = _policy()
    assert p.refusal(480, 0, 0.0, [], 0, [], 0) is None
    assert p.refusal(480, 0, 0.7, [], 0, [], 0) is not None


def test_a_higher_priority_jumps_the_lower_queue() -> None:
    """Queued work of lower priority is not ahead of a higher-priority request."""
    p = _policy(priority_levels=2)
    queued = _queued([400] * 5, priority=0)
    assert p.refusal(200, 0, 0.0, queued, 0, [], 0) is not None
    assert p.refusal(200, 1, 0.0, queued, 0, [], 0) is None


def test_a_full_batch_waits_for_its_soonest_row_to_end() -> None:
    """With the running cap reached, the wait is the soonest-ending row's steps: rows ending
    in 2 tokens admit, rows with 200 tokens left (200 x ~90 ms) refuse."""
    p = _policy(max_running=8)
    assert p.refusal(50, 0, 0.0, [], 0, [RunningRow(2)] * 8, 0) is None
    assert p.refusal(50, 0, 0.0, [], 0, [RunningRow(200)] * 8, 0) is not None


@pytest.mark.parametrize(("mode", "status"), [("429", 429), ("503", 503)])
def test_shed_mode_picks_the_status(mode: str, status: int) -> None:
    """`--shed 503` answers 503 (with Retry-After) instead of 429."""
    err = _policy(shed=mode).refusal(200, 0, 0.0, _queued([400] * 10), 0, [], 0)
    assert err is not None and err.status == status and err.retry_after is not None
    if mode == "503":
        assert isinstance(err, Unavailable)


def test_shed_mode_late_never_refuses_nor_sheds() -> None:
    """`--shed late` keeps every request (served late)."""
    p = _policy(shed="late")
    assert p.refusal(200, 0, 0.0, _queued([400] * 10), 0, [], 0) is None
    assert p.overdue(_queued([100], arrival=0.0), now=5.0) == []


def test_overdue_sheds_only_what_cannot_start_in_time() -> None:
    """A queued request whose objective passed (or will, by its own prefill) is shed; one with
    time left is kept."""
    p = _policy()
    old, fresh = _queued([100], arrival=0.0), _queued([100], arrival=0.9)
    assert p.overdue(old + fresh, now=1.0) == old
    assert p.shed == 1


def test_drift_follows_measured_turns() -> None:
    """Loop turns measured twice the prediction move drift towards 2 and scale predictions."""
    p = _policy()
    base = p.costs.decode_s(4)
    for _ in range(50):
        p.costs.observe(_Unit("decode", 4, 400, DECODE.seconds(4, 100)), 2 * DECODE.seconds(4, 100))
    assert 1.8 < p.costs.drift <= 2.0
    assert p.costs.decode_s(4) == pytest.approx(base * p.costs.drift, rel=1e-6)


def test_door_state_reads_rows_left_and_pending_prefill() -> None:
    """Rows left = max_tokens - generated (finished rows skipped); pending = rows x columns."""

    @dataclass
    class _P:
        max_tokens: int

    @dataclass
    class _G:
        params: _P
        generated: list[int]
        done: bool = False

    rows = [_G(_P(10), [1, 2]), _G(_P(5), [1], done=True)]
    running, tokens, pending = door_state(rows, [_Job(2, 30)])
    assert running == [RunningRow(8)]
    assert (tokens, pending) == (60, 2)


def test_levels_and_their_ttft_objectives() -> None:
    """`priority_slo_ms` gives each level its TTFT objective; without it every level has slo_ms."""
    p = _policy(priority_levels=2, priority_slo_ms=(2000.0, 500.0))
    assert p.slo.levels == 2 and p.slo.ttft(0) == 2.0 and p.slo.ttft(1) == 0.5
    assert _policy(priority_levels=3).slo.ttft_s == (1.0, 1.0, 1.0)


def test_each_refusal_and_shed_is_logged_with_its_prediction() -> None:
    """The decision log keeps why: where, length, due, predicted first token, work ahead."""
    p = _policy()
    err = p.refusal(200, 0, 0.0, _queued([400] * 5), 0, [], 0, now=10.0)
    assert err is not None
    p.overdue(_queued([100], arrival=0.0), now=11.0)
    (door, queue) = p.log.decisions()
    assert (door.where, door.at, door.length, door.queue_ahead, door.queued) == (
        "admission",
        10.0,
        200,
        5,
        5,
    )
    assert door.due_in == 1.0 and door.finish_in > door.due_in * 0.7
    assert (queue.where, queue.at, queue.length) == ("queue", 11.0, 100)
    assert queue.due_in == pytest.approx(-10.0)
    summary = p.describe(12.0)["decisions"]
    assert summary["totals"] == {"admission": 1, "queue": 1}


def test_a_higher_priority_still_waits_behind_its_own_lane() -> None:
    """A lane is FIFO whatever the levels: lower-level work queued in the request's own lane
    counts ahead of it; in another lane it does not."""
    p = _policy(priority_levels=2)
    queued = _queued([400] * 5, priority=0)
    for r in queued:
        r.lane = 3
    assert p.refusal(200, 1, 0.0, queued, 0, [], 0, lane=2) is None
    assert p.refusal(200, 1, 0.0, queued, 0, [], 0, lane=3) is not None


def test_prompt_tokens_the_prefix_cache_holds_are_not_priced() -> None:
    """Queued prompts whose first 384 of 400 tokens the prefix cache holds cost 16 tokens of
    prefill each: a prompt behind five of them is admitted where five uncached ones refuse
    it; and one queued since 0.3 s (due at 1.3 s) is kept at 1 s, where uncached it would be
    shed."""
    p = _policy()
    rows = [RunningRow(10)] * 4
    queued = _queued([400] * 5)
    assert p.refusal(200, 0, 0.0, queued, 0, rows, 0) is not None
    for r in queued:
        r.handle = SimpleNamespace(cached_tokens=384)
    assert prefill_tokens(queued[0]) == 16
    assert p.refusal(200, 0, 0.0, queued, 0, rows, 0) is None
    late = _queued([400], arrival=0.3)
    assert p.overdue(late, now=1.0) == late  # 0.41 s of prefill from 1.0 s misses 1.3 s...
    late[0].handle = SimpleNamespace(cached_tokens=384)
    assert p.overdue(late, now=1.0) == []  # ... 0.026 s does not
