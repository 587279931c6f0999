"""`Rows`, a batch as the loop hands it to a worker: its token accounting equals that of the
layout the worker builds from it (`collate` padded, `pack` packed)."""

from __future__ import annotations

import random

import pytest

from lenbatch.core.collate import Rows, collate, pack


@pytest.mark.parametrize("packed", [True, False])
def test_rows_count_what_their_layout_computes(packed: bool) -> None:
    rng = random.Random(7 if packed else 8)
    for _ in range(300):
        seqs = [
            [rng.randrange(1, 999) for _ in range(rng.randint(1, 40))]
            for _ in range(rng.randint(1, 8))
        ]
        longest = max(len(s) for s in seqs)
        pad_to = rng.choice([None, longest, longest + rng.randint(1, 30)])
        rows = Rows(seqs, None, pad_to, packed, tuple(len(s) for s in seqs))
        built = pack(seqs) if packed else collate(seqs, 0, pad_to=pad_to)
        assert (rows.width, rows.real_tokens, rows.padded_tokens) == (
            built.width,
            built.real_tokens,
            built.padded_tokens,
        )
