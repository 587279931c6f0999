"""Prefill jobs and the prefix cache (`generate.prefixcache`): which rows of a scheduler batch
go first so that a prompt head they share is prefilled once, where a job starts once its
rows' cached prefixes are in its cache, and what a finished prefill keeps.

A head shared by several prompts and not yet cached, at least `SHARED_BLOCKS` blocks of it (a
new system prompt in a burst, a call's `n` choices), is prefilled once: `split_shared` puts a
batch's rows behind such a head after its first row (the decoder queues them as a second
job), and `follow_queued` marks a job whose rows share one with a job queued before it, so
that it never rides in that job's forward (`PrefillJob.after_prefix`). Jobs run in queue
order, so by the time such a job starts, the blocks are kept. `start_from_cache` runs in the
worker just before a job's first chunk: it looks each row up and copies what is found into
the job's empty cache. The decoder calls these; none touches the model.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

from lenbatch.generate.generation import Generation
from lenbatch.generate.jobs import PrefillJob
from lenbatch.generate.prefixcache import BLOCK_TOKENS, PrefixCache, block_chain

__all__ = [
    "SHARED_BLOCKS",
    "follow_queued",
    "keep_prefixes",
    "row_ids",
    "split_shared",
    "start_from_cache",
]

log = logging.getLogger(__name__)

# Blocks of a prompt head, not in the prefix cache, that rows must share to be prefilled one
# after another (the head once) rather than side by side (the head in every row): a second
# job costs one more pass over the weights, about what a few dozen prompt tokens cost.
SHARED_BLOCKS = 2


def row_ids(g: Generation) -> list[int]:
    """The tokens a generation's prefill runs: its prompt and what it generated (a
    preempted row)."""
    return (g.request.token_ids or []) + g.generated


def _uncached_head(prefixes: PrefixCache, ids: list[int]) -> int:
    """Blocks of `ids` rows must share, counted from its first, to gain from prefilling it
    once: those the cache holds plus `SHARED_BLOCKS`."""
    return prefixes.peek(ids) // BLOCK_TOKENS + SHARED_BLOCKS


def _shares(chain: list[int], k: int, others: Sequence[list[int]]) -> bool:
    """True where one of `others` has the same first `k` blocks as `chain` (block chains:
    `prefixcache.block_chain`)."""
    if len(chain) < k:
        return False
    return any(len(c) >= k and c[k - 1] == chain[k - 1] for c in others)


def split_shared(
    prefixes: PrefixCache | None, gens: list[Generation]
) -> tuple[list[Generation], list[Generation]]:
    """`gens` split into rows to prefill first and rows whose uncached head (at least
    `SHARED_BLOCKS` blocks) one of those shares (the second list empty where nothing is
    gained, and without a prefix cache)."""
    if prefixes is None or len(gens) < 2:
        return gens, []
    firsts: list[list[int]] = []
    keep: list[Generation] = []
    again: list[Generation] = []
    for g in gens:
        ids = row_ids(g)
        chain = block_chain(ids)
        if _shares(chain, _uncached_head(prefixes, ids), firsts):
            again.append(g)
        else:
            firsts.append(chain)
            keep.append(g)
    return keep, again


def follow_queued(
    prefixes: PrefixCache | None, job: PrefillJob, queued: Iterable[PrefillJob]
) -> None:
    """Mark `job` to wait for the `queued` jobs where a row shares an uncached head of
    `SHARED_BLOCKS` blocks or more with one of theirs (their prefill keeps it); keep its
    rows' block chains for the jobs that come after."""
    if prefixes is None:
        return
    chains = [c for other in queued for c in other.chains]
    job.chains = []
    for g in job.gens:
        ids = row_ids(g)
        chain = block_chain(ids)
        job.chains.append(chain)
        if chains and _shares(chain, _uncached_head(prefixes, ids), chains):
            job.after_prefix = True


def start_from_cache(prefixes: PrefixCache | None, job: PrefillJob) -> None:
    """Start `job` past the prompt columns the prefix cache holds for every row, copied into
    its empty cache (a left-padded row's cached prefix ends at its start plus its match; the
    job starts at the earliest such end, 0 where that gains no row anything). Sets each
    fresh row's `cached_tokens` (a preempted row's prompt was counted when it first ran)."""
    for g in job.gens:
        if not g.generated:
            g.cached_tokens = 0  # (an estimate at the door, until this lookup)
    if prefixes is None:
        return
    b = job.batch
    starts = [b.width - n for n in b.lengths]
    matches = [prefixes.match(b.input_ids[i, s:].tolist()) for i, s in enumerate(starts)]
    first = min(s + m.tokens for s, m in zip(starts, matches, strict=True))
    if any(first > s for s in starts):
        first = prefixes.seed(job.cache, matches, starts, first)
        job.first_col = job.done_cols = first
    else:
        first = 0
    fresh = [(g, s) for g, s in zip(job.gens, starts, strict=True) if not g.generated]
    for g, s in fresh:
        g.cached_tokens = max(0, first - s)
    prefixes.count(
        len(fresh), sum(b.width - s for _, s in fresh), sum(g.cached_tokens for g, _ in fresh)
    )


def keep_prefixes(prefixes: PrefixCache, job: PrefillJob) -> bool:
    """Keep the whole blocks of `job`'s prompts (its prefill just ended) that the cache
    lacks; False (with a line in the log) where its cache keeps no whole prefix
    (sliding-window layers, a compiled shape's static cache): the prefix cache is then of no
    use for this model."""
    b = job.batch
    starts = [b.width - n for n in b.lengths]
    rows = [b.input_ids[i, s:].tolist() for i, s in enumerate(starts)]
    try:
        prefixes.store(job.cache, rows, starts)
    except (ValueError, AttributeError, TypeError, IndexError, RuntimeError) as e:
        log.warning("prefix cache off: this model's KV cache cannot be reused (%s)", e)
        return False
    return True
