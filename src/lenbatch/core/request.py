"""The unit of work: one input, already tokenized, plus its timing facts.

A `Request` never holds the request text: by the time it exists the text has been tokenized
and dropped. What it carries is safe to log: an anonymous id, the length, and times.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Generic

from typing_extensions import TypeVar

__all__ = ["HandleT", "Request", "RequestStatus", "new_request_id"]

# What the owning layer keeps in `Request.handle`: the embedding engine's `Ticket`, the
# generation engine's `Sequence`, the simulator's row index. Bare `Request` means any handle.
HandleT = TypeVar("HandleT", default=Any)

_ids = itertools.count(1)


def new_request_id() -> str:
    """A process-unique anonymous id (a counter, carries nothing about the content)."""
    return f"r{next(_ids):x}"


class RequestStatus(StrEnum):
    """Where a request ended up; one of these per admitted request."""

    OK = "ok"  # answered
    ERROR = "error"  # failed: the model failed on it, or the runner is gone
    EXPIRED = "expired"  # its deadline passed before it ran
    SHED = "shed"  # refused after admission: predicted to miss its deadline (`adaptive`)
    CANCELLED = "cancelled"  # the client went away
    REJECTED = "rejected"  # never admitted (limits)


@dataclass(slots=True, eq=False)
class Request(Generic[HandleT]):
    """One tokenized input waiting to be batched.

    `length` is the token count that decides the bucket; `token_ids` may be empty in the
    simulator, where only lengths matter. `arrival` and `deadline` are clock times in seconds.
    """

    length: int
    arrival: float
    token_ids: list[int] | None = None
    id: str = field(default_factory=new_request_id)
    deadline: float | None = None
    priority: int = 0
    # Set by the queues when the request is pushed; the lane it waits in.
    lane: int = -1
    # The owning layer's record of this request (engine ticket, sequence, simulator row). Set
    # when the request is made; None only where no layer owns it (tests of the core).
    handle: HandleT = None  # type: ignore[assignment]
    # Per-request extras for the runner (e.g. generation parameters); never logged.
    params: Any = None
    # `adaptive`: clock time its answer is due (arrival + its SLO); None: not set by the shell.
    due: float | None = None
    # Set by the queues on push: the order requests were queued in (ties of arrival kept).
    seq: int = 0
    # Segment ids of `token_ids` (a pair's first text 0, its second 1); None: all segment 0.
    token_type_ids: list[int] | None = None
