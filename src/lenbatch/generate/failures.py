"""What happens when a unit raises: bisect, split and retry, or fail with an explicit error.

* A prefill that raises is bisected so a poison prompt fails alone (`ModelFailed`); the other
  halves are prefilled again with fresh caches.
* A prefill that runs out of memory is halved (several rows) or, one row, restarted in chunks
  of half the size; only one row that still runs out of memory in chunks of `MIN_OOM_CHUNK`
  columns fails (`OutOfMemory`, 503 with Retry-After).
* A decode step that raises loses the whole running batch (`ModelFailed`); one that runs out of
  memory is undone and hands its newest half back to prefill (recomputed over prompt and
  generated tokens, so nothing is lost), a single row failing.
* A mixed unit (a decode step and prefill chunks in one forward), or a prefill unit of several
  jobs, that raises cannot say which part failed: its decode step is undone and each of its
  jobs starts over from its first column, marked to run alone; the next units then fail, if
  they do, as a prefill or a decode step, and are recovered as above.
  Nobody fails for another's prompt.

`recover` runs on the event loop between units (the worker is idle then), changes the
`Decoder`'s jobs and running batch, and returns a `Recovery`: which generations end with which
error, and which scheduler lanes are free again. The engine applies it through the ledger.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from lenbatch.core.errors import LenbatchError, ModelFailed, OutOfMemory, is_out_of_memory
from lenbatch.generate.decode import Decoder
from lenbatch.generate.generation import Generation
from lenbatch.generate.jobs import PrefillJob
from lenbatch.generate.policy import Unit

__all__ = ["MIN_OOM_CHUNK", "Recovery", "recover"]

log = logging.getLogger("lenbatch.generate")

# Below this many columns per chunk, a single prompt that still runs out of memory fails.
MIN_OOM_CHUNK = 8


@dataclass
class Recovery:
    """What `recover` did about a unit that raised."""

    kind: str  # the unit's kind: "prefill", "decode" or "mixed"
    out_of_memory: bool
    failed: list[tuple[Generation, LenbatchError]] = field(default_factory=list)
    released_lanes: list[int] = field(default_factory=list)  # scheduler batches now done


def recover(decoder: Decoder, unit: Unit, exc: Exception) -> Recovery:
    """Deal with `exc`, raised by `unit`: split and retry what can be, fail the rest."""
    name = type(exc).__name__
    oom = is_out_of_memory(exc)
    if unit.job is not None and (unit.kind == "mixed" or unit.more):
        log.warning(
            "a unit of %d prefill jobs%s failed (%s); unmixing",
            len(unit.jobs),
            " and a decode step" if unit.kind == "mixed" else "",
            name,
        )
        _unmix(decoder, unit.jobs)
        return Recovery(unit.kind, oom)
    prefill = unit.kind == "prefill" and unit.job is not None
    if oom and prefill:
        assert unit.job is not None
        log.warning("prefill of %d prompts ran out of memory; splitting", unit.job.rows)
        lost, lanes = _split_job(decoder, unit.job, unit.cols)
        err: LenbatchError = OutOfMemory("the model ran out of memory on this prompt alone")
    elif oom:
        log.warning("decode step of %d rows ran out of memory", decoder.running_rows)
        lost, lanes = _preempt_half(decoder)
        err = OutOfMemory("the model ran out of memory on this prompt alone")
    elif prefill:
        assert unit.job is not None
        log.warning("prefill of %d prompts failed (%s); bisecting", unit.job.rows, name)
        lost, lanes = _bisect_job(decoder, unit.job)
        err = ModelFailed(f"the model failed on this prompt ({name}); others are unaffected")
    else:
        log.warning("decode step of %d rows failed (%s)", decoder.running_rows, name)
        lost, lanes = _drop_running(decoder)
        err = ModelFailed(f"the model failed during decoding ({name})")
    return Recovery(unit.kind, oom, [(g, err) for g in lost], lanes)


def _unmix(decoder: Decoder, jobs: list[PrefillJob]) -> None:
    """A unit of several segments raised (a decode step and prefill chunks, or several jobs'
    chunks): undo the decode step's partial cache writes and restart each job from its
    first column with a fresh cache, to run alone, in the same queue order."""
    if decoder.running is not None:
        decoder.running.rollback()
    running = {id(g) for g in decoder.rows}
    for job in reversed(jobs):
        if job in decoder.jobs:
            decoder.jobs.remove(job)
        elif all(id(g) in running for g in job.gens):
            continue  # it joined the running batch before the failure: it is decoding
        for g in job.gens:
            g.timings.prefill_compute = 0.0
        _restart(decoder, job, job.max_cols, alone=True)


def _restart(decoder: Decoder, job: PrefillJob, max_cols: int | None, *, alone: bool) -> None:
    """Put `job` back at the head of the prefill queue from its first column (or past its
    prompts' prefixes the prefix cache holds), with a fresh cache (a failed unit may have
    written some layers' caches and not others)."""
    retry = PrefillJob(
        job.lane,
        job.gens,
        job.batch,
        decoder.runner.new_cache(),
        releases=job.releases,
        max_cols=max_cols,
        alone=alone,
    )
    decoder.jobs.appendleft(retry)


def _requeue_halves(decoder: Decoder, job: PrefillJob, max_cols: int | None) -> None:
    """Put the two halves of `job` at the head of the prefill queue, each with a fresh cache
    and chunks of at most `max_cols` columns; only the second frees the scheduler slot (the
    scheduler counted the batch once)."""
    mid = job.rows // 2
    halves = [(job.gens[:mid], False), (job.gens[mid:], job.releases)]
    for gens, releases in reversed(halves):
        half = decoder.new_job(
            job.lane, gens, releases=releases, max_cols=max_cols, alone=job.alone
        )
        decoder.jobs.appendleft(half)


def _bisect_job(decoder: Decoder, job: PrefillJob) -> tuple[list[Generation], list[int]]:
    """A prefill of `job` raised: a job of one fails, a larger one is replaced by its halves.
    Returns (generations to fail now, scheduler lanes freed)."""
    if job in decoder.jobs:
        decoder.jobs.remove(job)
    if job.rows == 1:
        return job.gens, decoder.release(job)
    _requeue_halves(decoder, job, None)
    return [], []


def _split_job(decoder: Decoder, job: PrefillJob, cols: int) -> tuple[list[Generation], list[int]]:
    """A prefill chunk of `cols` columns of `job` ran out of memory: retry smaller.

    A job of several rows is split in two; a job of one row restarts from its first column
    with chunks of half the size, or fails when those would be under `MIN_OOM_CHUNK` columns.
    """
    if job in decoder.jobs:
        decoder.jobs.remove(job)
    if job.rows > 1:
        _requeue_halves(decoder, job, job.max_cols)
        return [], []
    smaller = min(cols, job.batch.width) // 2
    if smaller < MIN_OOM_CHUNK:
        return job.gens, decoder.release(job)
    _restart(decoder, job, smaller, alone=job.alone)
    return [], []


def _preempt_half(decoder: Decoder) -> tuple[list[Generation], list[int]]:
    """A decode step ran out of memory: undo its partial cache writes and move the newest half
    of the running rows back to prefill. A single row that runs out of memory fails."""
    kv = decoder.running
    if kv is None or not decoder.rows:
        return [], []
    kv.rollback()
    if len(decoder.rows) == 1:
        return _drop_running(decoder)
    # The newest by arrival (rows change places as others end: `Decoder._drop_done`).
    by_age = sorted(range(len(decoder.rows)), key=lambda i: decoder.rows[i].request.arrival)
    half = len(decoder.rows) // 2
    keep = sorted(by_age[:half])
    moved = [decoder.rows[i] for i in sorted(by_age[half:])]
    decoder.rows = [decoder.rows[i] for i in keep]
    kv.select(keep)
    # Its rows' scheduler slot was already accounted for: the job frees none.
    decoder.jobs.appendleft(decoder.new_job(-1, moved, releases=False))
    decoder.preempted += len(moved)
    return [], []


def _drop_running(decoder: Decoder) -> tuple[list[Generation], list[int]]:
    """A decode step raised: the whole batch is lost. Returns (its generations, lanes freed)."""
    lost = list(decoder.rows)
    decoder.rows.clear()
    decoder.running = None
    return lost, decoder.release_held()
