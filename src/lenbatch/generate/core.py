"""The compute side of generation: prefill jobs, the running decode batch, one unit at a time.

`DecodeCore` holds what runs on the model: prefill jobs (scheduler batches being prefilled,
possibly in chunks, each with its own KV cache) and the running decode batch (a right-aligned
`KVBatch`). The engine asks a policy (static or continuous) which unit to run next, then runs it
in its worker thread through `prefill()` or `decode()`; each returns the tokens produced, which
the event loop delivers. The core never touches the queues or futures.

A prefill unit runs columns `[done, done + cols)` of a left-padded job through the model with
that job's cache; after its last chunk every row samples its first token and the job's rows join
the running batch (`kvcache.merge`). A decode unit feeds each running row its last token and
samples the next; finished and cancelled rows are then removed from the batch and its cache.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from lenbatch.core.collate import Collated, collate
from lenbatch.generate.kvcache import KVBatch, cache_bytes
from lenbatch.generate.sampling import choose_tokens, mask_eos
from lenbatch.generate.sequence import Sequence
from lenbatch.generate.static import StaticRunner
from lenbatch.runners.base import CausalRunner
from lenbatch.serving.messages import Delta

__all__ = ["MIN_OOM_CHUNK", "DecodeCore", "PrefillJob", "UnitResult"]

# Below this many columns per chunk, a single prompt that still runs out of memory fails.
MIN_OOM_CHUNK = 8


@dataclass(eq=False)  # compared by identity (queue removal); fields hold arrays
class PrefillJob:
    """A scheduler batch being prefilled: its sequences, padded inputs and partial cache."""

    lane: int
    seqs: list[Sequence]
    batch: Collated
    cache: Any
    done_cols: int = 0
    # False for the first half of a bisected batch: the scheduler counted the batch once, so
    # only its last part frees the slot.
    releases: bool = True
    # Most columns per prefill chunk after this job ran out of memory (None: the policy's).
    max_cols: int | None = None

    @property
    def rows(self) -> int:
        """Sequences in the job."""
        return len(self.seqs)

    @property
    def width(self) -> int:
        """Padded prompt length."""
        return int(self.batch.input_ids.shape[1])

    @property
    def remaining(self) -> int:
        """Prompt columns not yet run."""
        return self.width - self.done_cols


@dataclass
class UnitResult:
    """What one unit produced, for delivery and metrics."""

    kind: str  # "prefill" or "decode"
    deltas: list[tuple[Sequence, Delta]] = field(default_factory=list)
    released_lanes: list[int] = field(default_factory=list)  # scheduler batches now done
    compute_s: float = 0.0
    rows: int = 0
    tokens: int = 0  # prefill: real prompt tokens of the chunk; decode: real cached tokens
    padded: int = 0  # prefill: chunk tokens incl. padding; decode: cache columns x rows
    job: PrefillJob | None = None  # the prefill job this unit ran
    finished_job: bool = False


class DecodeCore:
    """Prefill jobs and the running decode batch of one model."""

    def __init__(
        self,
        runner: CausalRunner,
        clock: Callable[[], float],
        release_on_merge: bool,
        static: StaticRunner | None = None,
    ) -> None:
        self.runner = runner
        # Static shapes (and compiled graphs) for whole prefills and decode steps that fit them.
        self.static = static
        self.now = clock
        # Continuous batching frees a scheduler slot once a batch's rows joined the decode batch;
        # static batching holds it until every row of the batch has finished.
        self.release_on_merge = release_on_merge
        self.jobs: deque[PrefillJob] = deque()
        self.running: KVBatch | None = None
        self.rows: list[Sequence] = []
        self._held_lanes: list[int] = []
        self.kv_peak_bytes = 0
        self.preempted = 0  # rows moved back to prefill after a decode step ran out of memory

    # ------------------------------------------------------------------ state

    @property
    def running_rows(self) -> int:
        """Sequences in the decode batch."""
        return len(self.rows)

    @property
    def pending_rows(self) -> int:
        """Sequences admitted but not yet prefilled."""
        return sum(j.rows for j in self.jobs)

    @property
    def idle(self) -> bool:
        """Nothing to compute."""
        return not self.jobs and not self.rows

    def kv_bytes(self) -> int:
        """Bytes of every KV cache held now (running batch and partial prefills)."""
        total = self.running.nbytes() if self.running is not None else 0
        for job in self.jobs:
            total += cache_bytes(job.cache)
        self.kv_peak_bytes = max(self.kv_peak_bytes, total)
        return total

    def kv_real_bytes(self) -> int:
        """Bytes of the running batch's cache that hold real (non-padding) tokens."""
        if self.running is None or self.running.width == 0:
            return 0
        return (
            self.running.nbytes()
            * self.running.real_tokens
            // (self.running.rows * self.running.width)
        )

    def add_job(self, lane: int, seqs: list[Sequence], pad_to: int | None) -> PrefillJob:
        """Collate a scheduler batch (left padding, position ids) and queue it for prefill."""
        job = PrefillJob(lane, seqs, self._collate(seqs, pad_to), self.runner.new_cache())
        self.jobs.append(job)
        return job

    def _collate(self, seqs: list[Sequence], pad_to: int | None) -> Collated:
        # A sequence preempted from the decode batch is prefilled again over its prompt and
        # what it has generated so far, then continues where it was (vLLM's recompute).
        return collate(
            [(s.request.token_ids or []) + s.generated for s in seqs],
            self.runner.info.pad_token_id,
            "left",
            pad_to=pad_to,
            position_ids=True,
        )

    # ------------------------------------------------------------------ units

    def prefill(self, job: PrefillJob, cols: int) -> UnitResult:
        """Run the next `cols` prompt columns of `job`; after its last, sample first tokens."""
        if job is not self.jobs[0]:
            raise RuntimeError("bug: prefill must run the oldest job first")
        lo, hi = job.done_cols, min(job.width, job.done_cols + max(1, cols))
        b = job.batch
        dev = self.runner.device
        ids = torch.from_numpy(b.input_ids[:, lo:hi]).to(dev)
        mask = torch.from_numpy(b.attention_mask[:, :hi]).to(dev)
        assert b.position_ids is not None
        pos = torch.from_numpy(b.position_ids[:, lo:hi]).to(dev)
        static = self.static
        start = self.now()
        if static is not None and lo == 0 and hi == job.width and static.prefill_fits(hi):
            logits, job.cache = static.prefill(b)
        else:
            if static is not None:
                static.graphs.count_eager()
            logits = self.runner.forward(ids, mask, pos, job.cache)
        end = self.now()
        for s in job.seqs:
            t = s.timings
            if lo == 0:
                t.prefill_start = start
            t.prefill_compute += end - start
        job.done_cols = hi
        real = int(b.attention_mask[:, lo:hi].sum())
        result = UnitResult("prefill", compute_s=end - start, rows=job.rows, tokens=real, job=job)
        result.padded = job.rows * (hi - lo)
        self.kv_bytes()
        if hi < job.width:
            return result
        # Sample before the job leaves the queue, so a failure here is still the job's own.
        tokens = _choose(logits, job.seqs, self.runner.eos_token_ids)
        self.jobs.popleft()
        result.finished_job = True
        for s in job.seqs:
            s.timings.prefill_end = end
        eos = self.runner.eos_token_ids
        for s, tok in zip(job.seqs, tokens, strict=True):
            result.deltas.append((s, s.add_token(tok, eos)))
        next_pos = torch.tensor(b.lengths, dtype=torch.long, device=dev)
        last = torch.tensor(tokens, dtype=torch.long, device=dev)
        # The prefill's keys and values are copied once, into the running batch's buffers
        # (leading all-padding columns, e.g. of a bucket's pad_to, are left out).
        if self.running is None or self.running.rows == 0:
            self.running = KVBatch(job.cache, mask, next_pos, last)
        else:
            self.running.join(job.cache, mask, next_pos, last)
        self.rows.extend(job.seqs)
        result.released_lanes.extend(self._release(job))
        result.released_lanes.extend(self._drop_done())
        return result

    def decode(self) -> UnitResult:
        """One decode step for every running row."""
        result = UnitResult("decode")
        result.released_lanes.extend(self._drop_done())
        kv = self.running
        if kv is None or not self.rows:
            return result
        static = self.static
        start = self.now()
        if static is not None and static.decode_fits(kv):
            logits, mask = static.decode(kv)
        else:
            if static is not None:
                static.graphs.count_eager()
            ids, mask, pos = kv.step_inputs()
            logits = self.runner.forward(ids, mask, pos, kv.cache)
        end = self.now()
        tokens = _choose(logits, self.rows, self.runner.eos_token_ids)
        kv.advance(mask, torch.tensor(tokens, dtype=torch.long, device=kv.mask.device))
        eos = self.runner.eos_token_ids
        for s, tok in zip(self.rows, tokens, strict=True):
            result.deltas.append((s, s.add_token(tok, eos)))
        result.compute_s = end - start
        result.rows = kv.rows
        # What attention read this step: real cached tokens vs all columns (padding included).
        result.tokens = kv.real_tokens
        result.padded = kv.rows * kv.width
        self.kv_bytes()
        result.released_lanes.extend(self._drop_done())
        return result

    # ------------------------------------------------------------------ failures

    def fail_job(self, job: PrefillJob) -> tuple[list[Sequence], list[int]]:
        """A prefill of `job` raised: bisect it so a poison prompt fails alone.

        Returns (sequences to fail now, scheduler lanes freed). A job of one fails; a larger
        job is replaced at the head of the queue by its two halves, each with a fresh cache.
        """
        if job in self.jobs:
            self.jobs.remove(job)
        if job.rows == 1:
            return job.seqs, self._release(job)
        mid = job.rows // 2
        halves = [(job.seqs[:mid], False), (job.seqs[mid:], job.releases)]
        for seqs, releases in reversed(halves):
            half = PrefillJob(job.lane, seqs, self._collate(seqs, None), self.runner.new_cache())
            half.releases = releases
            self.jobs.appendleft(half)
        return [], []

    def oom_job(self, job: PrefillJob, cols: int) -> tuple[list[Sequence], list[int]]:
        """A prefill chunk of `cols` columns of `job` ran out of memory: retry smaller.

        A job of several rows is split in two (each half retried with a fresh cache); a job of
        one row restarts from its first column with chunks of half the size. Returns the
        sequences to fail now (one row that ran out of memory even in chunks of
        `MIN_OOM_CHUNK` columns) and the scheduler lanes freed.
        """
        if job in self.jobs:
            self.jobs.remove(job)
        if job.rows > 1:
            mid = job.rows // 2
            halves = [(job.seqs[:mid], False), (job.seqs[mid:], job.releases)]
            for seqs, releases in reversed(halves):
                half = PrefillJob(
                    job.lane, seqs, self._collate(seqs, None), self.runner.new_cache()
                )
                half.releases, half.max_cols = releases, job.max_cols
                self.jobs.appendleft(half)
            return [], []
        smaller = min(cols, job.width) // 2
        if smaller < MIN_OOM_CHUNK:
            return job.seqs, self._release(job)
        # The failed chunk may have written some layers' caches and not others: start over.
        retry = PrefillJob(job.lane, job.seqs, job.batch, self.runner.new_cache())
        retry.releases, retry.max_cols = job.releases, smaller
        self.jobs.appendleft(retry)
        return [], []

    def oom_running(self) -> tuple[list[Sequence], list[int]]:
        """A decode step ran out of memory: undo its partial cache writes and move the newest
        half of the running rows back to prefill (recomputed later over prompt and generated
        tokens, so nothing is lost). A single row that runs out of memory fails: returned with
        the scheduler lanes freed."""
        kv = self.running
        if kv is None or not self.rows:
            return [], []
        kv.rollback()
        if len(self.rows) == 1:
            return self.fail_running()
        keep = len(self.rows) // 2
        moved = self.rows[keep:]
        self.rows = self.rows[:keep]
        kv.select(list(range(keep)))
        job = PrefillJob(-1, moved, self._collate(moved, None), self.runner.new_cache())
        job.releases = False  # its rows' scheduler slot was already accounted for
        self.jobs.appendleft(job)
        self.preempted += len(moved)
        return [], []

    def fail_running(self) -> tuple[list[Sequence], list[int]]:
        """A decode step raised: the whole batch is lost. Returns (its sequences, lanes freed)."""
        lost = list(self.rows)
        self.rows.clear()
        self.running = None
        return lost, self.release_held()

    def release_held(self) -> list[int]:
        """Scheduler lanes held by a static batch that has nothing left running."""
        if self.rows:
            return []
        lanes, self._held_lanes = self._held_lanes, []
        return lanes

    def _release(self, job: PrefillJob) -> list[int]:
        """Free (continuous) or hold until the batch drains (static) the job's scheduler slot."""
        if not job.releases:
            return []
        if self.release_on_merge:
            return [job.lane]
        self._held_lanes.append(job.lane)
        return self.release_held()

    def _drop_done(self) -> list[int]:
        """Remove finished and cancelled rows from the batch and its cache."""
        keep = [i for i, s in enumerate(self.rows) if not s.done]
        if len(keep) != len(self.rows):
            self.rows = [self.rows[i] for i in keep]
            if not keep:
                self.running = None
            elif self.running is not None:
                self.running.select(keep)
        return self.release_held()


def _choose(logits: torch.Tensor, seqs: list[Sequence], eos: frozenset[int]) -> list[int]:
    """Next token of each row; rows below their `min_tokens` cannot end yet."""
    young = [i for i, s in enumerate(seqs) if len(s.generated) < s.params.min_tokens]
    mask_eos(logits, young, eos)
    return choose_tokens(logits, [s.params for s in seqs], [s.generator for s in seqs])
