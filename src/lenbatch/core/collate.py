"""Collate: turn a batch of token-id lists into padded arrays the model can take.

Pads to the batch's own longest member (or to a fixed length for the `static` baseline) on the
model's padding side, builds the attention mask, and, for models with absolute positions that
are left-padded, position ids that start at 0 on each row's first real token. Pure numpy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

__all__ = ["Collated", "collate"]

PadSide = Literal["right", "left"]


@dataclass(frozen=True, slots=True)
class Collated:
    """A padded batch: `[batch, padded_len]` int64 arrays plus the token accounting."""

    input_ids: npt.NDArray[np.int64]
    attention_mask: npt.NDArray[np.int64]
    position_ids: npt.NDArray[np.int64] | None
    lengths: tuple[int, ...]

    @property
    def real_tokens(self) -> int:
        """Tokens that carry input."""
        return sum(self.lengths)

    @property
    def padded_tokens(self) -> int:
        """Tokens the model computes: batch x padded length."""
        return int(self.input_ids.shape[0] * self.input_ids.shape[1])

    @property
    def padding_waste(self) -> float:
        """1 - real / padded tokens."""
        padded = self.padded_tokens
        return 1.0 - self.real_tokens / padded if padded else 0.0


def collate(
    sequences: Sequence[Sequence[int]],
    pad_id: int,
    side: PadSide = "right",
    pad_to: int | None = None,
    position_ids: bool = False,
) -> Collated:
    """Pad `sequences` to one length.

    `pad_to` fixes the padded length (it must be at least the longest sequence); by default it
    is the longest sequence. `position_ids=True` also returns positions `0..len-1` over each
    row's real tokens (padding gets 0), which absolute-position models need with left padding.
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
    return Collated(ids, mask, positions, lengths)
