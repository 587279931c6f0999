"""BatchCaps: lowered after out-of-memory, restored after the cool-down, applied to the config."""

from __future__ import annotations

from lenbatch.config import BatchingConfig
from lenbatch.core.lanes import resolve_scheduler
from lenbatch.core.recovery import BatchCaps


def _caps(cooldown: float = 10.0) -> BatchCaps:
    base = resolve_scheduler(BatchingConfig(boundaries=(32, 64), max_batch=16, max_wait_ms=5), 128)
    return BatchCaps(base, cooldown)


def test_lower_halves_the_failing_batch_and_never_raises_a_cap() -> None:
    """The cap becomes half the failing batch, at least 1, never above the cap in force."""
    caps = _caps()
    assert caps.lower(0, 12, now=0.0) == 6
    assert caps.lower(0, 16, now=0.0) == 6  # a batch formed before the cap: no raise
    assert caps.lower(0, 1, now=0.0) == 1
    assert caps.caps() == [1, 16, 8]  # the overlong lane keeps its own 8


def test_cap_is_restored_after_the_cooldown() -> None:
    """A lowered cap holds until the cool-down has passed, then the configured one returns."""
    caps = _caps(cooldown=10.0)
    caps.lower(1, 16, now=5.0)
    assert caps.expire(14.9) == [] and caps.cap(1) == 8
    assert caps.expire(15.0) == [1] and caps.cap(1) == 16


def test_config_applies_caps_and_draining() -> None:
    """The scheduler config carries the lowered cap, and max_wait 0 everywhere when draining."""
    caps = _caps()
    caps.lower(0, 10, now=0.0)
    cfg = caps.config()
    assert [p.max_batch for p in cfg.lanes] == [5, 16, 8]
    assert cfg.lanes[1] is caps.base.lanes[1]  # untouched lanes are shared
    assert all(p.max_wait == 0.0 for p in caps.config(draining=True).lanes)


def test_describe_reports_current_caps() -> None:
    """`describe` lists configured and current caps and the time left to restore."""
    caps = _caps(cooldown=10.0)
    caps.lower(2, 8, now=0.0)
    out = caps.describe(4.0, ["a", "b", "c"])
    assert out[2] == {"bucket": "c", "max_batch": 8, "current": 4, "restored_in_s": 6.0}
    assert out[0]["restored_in_s"] is None
