"""Decode policies: who may be admitted, and which unit runs next."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from lenbatch.config import GenerationConfig
from lenbatch.generate.policy import FEW_ROWS, ContinuousPolicy, LockstepPolicy, make_policy


@dataclass
class _Job:
    rows: int
    remaining: int
    max_cols: int | None = None
    alone: bool = False
    after_prefix: bool = False


@dataclass
class _Core:
    """The facts a policy reads from the decode core."""

    jobs: deque[Any] = field(default_factory=deque)
    running_rows: int = 0
    mixer: Any = None  # not None: one forward can carry a decode step and a prefill chunk

    @property
    def pending_rows(self) -> int:
        return sum(j.rows for j in self.jobs)

    @property
    def idle(self) -> bool:
        return not self.jobs and not self.running_rows


def test_lockstep_admits_only_into_an_empty_engine() -> None:
    """Lockstep batching takes a new batch only when nothing runs or waits for prefill."""
    p = LockstepPolicy(max_batch=8)
    assert p.capacity(_Core()) == 8  # type: ignore[arg-type]
    assert p.capacity(_Core(running_rows=1)) == 0  # type: ignore[arg-type]
    assert p.capacity(_Core(jobs=deque([_Job(2, 10)]))) == 0  # type: ignore[arg-type]


def test_lockstep_prefills_whole_then_decodes() -> None:
    """A waiting batch is prefilled in one pass; otherwise the running batch decodes."""
    p = LockstepPolicy(max_batch=8)
    job = _Job(3, 40)
    unit = p.next_unit(_Core(jobs=deque([job])), None)  # type: ignore[arg-type]
    assert unit is not None and unit.kind == "prefill" and unit.cols == 40
    unit = p.next_unit(_Core(running_rows=3), "prefill")  # type: ignore[arg-type]
    assert unit is not None and unit.kind == "decode"
    assert p.next_unit(_Core(), None) is None  # type: ignore[arg-type]


def test_continuous_capacity_counts_running_and_pending_rows() -> None:
    """Room = max_running minus rows decoding minus rows admitted but not yet prefilled."""
    p = ContinuousPolicy(max_running=10, step_tokens=64)
    core = _Core(jobs=deque([_Job(3, 5)]), running_rows=4)
    assert p.capacity(core) == 3  # type: ignore[arg-type]
    assert p.capacity(_Core(running_rows=12)) == 0  # type: ignore[arg-type]


def test_continuous_chunks_prefill_under_the_step_budget_and_alternates() -> None:
    """A chunk gets the step budget minus the running rows, split over the job's rows, and
    decode steps run between chunks while sequences are decoding; with none decoding, the
    prompt runs whole."""
    p = ContinuousPolicy(max_running=32, step_tokens=64)
    core = _Core(jobs=deque([_Job(4, 100)]), running_rows=8)
    unit = p.next_unit(core, "decode")  # type: ignore[arg-type]
    assert unit is not None and unit.kind == "prefill" and unit.cols == (64 - 8) // 4
    after = p.next_unit(core, "prefill")  # type: ignore[arg-type]
    assert after is not None and after.kind == "decode"
    # with nothing decoding no stream waits on the unit: the whole prompt in one pass
    alone = p.next_unit(_Core(jobs=deque([_Job(4, 100)])), "prefill")  # type: ignore[arg-type]
    assert alone is not None and alone.kind == "prefill" and alone.cols == 100


def test_continuous_mixes_chunks_into_decode_steps_where_the_runner_can() -> None:
    """With a mixing runner every chunk rides with the decode step, under the same budget;
    a job marked to run alone (after a mixed unit failed) alternates as without one, and
    with nothing running a chunk runs alone."""
    p = ContinuousPolicy(max_running=32, step_tokens=64)
    core = _Core(jobs=deque([_Job(4, 100)]), running_rows=8, mixer=object())
    for last in (None, "decode", "prefill", "mixed"):
        unit = p.next_unit(core, last)  # type: ignore[arg-type]
        assert unit is not None and unit.kind == "mixed" and unit.cols == (64 - 8) // 4
        assert unit.job is core.jobs[0]
    tail = _Core(jobs=deque([_Job(2, 5)]), running_rows=8, mixer=object())
    unit = p.next_unit(tail, "mixed")  # type: ignore[arg-type]
    assert unit is not None and unit.kind == "mixed" and unit.cols == 5  # the job's remainder
    alone = _Core(jobs=deque([_Job(4, 100, alone=True)]), running_rows=8, mixer=object())
    assert p.next_unit(alone, "decode").kind == "prefill"  # type: ignore[arg-type,union-attr]
    assert p.next_unit(alone, "prefill").kind == "decode"  # type: ignore[arg-type,union-attr]
    idle = _Core(jobs=deque([_Job(4, 100)]), mixer=object())
    assert p.next_unit(idle, None).kind == "prefill"  # type: ignore[arg-type,union-attr]
    assert p.next_unit(_Core(running_rows=3, mixer=object()), "mixed").kind == "decode"  # type: ignore[arg-type,union-attr]
    # lockstep never mixes: it admits only into an empty engine
    lock = LockstepPolicy(max_batch=8)
    assert lock.next_unit(core, "decode").kind == "prefill"  # type: ignore[arg-type,union-attr]


def test_with_few_streams_running_a_chunk_may_take_twice_the_budget() -> None:
    """Up to FEW_ROWS running rows a chunk gets twice `step_tokens` minus the rows (few
    streams wait on it); beyond, the budget minus the rows."""
    p = ContinuousPolicy(max_running=32, step_tokens=64)
    for rows, cols in ((1, 2 * 64 - 1), (FEW_ROWS, 2 * 64 - FEW_ROWS), (FEW_ROWS + 1, 64 - 5)):
        core = _Core(jobs=deque([_Job(1, 1000)]), running_rows=rows, mixer=object())
        unit = p.next_unit(core, "decode")  # type: ignore[arg-type]
        assert unit is not None and unit.kind == "mixed" and unit.cols == cols, rows


def test_with_few_streams_running_a_jobs_last_chunk_runs_alone() -> None:
    """Up to FEW_ROWS running rows, the chunk that ends a job (its first tokens come out of it)
    runs alone and the decode step follows; an earlier chunk, or any chunk beside more rows,
    rides with the decode step."""
    p = ContinuousPolicy(max_running=32, step_tokens=64)
    last = _Core(jobs=deque([_Job(1, 100)]), running_rows=FEW_ROWS, mixer=object())
    unit = p.next_unit(last, "decode")  # type: ignore[arg-type]
    assert unit is not None and unit.kind == "prefill" and unit.cols == 100
    assert p.next_unit(last, "prefill").kind == "decode"  # type: ignore[arg-type,union-attr]
    earlier = _Core(jobs=deque([_Job(1, 1000)]), running_rows=FEW_ROWS, mixer=object())
    assert p.next_unit(earlier, "decode").kind == "mixed"  # type: ignore[arg-type,union-attr]
    many = _Core(jobs=deque([_Job(1, 50)]), running_rows=FEW_ROWS + 1, mixer=object())
    assert p.next_unit(many, "decode").kind == "mixed"  # type: ignore[arg-type,union-attr]


def test_continuous_chunk_is_at_least_one_column() -> None:
    """Even when running rows use the whole budget, prefill still advances."""
    p = ContinuousPolicy(max_running=64, step_tokens=8)
    unit = p.next_unit(_Core(jobs=deque([_Job(4, 9)]), running_rows=20), "decode")  # type: ignore[arg-type]
    assert unit is not None and unit.cols == 1


def test_a_job_that_ran_out_of_memory_gets_smaller_chunks_in_both_modes() -> None:
    """After an out-of-memory retry a job's chunk cap bounds its prefill columns."""
    job = _Job(1, 40, max_cols=10)
    for policy in (LockstepPolicy(max_batch=8), ContinuousPolicy(max_running=8, step_tokens=64)):
        unit = policy.next_unit(_Core(jobs=deque([job])), None)  # type: ignore[arg-type]
        assert unit is not None and unit.kind == "prefill" and unit.cols == 10


