"""The pure scheduler, case by case, with hand-built queues and explicit times."""

from __future__ import annotations

import pytest

from lenbatch.core.queues import Queues
from lenbatch.core.scheduler import schedule
from tests.helpers import push, sched_cfg


def test_empty_queues_decide_nothing() -> None:
    """No work: no batches and no timer."""
    cfg = sched_cfg()
    d = schedule(Queues(cfg), 0.0, cfg)
    assert d.batches == [] and d.wake_at is None and d.expired == []


def test_partial_bucket_waits_until_max_wait() -> None:
    """A partial batch is held, and wake_at is its oldest arrival + max_wait."""
    cfg = sched_cfg(max_batch=4, max_wait_ms=10)
    q = Queues(cfg)
    push(q, 10, 1.000)
    push(q, 12, 1.004)
    d = schedule(q, 1.005, cfg)
    assert d.batches == []
    assert d.wake_at == pytest.approx(1.010)
    d = schedule(q, 1.010, cfg)
    assert [b.size for b in d.batches] == [2]
    assert d.batches[0].padded_len == 12


def test_full_bucket_flushes_at_once() -> None:
    """Reaching max_batch flushes immediately, FIFO, padded to the batch's longest."""
    cfg = sched_cfg(max_batch=3, max_wait_ms=1000)
    q = Queues(cfg)
    rs = [push(q, n, 0.0 + i * 1e-3) for i, n in enumerate([5, 9, 7, 3])]
    d = schedule(q, 0.004, cfg)
    assert len(d.batches) == 1
    b = d.batches[0]
    assert b.requests == rs[:3]
    assert b.padded_len == 9 and b.padded_tokens == 27 and b.real_tokens == 21
    assert q.size == 1 and q.inflight_total == 1


def test_token_budget_caps_and_triggers() -> None:
    """The token budget (size x padded length) both caps a batch and makes a lane ready."""
    cfg = sched_cfg(
        boundaries=(64,), max_length=128, max_batch=32, max_wait_ms=1000, max_batch_tokens=150
    )
    q = Queues(cfg)
    for i in range(5):
        push(q, 50, i * 1e-3)
    d = schedule(q, 0.01, cfg)  # long before max_wait, far from max_batch
    assert [b.size for b in d.batches] == [3, 2][: len(d.batches)]
    assert all(b.padded_tokens <= 150 for b in d.batches)


def test_oldest_lane_first_and_slots_respected() -> None:
    """With one free slot, the lane whose head is oldest goes first; the rest wait."""
    cfg = sched_cfg(max_batch=2, max_wait_ms=5, max_concurrent_batches=1, prefetch_batches=0)
    q = Queues(cfg)
    push(q, 40, 0.002)  # bucket 2, newer
    push(q, 10, 0.001)  # bucket 0, older
    push(q, 20, 0.003)  # bucket 1
    d = schedule(q, 1.0, cfg)  # everyone is overdue, one slot
    assert [b.lane for b in d.batches] == [0]
    assert d.wake_at is None  # no slot: the batch's completion triggers the next decision
    q.batch_done(0)
    d = schedule(q, 1.0, cfg)
    assert [b.lane for b in d.batches] == [2]


def test_deep_backlog_does_not_starve_other_lanes() -> None:
    """A lane with several full batches alternates with an older-headed lane."""
    cfg = sched_cfg(max_batch=2, max_wait_ms=1000, max_concurrent_batches=3, prefetch_batches=0)
    q = Queues(cfg)
    push(q, 10, 0.0)
    push(q, 10, 0.1)
    push(q, 40, 0.05)
    push(q, 40, 0.06)
    push(q, 10, 0.2)
    push(q, 10, 0.3)
    d = schedule(q, 0.3, cfg)
    # bucket 0 (head 0.0), then bucket 2 (head 0.05), then bucket 0 again (head 0.2)
    assert [b.lane for b in d.batches] == [0, 2, 0]


def test_overlong_lane_quota() -> None:
    """The overlong lane never has more than its quota of batches in flight."""
    cfg = sched_cfg(
        boundaries=(16,),
        max_length=128,
        overlong_max_batch=1,
        overlong_max_inflight=1,
        max_concurrent_batches=4,
        prefetch_batches=0,
    )
    q = Queues(cfg)
    push(q, 100, 0.0)
    push(q, 120, 0.0)
    d = schedule(q, 1.0, cfg)
    assert [b.lane for b in d.batches] == [1]
    assert q.inflight[1] == 1 and q.depth(1) == 1
    d = schedule(q, 2.0, cfg)
    assert d.batches == []
    q.batch_done(1)
    assert [b.lane for b in schedule(q, 2.0, cfg).batches] == [1]


