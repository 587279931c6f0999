"""BucketSet: which lane a length joins."""

from __future__ import annotations

import pytest

from lenbatch.core.buckets import BucketSet, default_boundaries


@pytest.mark.parametrize(
    ("length", "bucket"),
    [(1, 0), (32, 0), (33, 1), (64, 1), (65, 2), (128, 2), (129, 3), (256, 3)],
)
def test_bucket_of_upper_bounds_inclusive(length: int, bucket: int) -> None:
    """Bucket i holds (bounds[i-1], bounds[i]]; above the last bound is the overlong lane."""
    bs = BucketSet((32, 64, 128), max_length=256)
    assert bs.bucket_of(length) == bucket
    assert bs.overlong == 3


@pytest.mark.parametrize("length", [0, 257])
def test_bucket_of_rejects_out_of_range(length: int) -> None:
    """Lengths below 1 or over the model limit are errors, with the limit in the message."""
    bs = BucketSet((32,), max_length=256)
    with pytest.raises(ValueError, match="256" if length else "at least 1"):
        bs.bucket_of(length)


@pytest.mark.parametrize("bounds", [(), (64, 32), (32, 32), (0, 8), (300,)])
def test_invalid_bounds(bounds: tuple[int, ...]) -> None:
    """Empty, unsorted, duplicate, non-positive or over-limit bounds are refused."""
    with pytest.raises(ValueError):
        BucketSet(bounds, max_length=256)


def test_labels_and_counts() -> None:
    """Labels name each span; counts tally lengths per lane and skip impossible ones."""
    bs = BucketSet((16, 64), max_length=128)
    assert bs.labels() == ["1-16", "17-64", "overlong(65-128)"]
    assert bs.counts([1, 16, 17, 64, 65, 128, 129]) == [2, 2, 2]
    assert BucketSet((16, 128), max_length=128).labels() == ["1-16", "17-128", "overlong(none)"]


def test_default_boundaries_reach_the_limit() -> None:
    """Defaults are powers of two from 16 below the limit, then the limit: every input the
    model takes has a lane of full batches."""
    assert default_boundaries(256) == (16, 32, 64, 128, 256)
    assert default_boundaries(512) == (16, 32, 64, 128, 256, 512)
    assert default_boundaries(384) == (16, 32, 64, 128, 256, 384)
    assert default_boundaries(20) == (16, 20)
    assert default_boundaries(8) == (8,)


def test_start_up_line_names_the_overlong_lane_only_where_it_takes_lengths() -> None:
    """The default boundaries end at the limit: the start-up line says no overlong lane then."""
    from lenbatch.config import BatchingConfig
    from lenbatch.embed.engine import Engine
    from lenbatch.runners.fake import FakeRunner

    default = Engine(FakeRunner())  # the fake's limit is 256
    lower = Engine(FakeRunner(), BatchingConfig(boundaries=(32, 128)))
    try:
        assert "[16, 32, 64, 128, 256] (the default" in default.describe()
        assert "overlong" not in default.describe()
        assert "[32, 128] + overlong lane up to 256" in lower.describe()
    finally:
        default._executor.shutdown()
        lower._executor.shutdown()
