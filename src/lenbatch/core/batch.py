"""What the scheduler returns: plain data, no behaviour beyond token accounting.

A `Decision` lists the batches to run now, the requests taken out of the queues without running
(expired, shed) and when to decide again. The engines, the simulator and the tests read it; the
scheduler modules (`core.scheduler`, `core.adaptive`) build it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lenbatch.core.request import Request

__all__ = ["Batch", "Decision"]


@dataclass(slots=True)
class Batch:
    """Requests that run together, all padded to `padded_len` tokens."""

    lane: int
    requests: list[Request]
    padded_len: int

    @property
    def size(self) -> int:
        """Number of requests."""
        return len(self.requests)

    @property
    def real_tokens(self) -> int:
        """Tokens that carry input."""
        return sum(r.length for r in self.requests)

    @property
    def padded_tokens(self) -> int:
        """Tokens the model computes: size x padded length."""
        return len(self.requests) * self.padded_len


@dataclass(slots=True)
class Decision:
    """What to do now: batches to run, requests that expired, and when to ask again.

    `adaptive` also sheds (`shed`: answer each at once, predicted to miss its deadline) and
    merges (`merges`: one `(from_lane, to_lane)` per request that joined a longer lane's batch).
    """

    batches: list[Batch] = field(default_factory=list)
    wake_at: float | None = None
    expired: list[Request] = field(default_factory=list)
    shed: list[Request] = field(default_factory=list)
    merges: list[tuple[int, int]] = field(default_factory=list)