def test_static_pads_to_model_max_and_fifo_to_batch_max() -> None:
    """static pads every batch to the model limit; fifo to the batch's longest."""
    for strategy, expected in (("static", 128), ("fifo", 30)):
        cfg = sched_cfg(strategy=strategy, boundaries=None, max_batch=2)
        q = Queues(cfg)
        push(q, 10, 0.0)
        push(q, 30, 0.0)
        (b,) = schedule(q, 0.0, cfg).batches
        assert b.padded_len == expected


def test_sorted_cuts_a_sorted_window_oldest_chunk_first() -> None:
    """sorted: the window is sorted by length and cut; the chunk with the oldest runs first
    and the unused requests return to the queue in arrival order."""
    cfg = sched_cfg(
        strategy="sorted",
        boundaries=None,
        max_batch=2,
        sorted_window=6,
        max_concurrent_batches=1,
        prefetch_batches=0,
    )
    q = Queues(cfg)
    lengths = [50, 5, 60, 6, 7, 55]
    rs = [push(q, n, i * 1e-3) for i, n in enumerate(lengths)]
    d = schedule(q, 0.1, cfg)
    (b,) = d.batches
    # sorted: 5 6 | 7 50 | 55 60 -> the chunk holding 50 (the oldest) runs first
    assert b.requests == [rs[4], rs[0]]
    assert b.padded_len == 50
    assert list(q.lanes[0]) == [rs[1], rs[2], rs[3], rs[5]]


def test_expired_requests_are_returned_not_batched() -> None:
    """A request past its deadline is handed back as expired before it costs compute."""
    cfg = sched_cfg(max_batch=4, max_wait_ms=0)
    q = Queues(cfg)
    dead = push(q, 10, 0.0, deadline=0.5)
    live = push(q, 10, 0.0, deadline=5.0)
    d = schedule(q, 1.0, cfg)
    assert d.expired == [dead]
    assert [b.requests for b in d.batches] == [[live]]
    assert q.size == 0


def test_priority_breaks_readiness_order() -> None:
    """Among ready lanes a higher-priority head goes before an older one."""
    cfg = sched_cfg(max_batch=1, max_concurrent_batches=1, prefetch_batches=0)
    q = Queues(cfg)
    push(q, 10, 0.0)
    push(q, 40, 0.5, priority=1)
    (b,) = schedule(q, 1.0, cfg).batches
    assert b.lane == 2


def test_remove_and_batch_done_bookkeeping() -> None:
    """Removing a queued request updates the size; batch_done without a batch is a bug."""
    cfg = sched_cfg()
    q = Queues(cfg)
    r = push(q, 10, 0.0)
    assert q.remove(r) and q.size == 0
    assert not q.remove(r)
    with pytest.raises(RuntimeError, match="bug"):
        q.batch_done(0)


def test_remove_front_takes_a_lanes_head_and_refuses_more_than_it_holds() -> None:
    """remove_front drops the first n of one lane and counts them out of the size."""
    cfg = sched_cfg()
    q = Queues(cfg)
    rs = [push(q, 10, t) for t in (0.0, 0.1, 0.2)]
    other = push(q, 40, 0.0)
    q.remove_front(0, 2)
    assert list(q.lanes[0]) == [rs[2]] and list(q.lanes[2]) == [other] and q.size == 2
    q.remove_front(0, 1)
    assert q.depth(0) == 0 and q.size == 1
    with pytest.raises(RuntimeError, match="bug"):
        q.remove_front(2, 2)


def test_remove_many_takes_heads_and_middles_and_skips_what_is_gone() -> None:
    """remove_many takes any queued requests out of any lanes, in one call, and returns how
    many were still queued; the rest keep their order."""
    cfg = sched_cfg()
    q = Queues(cfg)
    a, b, c, d = (push(q, 10, t) for t in (0.0, 0.1, 0.2, 0.3))
    long = push(q, 40, 0.0)
    assert q.remove_many([a, b, long]) == 3  # the head of lane 0, in order, and lane 2
    assert list(q.lanes[0]) == [c, d] and q.depth(2) == 0 and q.size == 2
    assert q.remove_many([d, a]) == 1  # d from the middle; a no longer queued
    assert list(q.lanes[0]) == [c] and q.size == 1


def test_push_front_puts_back_in_the_given_order() -> None:
    """What the scheduler does not use goes back at the head of its lane, in order."""
    cfg = sched_cfg()
    q = Queues(cfg)
    a, b, c = (push(q, 10, t) for t in (0.0, 0.1, 0.2))
    q.remove_front(0, 2)
    q.push_front([a, b])
    assert list(q.lanes[0]) == [a, b, c] and q.size == 3
