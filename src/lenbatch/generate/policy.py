"""Decode modes: which rows may be admitted now, and which unit of work runs next.

Both modes take prefill batches from the same queues and scheduler (`lenbatch.core.scheduler`), so
length bucketing, max wait and the token budget mean the same in both; they differ only here.

* `lockstep` (alias `static`): a scheduler batch is prefilled in one pass and decoded together
  until every row has finished; rows that finish leave the batch (and its KV cache) at once, but
  nobody joins until the batch is empty.
* `continuous`: iteration-level scheduling. New batches are admitted whenever the running batch
  has room (`max_running`); they are prefilled in chunks of at most `step_tokens` tokens minus the
  running rows (twice `step_tokens` while at most `FEW_ROWS` rows decode), so a long prompt
  never stalls running streams for more than one chunk (with no stream running, a prompt is
  prefilled whole, in one pass); when its
  prefill is done a batch's rows join the running decode batch. Where the runner can (the lean
  Llama path, `Decoder.mixer`), each chunk runs in one forward with the running rows' decode
  step (a "mixed" unit, as vLLM's and llama.cpp's steps carry prompt and decode tokens
  together): the weights are read once for both and running streams keep getting tokens while
  a prompt is prefilled; only a job's last chunk beside at most `FEW_ROWS` rows runs alone, so
  that its first tokens wait for no decode row. Elsewhere prefill chunks and decode steps
  alternate. On the same runners a chunk that ends its job leaves the rest of the unit's budget
  to the next queued jobs (scheduler batches of other buckets, or later ones), in the same
  forward: in a burst, short prompts then share a pass over the weights rather than queueing
  for a unit each.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

from lenbatch.config import DecodeMode, GenerationConfig
from lenbatch.generate.decode import Decoder
from lenbatch.generate.jobs import PrefillJob

__all__ = [
    "FEW_ROWS",
    "ContinuousPolicy",
    "DecodePolicy",
    "LockstepPolicy",
    "Unit",
    "make_policy",
]

# Running rows up to which a prefill chunk may take twice `step_tokens`. A bigger chunk saves a
# unit (a pass over the weights, a decode step's wait) per chunk it replaces and stalls each
# running stream once for longer; with few streams those stalls are rare among their token
# gaps, with many they are not. Measured on an Intel Xeon family 6 model 167 (2 cores, SmolLM2,
# bf16, the dev trace's completions): at 5x issue 25's light load (13 rows per decode step) a
# 512-token budget against 256 took TTFT P95 from 382-418 to 298-334 ms but ITL P95 from 97-100
# to 125-136, so past FEW_ROWS the budget stays; at the light load (1.8 rows) this rule against
# a flat 256, alternated old/new/new/old: TTFT P95 177/186 -> 153/158 ms, ITL P95 31/32 -> 29/30.
# Up to FEW_ROWS rows, too, a job's last chunk runs alone rather than mixed: its first tokens
# then wait only for their prompt's forward (a 400-token prompt's forward with 2 decode rows
# mixed in takes 1.07-1.10x its forward alone, Intel Xeon family 6 model 207), and the few
# streams take their step after it. The light load, lenbatch alone, four pairs alternated:
# mean TTFT -5 %, ITL unchanged (bench/results/xeon-model207/README.md, thirteenth session).
FEW_ROWS = 4


@dataclass(frozen=True, slots=True)
class Unit:
    """One step of work: a prefill chunk of `cols` columns of `job`, a decode step, or both in
    one forward ("mixed")."""

    kind: Literal["prefill", "decode", "mixed"]
    job: PrefillJob | None = None
    cols: int = 0
    # The next queued jobs' chunks in the same forward (the runner's segments), in queue
    # order: `job` and every one of them but the last finish in this unit.
    more: tuple[tuple[PrefillJob, int], ...] = ()

    @property
    def jobs(self) -> list[PrefillJob]:
        """Every prefill job the unit runs a chunk of, oldest first."""
        return [j for j, _ in self.chunks]

    @property
    def chunks(self) -> list[tuple[PrefillJob, int]]:
        """`(job, columns)` of each prefill chunk the unit runs, oldest job first."""
        return [] if self.job is None else [(self.job, self.cols), *self.more]


class DecodePolicy(Protocol):
    """The rules of one decode mode."""

    @property
    def release_on_merge(self) -> bool:
        """True when a batch frees its scheduler slot as soon as it joins the decode batch."""
        ...

    def capacity(self, decoder: Decoder) -> int:
        """How many new sequences may be admitted now (0: do not ask the scheduler)."""
        ...

    def next_unit(self, decoder: Decoder, last: str | None) -> Unit | None:
        """The next unit to run (None when idle); `last` is the kind of the previous unit."""
        ...


@dataclass(frozen=True, slots=True)
class LockstepPolicy:
    """Lockstep batches: admit only into an empty engine; prefill whole; decode to the end."""

    max_batch: int
    release_on_merge: bool = False

    def capacity(self, decoder: Decoder) -> int:
        """A full batch when nothing is running or waiting for prefill, else nothing."""
        return self.max_batch if decoder.idle else 0

    def next_unit(self, decoder: Decoder, last: str | None) -> Unit | None:
        """Prefill a waiting batch in one pass, else decode."""
        if decoder.jobs:
            job = decoder.jobs[0]
            return Unit("prefill", job, min(job.remaining, job.max_cols or job.remaining))
        if decoder.running_rows:
            return Unit("decode")
        return None


@dataclass(frozen=True, slots=True)
class ContinuousPolicy:
    """Continuous batching with chunked prefill under a per-step token budget."""

    max_running: int
    step_tokens: int
    release_on_merge: bool = True

    def capacity(self, decoder: Decoder) -> int:
        """Free room in the running batch, counting rows already waiting for prefill."""
        return max(0, self.max_running - decoder.running_rows - decoder.pending_rows)

    def next_unit(self, decoder: Decoder, last: str | None) -> Unit | None:
        """A prefill chunk mixed with the decode step where the runner can, else prefill
        chunks and decode steps in turn while both have work. Where the runner can, a chunk
        that ends its job leaves what is left of the budget to the next queued jobs, in the
        same forward."""
        if decoder.jobs:
            job = decoder.jobs[0]
            rows = decoder.running_rows
            budget = (2 if rows <= FEW_ROWS else 1) * self.step_tokens - rows
            # With nothing decoding, no stream waits on this unit: the whole prompt in one pass
            # (each chunk would pay its own pass over the weights), up to the memory cap.
            cols = max(1, budget // job.rows) if decoder.running_rows else job.remaining
            if job.max_cols is not None:
                cols = min(cols, job.max_cols)
            cols = min(cols, job.remaining)
            # A job's last chunk gives its first tokens: beside few streams it runs alone, so
            # they wait for no decode rows (see FEW_ROWS), and the decode step follows it.
            first_tokens_alone = rows <= FEW_ROWS and cols >= job.remaining
            mix = decoder.mixer is not None and not job.alone and not first_tokens_alone
            if decoder.running_rows and mix:
                more = _more(decoder, cols, budget - cols * job.rows)
                return Unit("mixed", job, cols, more)
            if not decoder.running_rows or last != "prefill":
                return Unit("prefill", job, cols, _more(decoder, cols, budget - cols * job.rows))
        if decoder.running_rows:
            return Unit("decode")
        return None


def _more(decoder: Decoder, cols: int, left: int) -> tuple[tuple[PrefillJob, int], ...]:
    """Chunks of the jobs queued after the first, in order, for the `left` tokens of a unit's
    budget that the first job's chunk (`cols` columns) did not take. Nothing rides along
    unless that chunk ends its job (jobs finish in queue order); packing stops at a job that
    its chunk does not end, one that must run alone (after a failed unit), one that waits for
    the blocks of the job before it (`PrefillJob.after_prefix`), and when the budget is
    spent. Several short prompts of a burst then share one pass over the weights instead of a
    unit each."""
    jobs = decoder.jobs
    if decoder.mixer is None or jobs[0].alone or cols < jobs[0].remaining:
        return ()
    out: list[tuple[PrefillJob, int]] = []
    for job in list(jobs)[1:]:
        if job.alone or job.after_prefix or left < job.rows:
            break
        cols = min(job.remaining, left // job.rows)
        if job.max_cols is not None:
            cols = min(cols, job.max_cols)
        out.append((job, cols))
        left -= cols * job.rows
        if cols < job.remaining:
            break
    return tuple(out)


def make_policy(cfg: GenerationConfig, max_batch: int) -> DecodePolicy:
    """The policy for `cfg.mode`; `max_batch` is the batching config's batch limit."""
    if cfg.mode is DecodeMode.LOCKSTEP:
        return LockstepPolicy(max_batch)
    return ContinuousPolicy(cfg.max_running, cfg.step_tokens)
