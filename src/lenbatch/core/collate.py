"""Collate: turn a batch of token-id lists into arrays the model can take.

Pads to the batch's own longest member (or to a fixed length for the `static` baseline) on the
model's padding side, builds the attention mask, and, for models with absolute positions that
are left-padded, position ids that start at 0 on each row's first real token. Or pack (no
padding): every row's tokens end to end, with the layout that puts them back into rows for
attention (`Packed`), for runners that run token-wise layers on real tokens only. Segment ids
(`token_type_ids`: 0 for a pair's first text, 1 for its second) travel with the tokens when a
batch holds pairs; without them every token is segment 0, as models assume. Pure numpy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

__all__ = ["Collated", "Packed", "Rows", "collate", "pack", "pack_collated"]

PadSide = Literal["right", "left"]


class _TokenAccounting:
    """The counts a padded and a packed batch share, from their rows' lengths."""

    __slots__ = ()
    lengths: tuple[int, ...]

    @property
    def rows(self) -> int:
        """Sequences in the batch."""
        return len(self.lengths)

    @property
    def real_tokens(self) -> int:
        """Tokens that carry input."""
        return sum(self.lengths)

    @property
    def padded_tokens(self) -> int:
        """Tokens the model computes."""
        raise NotImplementedError

    @property
    def padding_waste(self) -> float:
        """1 - real / padded tokens."""
        padded = self.padded_tokens
        return 1.0 - self.real_tokens / padded if padded else 0.0


@dataclass(frozen=True, slots=True)
class Collated(_TokenAccounting):
    """A padded batch: `[batch, padded_len]` int64 arrays plus the token accounting."""

    input_ids: npt.NDArray[np.int64]
    attention_mask: npt.NDArray[np.int64]
    position_ids: npt.NDArray[np.int64] | None
    lengths: tuple[int, ...]
    # [batch, padded_len] segment ids (padding: 0); None: segment 0 everywhere
    token_type_ids: npt.NDArray[np.int64] | None = None

    @property
    def width(self) -> int:
        """The padded length."""
        return int(self.input_ids.shape[1])

    @property
    def padded_tokens(self) -> int:
        """Tokens the model computes: batch x padded length."""
        return int(self.input_ids.shape[0] * self.input_ids.shape[1])


def collate(
    sequences: Sequence[Sequence[int]],
    pad_id: int,
    side: PadSide = "right",
    pad_to: int | None = None,
    position_ids: bool = False,
    segments: Sequence[Sequence[int] | None] | None = None,
) -> Collated:
    """Pad `sequences` to one length.

    `pad_to` fixes the padded length (it must be at least the longest sequence); by default it
    is the longest sequence. `position_ids=True` also returns positions `0..len-1` over each
    row's real tokens (padding gets 0), which absolute-position models need with left padding.
    `segments` gives each row's segment ids (None for a row, or for all: segment 0), padded
    like the tokens.
    """
    if not sequences:
        raise ValueError("cannot collate an empty batch")
    lengths = tuple(len(s) for s in sequences)
    if min(lengths) < 1:
        raise ValueError("cannot collate an empty sequence")
    longest = max(lengths)
    width = longest if pad_to is None else pad_to
    if width < longest:
        raise ValueError(f"pad_to={pad_to} is shorter than the longest sequence ({longest})")
    ids = np.full((len(sequences), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(sequences), width), dtype=np.int64)
    for row, (seq, n) in enumerate(zip(sequences, lengths, strict=True)):
        if side == "right":
            ids[row, :n] = seq
            mask[row, :n] = 1
        else:
            ids[row, width - n :] = seq
            mask[row, width - n :] = 1
    positions = None
    if position_ids:
        positions = np.clip(np.cumsum(mask, axis=1) - 1, 0, None).astype(np.int64)
    types = None
    if _has_segments(segments, lengths):
        assert segments is not None
        types = np.zeros((len(sequences), width), dtype=np.int64)
        for row, (seg, n) in enumerate(zip(segments, lengths, strict=True)):
            if seg is not None:
                if side == "right":
                    types[row, :n] = seg
                else:
                    types[row, width - n :] = seg
    return Collated(ids, mask, positions, lengths, types)