def test_static_is_another_name_for_the_lockstep_policy() -> None:
    """`lockstep`, or its former name `static`, decodes one scheduler batch at a time."""
    for name in ("lockstep", "static"):
        policy = make_policy(GenerationConfig(mode=name), max_batch=8)  # type: ignore[arg-type]
        assert policy == LockstepPolicy(max_batch=8)
    policy = make_policy(GenerationConfig(mode="continuous", max_running=5), max_batch=8)  # type: ignore[arg-type]
    assert policy == ContinuousPolicy(max_running=5, step_tokens=256)


def test_a_chunk_that_ends_its_job_leaves_the_budget_to_the_next_jobs() -> None:
    """Where the runner can, the jobs queued behind a chunk that ends its job take what is
    left of the unit's budget, in queue order, in the same forward: whole while they fit, the
    last one possibly in part; packing stops at a job marked to run alone or to wait for the
    blocks of the job before it."""
    p = ContinuousPolicy(max_running=64, step_tokens=64)
    a, b, c, d = _Job(1, 10), _Job(2, 8), _Job(1, 30), _Job(1, 5)
    core = _Core(jobs=deque([a, b, c, d]), running_rows=8, mixer=object())
    unit = p.next_unit(core, "decode")  # type: ignore[arg-type]
    # budget 64 - 8 rows = 56: a takes 10, b 2 x 8 = 16, c the last 30
    assert unit is not None and unit.kind == "mixed" and unit.cols == 10
    assert unit.more == ((b, 8), (c, 30)) and unit.jobs == [a, b, c]
    # a job the budget does not hold whole is chunked, and nothing rides behind it
    core = _Core(jobs=deque([a, _Job(1, 100), d]), running_rows=8, mixer=object())
    unit = p.next_unit(core, "decode")  # type: ignore[arg-type]
    assert unit is not None and [cols for _, cols in unit.chunks] == [10, 46]
    # a first chunk that does not end its job takes no one along
    core = _Core(jobs=deque([_Job(1, 100), d]), running_rows=8, mixer=object())
    unit = p.next_unit(core, "decode")  # type: ignore[arg-type]
    assert unit is not None and unit.cols == 56 and unit.more == ()
    # a job that must run alone (a unit with it failed) stops the packing, first or later
    core = _Core(jobs=deque([a, _Job(1, 5, alone=True), d]), running_rows=8, mixer=object())
    assert p.next_unit(core, "decode").more == ()  # type: ignore[arg-type,union-attr]
    core = _Core(jobs=deque([_Job(1, 5, alone=True), d]), running_rows=8, mixer=object())
    assert p.next_unit(core, "decode").more == ()  # type: ignore[arg-type,union-attr]
    # so does a job waiting for the blocks of the job before it (a call's other choices)
    core = _Core(jobs=deque([a, _Job(2, 5, after_prefix=True), d]), running_rows=8, mixer=object())
    assert p.next_unit(core, "decode").more == ()  # type: ignore[arg-type,union-attr]
    # an idle engine prefills its first job whole and the next ones under twice the budget
    core = _Core(jobs=deque([_Job(1, 100), _Job(1, 20), _Job(1, 50)]), mixer=object())
    unit = p.next_unit(core, None)  # type: ignore[arg-type]
    assert unit is not None and unit.kind == "prefill"
    assert [cols for _, cols in unit.chunks] == [100, 20, 8]
    # beside few rows the last chunks run without the decode step, still packed
    core = _Core(jobs=deque([a, d]), running_rows=2, mixer=object())
    unit = p.next_unit(core, "decode")  # type: ignore[arg-type]
    assert unit is not None and unit.kind == "prefill" and unit.more == ((d, 5),)
    # a runner that cannot carry several segments gets one job a unit
    core = _Core(jobs=deque([a, d]), running_rows=8)
    assert p.next_unit(core, "decode").more == ()  # type: ignore[arg-type,union-attr]
