"""Property: every interleaving of answer, failure, shedding, cancellation, a caller that goes
away, a deadline and a drain gives each admitted request exactly one outcome, the one a
reference model of the ledger's rules predicts, delivered to its caller once."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from lenbatch.core.clock import FakeClock
from lenbatch.core.errors import DeadlineExceeded, ModelFailed, Overloaded, Unavailable
from lenbatch.core.request import Request, RequestStatus
from lenbatch.serving.ledger import FutureReply, Ledger, Phase, Ticket

N = 4
OPS = ("start", "answer", "fail", "shed", "deadline", "cancel", "caller_gone", "drain")
ops = st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, N - 1)), max_size=40)


@dataclass
class Recorder:
    """Counts endings per lane-less request, in order."""

    endings: list[str] = field(default_factory=list)

    def record_request(self, lane: int, latency: float, status: str) -> None:
        self.endings.append(status)


@dataclass
class Model:
    """The reference: what the ledger's rules say each request's outcome is."""

    phase: list[str] = field(default_factory=lambda: ["queued"] * N)
    gone: list[bool] = field(default_factory=lambda: [False] * N)
    status: list[RequestStatus | None] = field(default_factory=lambda: [None] * N)
    withdrawn: list[int] = field(default_factory=list)

    def end(self, i: int, status: RequestStatus) -> None:
        if self.phase[i] == "ended":
            return
        if self.gone[i] and status is not RequestStatus.CANCELLED:
            status = RequestStatus.CANCELLED  # nobody to answer: ended as cancelled
        self.phase[i] = "ended"
        self.status[i] = status

    def apply(self, op: str, i: int) -> None:
        if op == "start" and self.phase[i] == "queued":
            self.phase[i] = "running"
        elif op == "answer":
            self.end(i, RequestStatus.OK)
        elif op == "fail":
            self.end(i, RequestStatus.ERROR)
        elif op == "shed":
            self.end(i, RequestStatus.SHED)
        elif op == "deadline" and self.phase[i] == "queued":
            self.withdrawn.append(i)
            self.end(i, RequestStatus.EXPIRED)
        elif op == "cancel" and self.phase[i] != "ended":
            if self.phase[i] == "queued":
                self.withdrawn.append(i)
            self.end(i, RequestStatus.CANCELLED)
        elif op == "caller_gone" and self.phase[i] != "ended":
            self.gone[i] = True
        elif op == "drain":
            for j in range(N):
                self.end(j, RequestStatus.ERROR)


async def _run(sequence: list[tuple[str, int]]) -> None:
    loop = asyncio.get_running_loop()
    recorder = Recorder()
    withdrawn: list[Request] = []
    ledger: Ledger[int] = Ledger(FakeClock(), recorder, withdraw=withdrawn.append)
    tickets = [
        Ticket(Request(i + 1, 0.0, deadline=60.0), FutureReply(loop.create_future()))
        for i in range(N)
    ]
    ledger.admit(tickets)
    model = Model()
    for op, i in sequence:
        t = tickets[i]
        model.apply(op, i)
        if op == "start":
            ledger.start(t, 0.0)
        elif op == "answer":
            ledger.answer(t, i)
        elif op == "fail":
            ledger.fail(t, ModelFailed("poison"))
        elif op == "shed":
            ledger.shed(t, Overloaded("late"))
        elif op == "deadline":
            ledger.deadline_passed(t)
        elif op == "cancel":
            ledger.cancel(t)
        elif op == "caller_gone":
            reply = t.reply
            assert isinstance(reply, FutureReply)
            reply.future.cancel()
        else:
            ledger.abandon(Unavailable("drain timed out"))
    # The drain at shutdown: whatever is left is answered.
    model.apply("drain", 0)
    ledger.abandon(Unavailable("drain timed out"))

    assert ledger.unanswered == 0
    assert len(recorder.endings) == N  # one outcome per admitted request, no more
    assert [t.status for t in tickets] == model.status
    assert sorted(recorder.endings) == sorted(str(s) for s in model.status)
    assert withdrawn == [tickets[i].request for i in model.withdrawn]
    for i, t in enumerate(tickets):
        assert t.phase is Phase.ENDED and t.timer is None
        reply = t.reply
        assert isinstance(reply, FutureReply)
        fut = reply.future
        assert fut.done()
        expected = {
            RequestStatus.OK: None,
            RequestStatus.ERROR: (ModelFailed, Unavailable),
            RequestStatus.SHED: Overloaded,
            RequestStatus.EXPIRED: DeadlineExceeded,
        }
        if t.status is RequestStatus.CANCELLED:
            assert fut.cancelled()
        elif t.status is RequestStatus.OK:
            assert fut.result() == i
        else:
            kind = expected[t.status]
            assert kind is not None and isinstance(fut.exception(), kind)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_every_interleaving_ends_each_request_exactly_once(sequence: list[tuple[str, int]]) -> None:
    """Exactly one outcome per admitted request, the model's, whatever the interleaving."""
    asyncio.run(_run(sequence))


def test_reference_model_sees_every_outcome() -> None:
    """The operations reach every outcome (so the property is not vacuous)."""
    model = Model()
    for op, i in [("answer", 0), ("fail", 1), ("shed", 2), ("caller_gone", 3), ("answer", 3)]:
        model.apply(op, i)
    assert model.status == [
        RequestStatus.OK,
        RequestStatus.ERROR,
        RequestStatus.SHED,
        RequestStatus.CANCELLED,
    ]
    other = Model()
    other.apply("deadline", 0)
    assert other.status[0] is RequestStatus.EXPIRED
    assert np.array_equal(other.withdrawn, [0])
