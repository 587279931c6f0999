"""Keys and values of prompt prefixes already prefilled, reused by prompts that start the same
way (a chat's system prompt, a few-shot preamble, the turns before the last one).

A prompt is cut into blocks of `BLOCK_TOKENS` tokens. Each block's keys and values (every
layer's, at the block's own positions) are kept under the block's tokens *and* the block before
it, so a block is found only behind the exact same prefix: the same tokens at the same
positions, which is what makes its keys and values the same. Lookups compare the tokens
themselves (a dict keyed by `(parent block, tokens)`), not a hash of them: two prompts that
differ are never confused (vLLM's first prefix cache keyed blocks by Python's `hash()`, whose
collisions could be forged; it moved to SHA-256).

The blocks live in one pool, `[layers, 2, kv_heads, slots x BLOCK_TOKENS, head_dim]`, sized
by the byte budget when the first prompt is kept (its pages are touched as blocks fill it, then
reused): keeping a prompt's blocks is one copy per layer from the prefill's cache into their
slots' columns, and seeding a job one gather of those columns, with no new allocation for the
blocks. When no slot is free the least recently used block goes, with every block behind it
(a block without its parent could never be found again); a lookup or a store marks the blocks
it went through from the last to the first, so a shared system prompt outlives the tails behind
it.

`match` returns the longest run of cached blocks at the start of a prompt, short of its last
token (one token must run to give the first logits). It, `store` (a prompt just prefilled) and
`seed` (copy matched blocks into a job's empty cache) run in the engine's worker thread, one
after the other; `peek` (what admission may count on) runs on the event loop, so the table
takes a lock. A block dropped between a match and its seed is noticed there (its slot may hold
another block by then) and the job starts where what is left of its match ends. Pure
otherwise: no clock, no model.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["BLOCK_TOKENS", "PrefixCache", "PrefixMatch", "block_chain"]

# Tokens per block. vLLM's default on GPUs; small enough that two prompts sharing a 40-token
# system prompt reuse 32 of it, large enough that the table's Python work (one dict lookup
# per block) stays far below a prefill's.
BLOCK_TOKENS = 16


def block_chain(ids: Sequence[int]) -> list[int]:
    """For each whole block of `ids`, a hash of it and every block before it: two prompts
    share their first k blocks where their k-th entries are equal (but for a collision). For
    deciding what to prefill first only; lookups compare the tokens themselves."""
    out: list[int] = []
    h = 0
    for j in range(len(ids) // BLOCK_TOKENS):
        h = hash((h, tuple(ids[j * BLOCK_TOKENS : (j + 1) * BLOCK_TOKENS])))
        out.append(h)
    return out


class _Block:
    __slots__ = ("children", "key", "live", "parent", "serial", "slot")

    def __init__(
        self, key: tuple[int, tuple[int, ...]], slot: int, parent: _Block | None, serial: int
    ) -> None:
        self.key = key
        self.slot = slot  # its place in the pool
        self.parent = parent
        self.serial = serial  # the first member of its children's keys
        self.children: set[_Block] = set()
        self.live = True  # False once dropped: its slot may hold another block


@dataclass
class PrefixMatch:
    """The cached blocks found at the start of one prompt, in order."""

    blocks: list[Any] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        """Prompt tokens the blocks cover."""
        return len(self.blocks) * BLOCK_TOKENS

    def live_tokens(self) -> int:
        """Prompt tokens the blocks still in the table cover (up to the first dropped one)."""
        n = 0
        for b in self.blocks:
            if not b.live:
                break
            n += 1
        return n * BLOCK_TOKENS


def _layers(cache: Any) -> list[Any]:
    """The full-attention layers of a transformers-style cache (`layers[i].keys`, `.values`:
    `[rows, kv_heads, columns, head_dim]`)."""
    layers: list[Any] = getattr(cache, "layers", [])
    if not layers:
        raise ValueError(f"a {type(cache).__name__} has no layers to keep")
    for layer in layers:
        if getattr(layer, "is_sliding", False) or getattr(layer, "keys", None) is None:
            raise ValueError(f"a {type(layer).__name__} layer keeps no whole prefix")
    return layers


class PrefixCache:
    """Blocks of prompts already prefilled, at most `max_bytes` of them (see the module)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._blocks: OrderedDict[tuple[int, tuple[int, ...]], _Block] = OrderedDict()
        self._next = itertools.count(1)
        self._lock = threading.Lock()
        self._pool: torch.Tensor | None = None
        self._free: list[int] = []
        self.block_bytes = 0
        self.lookups = 0  # prompts looked up (`count`)
        self.looked_tokens = 0  # their tokens
        self.hit_tokens = 0  # of those, tokens taken from the cache
        self.stored_blocks = 0
        self.evicted_blocks = 0

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def bytes(self) -> int:
        """Bytes of the blocks kept."""
        return len(self._blocks) * self.block_bytes

    @staticmethod
    def _key(parent: _Block | None, ids: Sequence[int], j: int) -> tuple[int, tuple[int, ...]]:
        """Block `j` of `ids` behind `parent` (None: the first block)."""
        serial = 0 if parent is None else parent.serial
        return serial, tuple(ids[j * BLOCK_TOKENS : (j + 1) * BLOCK_TOKENS])

    def _walk(self, ids: Sequence[int], blocks: int) -> list[_Block]:
        """The cached blocks among the first `blocks` of `ids`, up to the first missing one,
        marked as used (the first last: leaves go before their root). Under the lock."""
        found: list[_Block] = []
        parent: _Block | None = None
        for j in range(blocks):
            block = self._blocks.get(self._key(parent, ids, j))
            if block is None:
                break
            found.append(block)
            parent = block
        for block in reversed(found):
            self._blocks.move_to_end(block.key)
        return found

    def match(self, ids: Sequence[int]) -> PrefixMatch:
        """The longest run of cached blocks at the start of `ids`, leaving at least its last
        token to run."""
        with self._lock:
            return PrefixMatch(self._walk(ids, (len(ids) - 1) // BLOCK_TOKENS))

    def peek(self, ids: Sequence[int]) -> int:
        """Tokens of `ids` a lookup would find cached now (for pricing admission; the blocks
        are not marked as used)."""
        found = 0
        with self._lock:
            parent: _Block | None = None
            for j in range((len(ids) - 1) // BLOCK_TOKENS):
                block = self._blocks.get(self._key(parent, ids, j))
                if block is None:
                    break
                found += 1
                parent = block
        return found * BLOCK_TOKENS

    def count(self, prompts: int, tokens: int, reused: int) -> None:
        """Record that `prompts` prompts of `tokens` tokens were looked up and `reused` of
        those tokens were taken from the cache."""
        with self._lock:
            self.lookups += prompts
            self.looked_tokens += tokens
            self.hit_tokens += reused

    # ------------------------------------------------------------------ the worker's side

    def _make_pool(self, like: torch.Tensor, layers: int) -> bool:
        """Size the pool for blocks shaped as `like`'s columns (`[rows, kv_heads, columns,
        head_dim]`); False when not one block fits the budget."""
        heads, dim = like.shape[1], like.shape[3]
        self.block_bytes = layers * 2 * heads * BLOCK_TOKENS * dim * like.element_size()
        count = self.max_bytes // self.block_bytes
        if count < 1:
            return False
        # torch.empty: pages are taken from the system as blocks are written, then reused
        self._pool = like.new_empty((layers, 2, heads, count * BLOCK_TOKENS, dim))
        self._free = list(range(count - 1, -1, -1))
        return True

    @staticmethod
    def _columns(blocks: Sequence[_Block]) -> torch.Tensor:
        """The pool columns of `blocks`' tokens, in order."""
        slots = torch.tensor([b.slot for b in blocks], dtype=torch.long)
        return (slots[:, None] * BLOCK_TOKENS + torch.arange(BLOCK_TOKENS)).flatten()

    def store(self, cache: Any, rows: Sequence[Sequence[int]], starts: Sequence[int]) -> int:
        """Keep the whole blocks of each row's tokens `rows[i]` (prefilled in `cache`, a
        left-padded job's, from column `starts[i]` on) that the table lacks; returns the
        blocks added. Raises ValueError for a cache that keeps no whole prefix."""
        layers = _layers(cache)
        if self._pool is None and not self._make_pool(layers[0].keys, len(layers)):
            return 0
        pool = self._pool
        assert pool is not None
        if layers[0].keys.dtype != pool.dtype or len(layers) != pool.shape[0]:
            raise ValueError("the cache's layers or dtype changed")
        added = 0
        for i, (ids, start) in enumerate(zip(rows, starts, strict=True)):
            whole = len(ids) // BLOCK_TOKENS
            with self._lock:
                chain = self._walk(ids, whole)
                new = self._allocate(ids, chain, whole)
                for block in reversed(chain + new):  # the root most recent, as in `_walk`
                    self._blocks.move_to_end(block.key)
            if not new:
                continue
            lo = start + len(chain) * BLOCK_TOKENS
            hi = lo + len(new) * BLOCK_TOKENS
            first = new[0].slot * BLOCK_TOKENS
            consecutive = all(b.slot == new[0].slot + k for k, b in enumerate(new))
            cols = None if consecutive else self._columns(new)
            for li, layer in enumerate(layers):
                for kind, src in enumerate((layer.keys, layer.values)):
                    if cols is None:  # the usual case: fresh slots in a row
                        pool[li, kind, :, first : first + hi - lo].copy_(src[i, :, lo:hi])
                    else:
                        pool[li, kind].index_copy_(1, cols, src[i, :, lo:hi])
            added += len(new)
        with self._lock:
            self.stored_blocks += added
        return added

    def _allocate(self, ids: Sequence[int], chain: list[_Block], whole: int) -> list[_Block]:
        """Slots and table entries for blocks `len(chain)`.. `whole - 1` of `ids` behind
        `chain` (dropping the least recently used where none is free; never one of `chain`'s
        or of the new ones, which are the most recent). Under the lock."""
        new: list[_Block] = []
        parent = chain[-1] if chain else None
        for j in range(len(chain), whole):
            if not self._free:
                self._evict(protect=len(chain) + len(new))
            if not self._free:
                break
            block = _Block(self._key(parent, ids, j), self._free.pop(), parent, next(self._next))
            self._blocks[block.key] = block
            if parent is not None:
                parent.children.add(block)
            new.append(block)
            parent = block
        return new

    def _evict(self, protect: int) -> None:
        """Drop the least recently used block (and every block behind it) unless it is one of
        the `protect` most recent ones."""
        if len(self._blocks) <= protect:
            return
        oldest = next(iter(self._blocks.values()))
        stack = [oldest]
        while stack:
            b = stack.pop()
            if self._blocks.pop(b.key, None) is None:
                continue
            b.live = False
            self._free.append(b.slot)
            self.evicted_blocks += 1
            stack.extend(b.children)
        if oldest.parent is not None:
            oldest.parent.children.discard(oldest)

    def seed(
        self, cache: Any, matches: Sequence[PrefixMatch], starts: Sequence[int], cols: int
    ) -> int:
        """Fill the empty `cache` of a left-padded job with its first columns: row `i` (its
        prompt from column `starts[i]`) gets its match's keys and values from its start on,
        zeros (masked padding) before. `cols` is where the job was to start; a block dropped
        since its match moves that back (to where the rows' remaining matches end, 0 when
        that gains nothing). Returns the columns filled."""
        pool = self._pool
        with self._lock:
            live = [m.live_tokens() for m in matches]
        cols = min(cols, *(s + n for s, n in zip(starts, live, strict=True)))
        if pool is None or all(cols <= s for s in starts):
            return 0
        layers, _, heads, _, dim = pool.shape
        # Each layer's keys and values as the cache keeps them, `[rows, heads, cols, dim]`,
        # written once: a row's blocks are gathered one layer at a time (a few MB, which the
        # copy into place then reads from the processor's cache, where one gather of every
        # layer would allocate and copy the whole prefix twice).
        out = [[pool.new_empty((len(matches), heads, cols, dim)) for _ in range(2)]
               for _ in range(layers)]  # fmt: skip
        for i, (m, start) in enumerate(zip(matches, starts, strict=True)):
            n = max(0, cols - start)
            idx = self._columns(m.blocks[: -(-n // BLOCK_TOKENS)])[:n] if n else None
            for layer, kinds in enumerate(out):
                for kind, t in enumerate(kinds):
                    row = t[i]
                    if n < cols:
                        row[:, : cols - n].zero_()  # masked padding
                    if idx is not None:
                        row[:, cols - n :].copy_(pool[layer, kind].index_select(1, idx))
        for layer, (keys, values) in enumerate(out):
            cache.update(keys, values, layer)
        return cols

    def stats(self) -> dict[str, Any]:
        """JSON-ready figures: blocks and bytes kept, lookups and the share of looked-up
        prompt tokens found cached."""
        return {
            "blocks": len(self._blocks),
            "bytes": self.bytes,
            "max_bytes": self.max_bytes,
            "block_tokens": BLOCK_TOKENS,
            "lookups": self.lookups,
            "looked_up_tokens": self.looked_tokens,
            "hit_tokens": self.hit_tokens,
            "hit_rate": self.hit_tokens / self.looked_tokens if self.looked_tokens else 0.0,
            "stored_blocks": self.stored_blocks,
            "evicted_blocks": self.evicted_blocks,
        }