@dataclass(frozen=True, slots=True)
class Packed(_TokenAccounting):
    """A padding-free batch: every row's tokens end to end, `[tokens]`, plus the layout that
    puts them back into rows for attention.

    Token-wise layers run on `input_ids` as is (the batch costs its real tokens); attention
    scatters the packed rows into `[rows, width]` with `slots` and masks keys past each row's
    length. `offsets[i]:offsets[i + 1]` is row i's span in the packed tokens.
    """

    input_ids: npt.NDArray[np.int64]  # [tokens]
    position_ids: npt.NDArray[np.int64]  # [tokens], 0..len-1 within each row
    row_ids: npt.NDArray[np.int64]  # [tokens], the row each token belongs to
    slots: npt.NDArray[np.int64]  # [tokens], row * width + position: its place in [rows, width]
    offsets: npt.NDArray[np.int64]  # [rows + 1], cumulative lengths from 0
    lengths: tuple[int, ...]
    token_type_ids: npt.NDArray[np.int64] | None = None  # [tokens]; None: segment 0 everywhere

    @property
    def width(self) -> int:
        """The longest row: attention's padded width."""
        return max(self.lengths)

    @property
    def uniform(self) -> bool:
        """Every row has the same length: attention needs neither scatter nor mask."""
        return min(self.lengths) == max(self.lengths)

    @property
    def padded_tokens(self) -> int:
        """Tokens the token-wise layers compute: the real ones (attention apart), so its
        padding waste is 0."""
        return self.real_tokens

    @property
    def attention_tokens(self) -> int:
        """Query positions attention computes over: rows x width."""
        return self.rows * self.width


def pack(
    sequences: Sequence[Sequence[int]], segments: Sequence[Sequence[int] | None] | None = None
) -> Packed:
    """Pack `sequences` end to end (no padding), with the layout attention needs; `segments`
    as for `collate`."""
    if not sequences:
        raise ValueError("cannot pack an empty batch")
    if len(sequences) == 1 and (segments is None or segments[0] is None):
        # One row, every batch of a light load: its layout directly, in a quarter of the
        # general path's time (2.4 against 9.6 us, Intel Xeon family 6 model 167).
        n = len(sequences[0])
        if n < 1:
            raise ValueError("cannot pack an empty sequence")
        return Packed(
            np.array(sequences[0], dtype=np.int64),
            np.arange(n, dtype=np.int64),
            np.zeros(n, dtype=np.int64),
            np.arange(n, dtype=np.int64),
            np.array([0, n], dtype=np.int64),
            (n,),
        )
    lengths = tuple(len(s) for s in sequences)
    if min(lengths) < 1:
        raise ValueError("cannot pack an empty sequence")
    lens = np.asarray(lengths, dtype=np.int64)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    ids = np.fromiter((t for s in sequences for t in s), dtype=np.int64, count=int(offsets[-1]))
    row_ids = np.repeat(np.arange(len(lengths), dtype=np.int64), lens)
    positions = np.arange(int(offsets[-1]), dtype=np.int64) - np.repeat(offsets[:-1], lens)
    slots = row_ids * int(lens.max()) + positions
    types = None
    if _has_segments(segments, lengths):
        assert segments is not None
        types = np.fromiter(
            (
                t
                for seg, n in zip(segments, lengths, strict=True)
                for t in (seg if seg is not None else (0,) * n)
            ),
            dtype=np.int64,
            count=int(offsets[-1]),
        )
    return Packed(ids, positions, row_ids, slots, offsets, lengths, types)


@dataclass(frozen=True, slots=True)
class Rows(_TokenAccounting):
    """A batch's token rows before their layout (`Packed` if `packed`, else `Collated`, padded
    to `pad_to` or the longest row), with the same token accounting, from the lengths alone.

    The engine hands these to its worker thread, which builds the layout there: numpy's calls
    release the GIL, and on the event loop, with the runner threads busy, taking it back made
    collation cost the loop 173 us a batch against 24 us alone at saturation (Intel Xeon
    family 6 model 167, 2 cores; bench/results/request_cost.md)."""

    seqs: list[list[int]]
    segments: list[list[int] | None] | None
    pad_to: int | None
    packed: bool
    lengths: tuple[int, ...]

    @property
    def width(self) -> int:
        """The longest row, or the lane's fixed length for a padded batch that has one."""
        longest = max(self.lengths)
        return longest if self.packed or self.pad_to is None else max(self.pad_to, longest)

    @property
    def padded_tokens(self) -> int:
        """Tokens the model computes: the real ones packed, rows x width padded."""
        return self.real_tokens if self.packed else self.rows * self.width


def pack_collated(batch: Collated) -> Packed:
    """The packed layout of a padded batch (its real tokens, on either padding side)."""
    mask = batch.attention_mask.astype(bool)
    rows = [row[m].tolist() for row, m in zip(batch.input_ids, mask, strict=True)]
    if batch.token_type_ids is None:
        return pack(rows)
    types = [row[m].tolist() for row, m in zip(batch.token_type_ids, mask, strict=True)]
    return pack(rows, types)


def _has_segments(
    segments: Sequence[Sequence[int] | None] | None, lengths: tuple[int, ...]
) -> bool:
    """True if any row has segment ids; each given row must have one per token."""
    if segments is None:
        return False
    if len(segments) != len(lengths):
        raise ValueError(f"{len(segments)} rows of segment ids for {len(lengths)} sequences")
    for seg, n in zip(segments, lengths, strict=True):
        if seg is not None and len(seg) != n:
            raise ValueError(f"a row has {len(seg)} segment ids for {n} tokens")
    return any(seg is not None for seg in segments)
