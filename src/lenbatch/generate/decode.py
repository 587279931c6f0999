"""The compute side of generation: prefill jobs, the running decode batch, one unit at a time.

`Decoder` holds what runs on the model: prefill jobs (scheduler batches being prefilled,
possibly in chunks, each with its own KV cache: `generate.jobs.PrefillJob`) and the running
decode batch (a right-aligned `KVBatch`). The engine asks a policy (lockstep or continuous)
which unit to run next, then runs it in its worker thread through `prefill()` or `decode()`;
each returns the tokens produced (a `generate.jobs.UnitResult`), which the event loop delivers.
The decoder never touches the queues or the ledger. What happens when a unit raises is
`lenbatch.generate.failures`.

A prefill unit runs columns `[done, done + cols)` of a left-padded job through the model with
that job's cache; after its last chunk every row samples its first token and the job's rows join
the running batch (`KVBatch.join`). A decode unit feeds each running row its last token and
samples the next; finished and cancelled rows are then removed from the batch and its cache.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable, Sequence
from typing import cast

import torch

from lenbatch.core.collate import collate
from lenbatch.generate.generation import Generation
from lenbatch.generate.jobs import PrefillJob, UnitResult
from lenbatch.generate.kvcache import KVBatch, cache_bytes, fill_from_tail
from lenbatch.generate.prefixcache import PrefixCache
from lenbatch.generate.prefixjobs import (
    follow_queued,
    keep_prefixes,
    row_ids,
    split_shared,
    start_from_cache,
)
from lenbatch.generate.sampling import choose_tokens, mask_eos, penalize, step_logprobs
from lenbatch.generate.shapes import FixedShapes
from lenbatch.runners.base import CausalRunner, MixingRunner, Segment
from lenbatch.serving.messages import Delta

__all__ = ["Decoder", "choose_next"]

# Decode steps a new running batch's buffers take room for at once (columns after its window).
_RESERVED_STEPS = 256

log = logging.getLogger(__name__)


class Decoder:
    """Prefill jobs and the running decode batch of one model."""

    def __init__(
        self,
        runner: CausalRunner,
        clock: Callable[[], float],
        release_on_merge: bool,
        shapes: FixedShapes | None = None,
        max_rows: int = 0,
        prefixes: PrefixCache | None = None,
    ) -> None:
        self.runner = runner
        # Keys and values of prompt prefixes already prefilled (None: every prompt prefills
        # from its first token).
        self.prefixes = prefixes
        # The most rows the running batch may come to hold (the engine's running cap; 0:
        # unknown): a new running batch's buffers take that many rows at once.
        self.max_rows = max_rows
        # Fixed shapes (and compiled graphs) for whole prefills and decode steps that fit them.
        self.shapes = shapes
        self.now = clock
        # Continuous batching frees a scheduler slot once a batch's rows joined the decode batch;
        # lockstep batching holds it until every row of the batch has finished.
        self.release_on_merge = release_on_merge
        self.jobs: deque[PrefillJob] = deque()
        self.running: KVBatch | None = None
        self.rows: list[Generation] = []
        self.held_lanes: list[int] = []
        self.kv_peak_bytes = 0
        self.preempted = 0  # rows moved back to prefill after a decode step ran out of memory
        # Where a unit's tokens go before the unit ends (the engine's event loop), or None:
        # they go with the unit's result.
        self.publish: Callable[[list[tuple[Generation, Delta]]], None] | None = None

    # ------------------------------------------------------------------ state

    @property
    def running_rows(self) -> int:
        """Generations in the decode batch."""
        return len(self.rows)

    @property
    def mixer(self) -> MixingRunner | None:
        """The runner, where one forward can carry a decode step and a prefill chunk (the lean
        path); None elsewhere, and with fixed shapes (compiled for one or the other)."""
        if self.shapes is None and getattr(self.runner, "mixes", False):
            return cast(MixingRunner, self.runner)
        return None

    @property
    def masked_reads(self) -> bool:
        """True when the running batch's masked columns may be read (and must hold zeros, not
        garbage): everywhere but on a runner whose decode step reads each row's real columns
        only (`reads_real_columns`, the lean path's decode-attention op), without fixed
        shapes."""
        return self.shapes is not None or not getattr(self.runner, "reads_real_columns", False)

    @property
    def pending_rows(self) -> int:
        """Generations admitted but not yet prefilled."""
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

    def add_job(self, lane: int, gens: list[Generation], pad_to: int | None) -> PrefillJob:
        """Collate a scheduler batch (left padding, position ids) and queue it for prefill.

        With the prefix cache, a prompt head that several prompts share and the cache does
        not hold yet is prefilled once (`generate.prefixjobs`): rows whose head another row
        of the batch has go into a second job queued right behind the first, and a job
        whose rows share such a head with a job queued before it waits for that one. Only
        the last job frees the scheduler's slot (it counted the batch once)."""
        firsts, again = split_shared(self.prefixes, gens)
        job = self.new_job(lane, firsts, pad_to=pad_to, releases=not again)
        follow_queued(self.prefixes, job, self.jobs)
        self.jobs.append(job)
        if again:
            later = self.new_job(lane, again, pad_to=pad_to)
            follow_queued(self.prefixes, later, self.jobs)
            later.after_prefix = True
            self.jobs.append(later)
        return job

    def new_job(
        self,
        lane: int,
        gens: list[Generation],
        *,
        pad_to: int | None = None,
        releases: bool = True,
        max_cols: int | None = None,
        alone: bool = False,
    ) -> PrefillJob:
        """A prefill job of `gens` with a fresh cache, not queued.

        A generation preempted from the decode batch is prefilled again over its prompt and
        what it has generated so far, then continues where it was (vLLM's recompute).
        """
        batch = collate(
            [row_ids(g) for g in gens],
            self.runner.info.pad_token_id,
            "left",
            pad_to=pad_to,
            position_ids=True,
        )
        cache = self.runner.new_cache()
        return PrefillJob(
            lane, gens, batch, cache, releases=releases, max_cols=max_cols, alone=alone
        )

    def _store_prefixes(self, job: PrefillJob) -> None:
        """Keep `job`'s prompt blocks (its prefill just ended); a model whose cache keeps
        no whole prefix turns the prefix cache off (`prefixjobs.keep_prefixes`)."""
        if self.prefixes is not None and not keep_prefixes(self.prefixes, job):
            self.prefixes = None

    # ------------------------------------------------------------------ units

    def _chunk(self, job: PrefillJob, cols: int, index: int = 0) -> tuple[int, int, Segment]:
        """Columns `[lo, hi)` of the next chunk of `job` (at most `cols`), and its inputs;
        `job` is the unit's `index`-th chunk."""
        if index >= len(self.jobs) or job is not self.jobs[index]:
            raise RuntimeError("bug: prefill must run the oldest jobs first, in order")
        if not job.matched:  # just before its first chunk: what the jobs before it kept
            job.matched = True
            start_from_cache(self.prefixes, job)
        b = job.batch
        lo, hi = job.done_cols, min(b.width, job.done_cols + max(1, cols))
        dev = self.runner.device
        ids = torch.from_numpy(b.input_ids[:, lo:hi]).to(dev)
        mask = torch.from_numpy(b.attention_mask[:, :hi]).to(dev)
        assert b.position_ids is not None
        pos = torch.from_numpy(b.position_ids[:, lo:hi]).to(dev)
        return lo, hi, Segment(ids, mask, pos, job.cache)

    def prefill(
        self, job: PrefillJob, cols: int, more: Sequence[tuple[PrefillJob, int]] = ()
    ) -> UnitResult:
        """Run the next `cols` prompt columns of `job`; after its last, sample first tokens.
        `more`: the next jobs' chunks in the same forward (see `_many`)."""
        if more:
            return self._many([(job, cols), *more], decode=False)
        lo, hi, seg = self._chunk(job, cols)
        b = job.batch
        shapes = self.shapes
        start = self.now()
        if shapes is not None and lo == 0 and hi == b.width and shapes.prefill_fits(hi):
            # (a job seeded from the prefix cache starts past 0: it runs eager)
            logits, job.cache = shapes.prefill(b)
        else:
            if shapes is not None:
                shapes.graphs.count_eager()
            logits = self.runner.forward(seg.input_ids, seg.mask, seg.positions, job.cache)
        end = self.now()
        result = UnitResult("prefill", compute_s=end - start, rows=job.rows, jobs=[job])
        result.tokens, result.padded = self._chunk_ran(job, lo, hi, start, end)
        if hi < b.width:
            return result
        # Sample before the job leaves the queue, so a failure here is still the job's own.
        tokens = choose_next(logits, job.gens, self.runner.eos_token_ids)
        self._prefilled(job, result, tokens, seg.mask, end)
        return result

    def _chunk_ran(
        self, job: PrefillJob, lo: int, hi: int, start: float, end: float
    ) -> tuple[int, int]:
        """Record that columns `[lo, hi)` of `job` ran from `start` to `end`; returns (real,
        padded) tokens of the chunk."""
        for g in job.gens:
            t = g.timings
            if lo == job.first_col or math.isnan(t.prefill_start):
                t.prefill_start = start
            t.prefill_compute += end - start
        job.done_cols = hi
        self.kv_bytes()
        return int(job.batch.attention_mask[:, lo:hi].sum()), job.rows * (hi - lo)

    def _prefilled(
        self, job: PrefillJob, result: UnitResult, tokens: list[int], mask: torch.Tensor, end: float
    ) -> None:
        """`job`'s last chunk ran and its first `tokens` are chosen: deliver them and move its
        rows into the running batch."""
        self._first_tokens(job, result, tokens, end)
        self._publish(result)
        result.released_lanes.extend(self._join(job, tokens, mask))
        result.released_lanes.extend(self._drop_done())

    def _first_tokens(
        self, job: PrefillJob, result: UnitResult, tokens: list[int], end: float
    ) -> None:
        """Add `job`'s first `tokens` to `result` (its prefill ends at `end`)."""
        result.finished.append(job)
        for g in job.gens:
            g.timings.prefill_end = end
        self._deliver(result, job.gens, tokens)

    def _publish(self, result: UnitResult) -> None:
        """Send the unit's tokens so far to their streams now, where a `publish` is set:
        joining the running batch copies every layer's keys and values, which no first token
        (nor a mixed unit's decode token) waits for."""
        if self.publish is not None:
            self.publish(result.deltas)
            result.deltas = []

    def _join(self, job: PrefillJob, tokens: list[int], mask: torch.Tensor) -> list[int]:
        """Move `job` (the oldest queued job, its prefill done; `mask` its chunk's mask) into
        the running batch; returns the scheduler lanes freed."""
        if job is not self.jobs[0]:
            raise RuntimeError("bug: jobs join the running batch in order")
        self.jobs.popleft()
        self._store_prefixes(job)
        dev = self.runner.device
        next_pos = torch.tensor(job.batch.lengths, dtype=torch.long, device=dev)
        last = torch.tensor(tokens, dtype=torch.long, device=dev)
        # The prefill's keys and values are copied once, into the running batch's buffers
        # (leading all-padding columns, e.g. of a bucket's pad_to, are left out).
        if self.running is None or self.running.rows == 0:
            self.running = KVBatch(job.cache, mask, next_pos, last, self.masked_reads)
            if self.shapes is None:  # fixed shapes size their buffers by shape class
                # The first job's buffers, sized for its own rows, become the running batch's.
                # Grown to the running cap and to the longest answer's columns now (one copy
                # of a small cache): each doubling later would copy the whole cache at a step
                # boundary. Rows not yet claimed stay untouched memory; answers longer than
                # `_RESERVED_STEPS` find room by doubling as before.
                steps = min(max(g.params.max_tokens for g in job.gens), _RESERVED_STEPS)
                self.running.reserve(max(self.max_rows, self.running.rows), steps)
        else:
            self.running.join(job.cache, mask, next_pos, last)
        self.rows.extend(job.gens)
        return self.release(job)

    def mixed(
        self, job: PrefillJob, cols: int, more: Sequence[tuple[PrefillJob, int]] = ()
    ) -> UnitResult:
        """A decode step for every running row and the next `cols` prompt columns of `job`
        (and the chunks in `more`), in one forward pass (`runner.forward_segments`): the
        weights are read once for both, and running streams get their next token while a
        prompt is prefilled."""
        dropped = self._drop_done()
        if self.running is None or not self.rows:  # every running row ended: prefill alone
            result = self.prefill(job, cols, more)
            result.released_lanes[:0] = dropped
            return result
        result = self._many([(job, cols), *more], decode=True)
        result.released_lanes[:0] = dropped
        return result

    def _many(self, chunks: Sequence[tuple[PrefillJob, int]], *, decode: bool) -> UnitResult:
        """One forward pass over the oldest jobs' next chunks, in queue order (every job but
        the last finishes in it), with the running rows' decode step in front when `decode`:
        a "mixed" unit, else a "prefill" unit of several jobs. Each segment keeps its own
        cache and attention; the matrix products run once over every token together."""
        mixer = self.mixer
        if mixer is None:
            raise RuntimeError("bug: several segments in one forward on a runner that cannot")
        if any(cols < job.remaining for job, cols in chunks[:-1]):
            raise RuntimeError("bug: only a unit's last job may stop part-way")
        parts = [self._chunk(job, cols, i) for i, (job, cols) in enumerate(chunks)]
        segments = [seg for _, _, seg in parts]
        kv = self.running
        if decode:
            assert kv is not None
            ids, mask, pos = kv.step_inputs()
            segments.insert(0, Segment(ids, mask, pos, kv.cache))
        start = self.now()
        logits = mixer.forward_segments(segments)
        end = self.now()
        eos = self.runner.eos_token_ids
        # Every sample is drawn before any state changes: a failure up to here leaves the
        # running batch as it was once its cache is rolled back (`generate.failures`).
        tokens = choose_next(logits.pop(0), self.rows, eos) if decode else []
        firsts = [
            choose_next(lg, job.gens, eos) if hi == job.batch.width else None
            for lg, (job, _), (_, hi, _) in zip(logits, chunks, parts, strict=True)
        ]
        jobs = [job for job, _ in chunks]
        result = UnitResult("mixed" if decode else "prefill", compute_s=end - start, jobs=jobs)
        if decode:
            assert kv is not None
            self._stepped(kv, result, mask, tokens)
        for job, (lo, hi, _) in zip(jobs, parts, strict=True):
            real, padded = self._chunk_ran(job, lo, hi, start, end)
            if decode:
                result.prefill_rows += job.rows
                result.prefill_tokens += real
                result.prefill_padded += padded
            else:
                result.rows += job.rows
                result.tokens += real
                result.padded += padded
        done = [
            (job, first, seg.mask)
            for job, first, (_, _, seg) in zip(jobs, firsts, parts, strict=True)
            if first is not None
        ]
        for job, first, _ in done:
            self._first_tokens(job, result, first, end)
        if done:
            self._publish(result)
        for job, first, mask_ in done:
            result.released_lanes.extend(self._join(job, first, mask_))
        result.released_lanes.extend(self._drop_done())
        return result

    def decode(self) -> UnitResult:
        """One decode step for every running row."""
        result = UnitResult("decode")
        result.released_lanes.extend(self._drop_done())
        kv = self.running
        if kv is None or not self.rows:
            return result
        shapes = self.shapes
        start = self.now()
        if shapes is not None and shapes.decode_fits(kv):
            logits, mask = shapes.decode(kv)
        else:
            if shapes is not None:
                shapes.graphs.count_eager()
            ids, mask, pos = kv.step_inputs()
            logits = self.runner.forward(ids, mask, pos, kv.cache)
        end = self.now()
        tokens = choose_next(logits, self.rows, self.runner.eos_token_ids)
        result.compute_s = end - start
        self._stepped(kv, result, mask, tokens)
        self.kv_bytes()
        result.released_lanes.extend(self._drop_done())
        return result

    def _stepped(
        self, kv: KVBatch, result: UnitResult, mask: torch.Tensor, tokens: list[int]
    ) -> None:
        """A decode step ran and chose `tokens`: advance the running batch, deliver them and
        record what attention read (real cached tokens against all columns, padding included)."""
        kv.advance(mask, torch.tensor(tokens, dtype=torch.long, device=kv.mask.device))
        self._deliver(result, self.rows, tokens)
        result.rows = kv.rows
        result.tokens = kv.real_tokens
        result.padded = kv.rows * kv.width

    def _deliver(self, result: UnitResult, gens: list[Generation], tokens: list[int]) -> None:
        eos = self.runner.eos_token_ids
        for g, tok in zip(gens, tokens, strict=True):
            result.deltas.append((g, g.add_token(tok, eos)))

    # ------------------------------------------------------------------ scheduler slots

    def release(self, job: PrefillJob) -> list[int]:
        """Free (continuous) or hold until the batch drains (lockstep) the job's scheduler
        slot; returns the lanes freed now."""
        if not job.releases:
            return []
        if self.release_on_merge:
            return [job.lane]
        self.held_lanes.append(job.lane)
        return self.release_held()

    def release_held(self) -> list[int]:
        """Scheduler lanes held by a lockstep batch that has nothing left running."""
        if self.rows:
            return []
        lanes, self.held_lanes = self.held_lanes, []
        return lanes

    def _drop_done(self) -> list[int]:
        """Remove finished and cancelled rows from the batch and its cache. The places they
        leave are filled with the last running rows, so the cache copies one row per row
        that ended, not every row after it."""
        keep = fill_from_tail([g.done for g in self.rows])
        if len(keep) != len(self.rows):
            self.rows = [self.rows[i] for i in keep]
            if not keep:
                self.running = None
            elif self.running is not None:
                self.running.select(keep)
        return self.release_held()


def _allows_more_than(allowed: torch.Tensor, eos: frozenset[int], stops: tuple[int, ...]) -> bool:
    """True when `allowed` holds a token that is neither end-of-sequence nor a stop token."""
    ends = sorted({t for t in (*eos, *stops) if t < allowed.shape[0]})
    return int(allowed.sum()) > int(allowed[ends].sum()) if ends else bool(allowed.any())


def choose_next(logits: torch.Tensor, gens: list[Generation], eos: frozenset[int]) -> list[int]:
    """Next token of each row, after its penalties and logit biases, among the tokens its
    grammar allows (structured outputs); rows below their `min_tokens` cannot end yet. A row
    whose request asked for log-probabilities gets them in `Generation.step_logprob`, read
    from its raw logits (a copy taken before any of that)."""
    asked = [i for i, g in enumerate(gens) if g.params.logprobs is not None]
    raw = logits[asked] if asked else None  # indexing by a list copies the rows
    for i, g in enumerate(gens):
        if g.params.penalized:
            penalize(logits, i, g.params, g.request.token_ids or (), g.generated)
    young = [i for i, g in enumerate(gens) if len(g.generated) < g.params.min_tokens]
    for i, g in enumerate(gens):
        if g.matcher is not None:
            allowed = g.matcher.allowed()
            g.matcher.mask(logits[i], allowed)
            if i in young and not _allows_more_than(allowed, eos, g.params.stop_token_ids):
                young.remove(i)  # only the end may follow: the grammar outranks min_tokens
    mask_eos(logits, young, eos)
    for i in young:  # a request's own stop tokens wait for `min_tokens` too
        mask_eos(logits, [i], frozenset(gens[i].params.stop_token_ids))
    tokens = choose_tokens(logits, [g.params for g in gens], [g.generator for g in gens])
    if raw is not None:
        tops = [gens[i].params.logprobs or 0 for i in asked]
        found = step_logprobs(raw, [tokens[i] for i in asked], tops)
        for i, step in zip(asked, found, strict=True):
            gens[i].step_logprob = step
    return tokens
