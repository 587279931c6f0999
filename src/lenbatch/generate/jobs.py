"""What the decoder works on and hands back: prefill jobs and the results of units.

A `PrefillJob` is one scheduler batch being prefilled (its generations, left-padded inputs,
partial KV cache and how far it has run); the `Decoder` (`generate.decode`) queues them, the
decode policies (`generate.policy`) pick their chunks, and `generate.failures` splits or
restarts them when a unit raises. A `UnitResult` is what one unit produced (deltas, scheduler
lanes freed, compute time, token counts, the jobs it ran), which the engine's update step
delivers and records and the adaptive cost models learn from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lenbatch.core.collate import Collated
from lenbatch.generate.generation import Generation
from lenbatch.serving.messages import Delta

__all__ = ["PrefillJob", "UnitResult"]


@dataclass(eq=False)  # compared by identity (queue removal); fields hold arrays
class PrefillJob:
    """A scheduler batch being prefilled: its generations, padded inputs and partial cache."""

    lane: int
    gens: list[Generation]
    batch: Collated
    cache: Any
    done_cols: int = 0
    # False for the first half of a bisected batch: the scheduler counted the batch once, so
    # only its last part frees the slot.
    releases: bool = True
    # Most columns per prefill chunk after this job ran out of memory (None: the policy's).
    max_cols: int | None = None
    # Prefilled in units of its own, never mixed with a decode step (after a mixed unit
    # failed: alone, a failure is this job's or the running batch's, and recovered as such).
    alone: bool = False
    # Prompt columns whose keys and values come from the prefix cache: the first chunk runs
    # from here (0: none), after `seed` has filled the cache (`Decoder._seed`).
    first_col: int = 0
    matched: bool = False  # looked up in the prefix cache (before its first chunk)
    # Its rows repeat prompts of the job queued before it, whose blocks it waits for: it
    # never rides in that job's forward (`policy._more`), so the blocks are kept first.
    after_prefix: bool = False
    # Its rows' block chains (`prefixcache.block_chain`), for the jobs queued after it to
    # tell whether they share its head; empty without a prefix cache.
    chains: list[list[int]] = field(default_factory=list)
    seed: Any = None  # (the `PrefixCache`, the rows' `PrefixMatch`es) until the cache is seeded

    @property
    def rows(self) -> int:
        """Generations in the job."""
        return self.batch.rows

    @property
    def remaining(self) -> int:
        """Prompt columns not yet run."""
        return self.batch.width - self.done_cols


@dataclass
class UnitResult:
    """What one unit produced, for delivery and metrics."""

    kind: str  # "prefill", "decode" or "mixed" (a decode step and a prefill chunk in one forward)
    deltas: list[tuple[Generation, Delta]] = field(default_factory=list)
    released_lanes: list[int] = field(default_factory=list)  # scheduler batches now done
    compute_s: float = 0.0
    rows: int = 0
    tokens: int = 0  # prefill: real prompt tokens of the chunk; decode, mixed: real cached tokens
    padded: int = 0  # prefill: chunk tokens incl. padding; decode, mixed: cache columns x rows
    prefill_tokens: int = 0  # mixed: real prompt tokens of its prefill chunk
    prefill_rows: int = 0  # mixed: rows of its prefill chunk
    prefill_padded: int = 0  # mixed: its chunk's tokens incl. padding (rows x columns)
    jobs: list[PrefillJob] = field(default_factory=list)  # the prefill jobs this unit ran
    finished: list[PrefillJob] = field(default_factory=list)  # those whose prefill ended here
