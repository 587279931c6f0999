"""The prefix cache's table (`generate.prefixcache`): which blocks a prompt finds, what is kept,
what goes past the budget, and the copies in and out of a left-padded prefill cache."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lenbatch.generate.prefixcache import BLOCK_TOKENS, PrefixCache, PrefixMatch

B = BLOCK_TOKENS
LAYERS, HEADS, DIM = 2, 3, 4
BLOCK_BYTES = LAYERS * 2 * HEADS * B * DIM * 4


def _kv_of(ids: list[int]) -> torch.Tensor:
    """Keys and values that name their token, position, layer and kind:
    `[layers, 2, heads, len, dim]`."""
    t = torch.tensor(ids, dtype=torch.float32)
    pos = torch.arange(len(ids), dtype=torch.float32)
    base = (t * 1000 + pos)[None, None, None, :, None]
    layer = torch.arange(LAYERS, dtype=torch.float32)[:, None, None, None, None] * 1e7
    kind = torch.tensor([0.0, 0.5])[None, :, None, None, None]
    return (base + layer + kind).expand(LAYERS, 2, HEADS, len(ids), DIM).clone()


class _Layer:
    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None


class _Cache:
    """transformers' cache contract: `update(keys, values, layer)` appends columns."""

    def __init__(self) -> None:
        self.layers = [_Layer() for _ in range(LAYERS)]

    def update(self, k: torch.Tensor, v: torch.Tensor, layer: int) -> Any:
        lay = self.layers[layer]
        lay.keys = k.clone() if lay.keys is None else torch.cat([lay.keys, k], dim=-2)
        lay.values = v.clone() if lay.values is None else torch.cat([lay.values, v], dim=-2)
        return lay.keys, lay.values


def _prefilled(rows: list[list[int]]) -> tuple[_Cache, list[int]]:
    """A left-padded prefill's cache of `rows` (padding columns zero) and each row's start."""
    width = max(len(r) for r in rows)
    starts = [width - len(r) for r in rows]
    cache = _Cache()
    for layer in range(LAYERS):
        k = torch.zeros(len(rows), HEADS, width, DIM)
        v = torch.zeros(len(rows), HEADS, width, DIM)
        for i, (r, s) in enumerate(zip(rows, starts, strict=True)):
            kv = _kv_of(r)
            k[i, :, s:] = kv[layer, 0]
            v[i, :, s:] = kv[layer, 1]
        cache.update(k, v, layer)
    return cache, starts


def _keep(prefixes: PrefixCache, *rows: list[int]) -> int:
    cache, starts = _prefilled(list(rows))
    return prefixes.store(cache, list(rows), starts)


def _seeded(
    prefixes: PrefixCache, rows: list[list[int]]
) -> tuple[_Cache, list[int], list[PrefixMatch], int, int]:
    """Look `rows` up as a left-padded job would and seed its cache: (the cache, the starts,
    the matches, the column the job was to start at, the columns filled)."""
    width = max(len(r) for r in rows)
    starts = [width - len(r) for r in rows]
    matches = [prefixes.match(r) for r in rows]
    cols = min(s + m.tokens for s, m in zip(starts, matches, strict=True))
    cache = _Cache()
    return cache, starts, matches, cols, prefixes.seed(cache, matches, starts, cols)


def test_a_prompt_finds_the_blocks_of_an_earlier_prompt_that_starts_the_same() -> None:
    prefixes = PrefixCache(1 << 30)
    system = list(range(100, 100 + 2 * B + 5))  # two whole blocks and 5 tokens
    assert _keep(prefixes, [*system, 1, 2, 3]) == 2
    new = [*system, 7, 8, 9, 10]
    assert prefixes.match(new).tokens == 2 * B
    cache, _, _, cols, filled = _seeded(prefixes, [new])
    assert cols == filled == 2 * B
    for layer in range(LAYERS):
        assert torch.equal(cache.layers[layer].keys[0], _kv_of(system)[layer, 0, :, : 2 * B])
        assert torch.equal(cache.layers[layer].values[0], _kv_of(system)[layer, 1, :, : 2 * B])
    # a prompt that differs in its first block finds nothing, though its second block's
    # tokens are the same (a block is kept behind its own prefix)
    assert prefixes.match([999, *system[1:], 1]).tokens == 0


def test_the_last_token_is_never_taken_from_the_cache() -> None:
    prefixes = PrefixCache(1 << 30)
    ids = list(range(2 * B))
    _keep(prefixes, ids)
    assert len(prefixes) == 2
    assert prefixes.match(ids).tokens == B  # the second block holds the last token: it runs
    assert prefixes.match([*ids, 5]).tokens == 2 * B


def test_a_block_is_kept_once_and_only_whole_blocks_are_kept() -> None:
    prefixes = PrefixCache(1 << 30)
    ids = list(range(3 * B - 1))
    assert _keep(prefixes, ids) == 2
    assert _keep(prefixes, ids) == 0
    assert prefixes.bytes == 2 * BLOCK_BYTES
    assert _keep(prefixes, [*ids, 1]) == 1  # the third block is whole now
    assert prefixes.stats()["stored_blocks"] == 3


def test_past_the_budget_the_least_recently_used_tails_go_and_a_shared_root_stays() -> None:
    prefixes = PrefixCache(4 * BLOCK_BYTES)
    root = list(range(B))
    tails = [[*root, *([t] * B), 0] for t in (1, 2, 3, 4)]
    for ids in tails[:3]:
        _keep(prefixes, ids)
    assert len(prefixes) == 4  # the root and three tails
    prefixes.match(tails[0])  # the first tail is used again
    _keep(prefixes, tails[3])
    assert prefixes.bytes <= prefixes.max_bytes
    assert prefixes.match(tails[0]).tokens == 2 * B
    assert prefixes.match(tails[3]).tokens == 2 * B
    assert prefixes.match(tails[1]).tokens == B  # its tail went, the root it shares stayed
    assert prefixes.stats()["evicted_blocks"] == 1
    # the slot the dropped tail left holds the new tail's keys and values
    cache, *_ = _seeded(prefixes, [tails[3]])
    assert torch.equal(cache.layers[1].keys[0], _kv_of(tails[3])[1, 0, :, : 2 * B])


def test_a_chain_loses_its_last_block_first() -> None:
    prefixes = PrefixCache(3 * BLOCK_BYTES)
    long = list(range(3 * B + 1))
    _keep(prefixes, long)
    assert len(prefixes) == 3
    _keep(prefixes, [*[7] * B, 0])  # a new root: the budget drops the oldest block...
    # ... which is the leaf of the long prompt's chain (its root was used last), never a
    # parent whose children would stay unreachable (a dropped parent takes them along)
    assert prefixes.match(long).tokens == 2 * B
    assert len(prefixes) == 3


def test_a_block_larger_than_the_budget_is_not_kept() -> None:
    prefixes = PrefixCache(BLOCK_BYTES - 1)
    assert _keep(prefixes, list(range(2 * B))) == 0
    assert len(prefixes) == 0 and prefixes.bytes == 0


def test_rows_of_a_left_padded_prefill_are_kept_and_seed_another_at_their_own_columns() -> None:
    prefixes = PrefixCache(1 << 30)
    system = list(range(50, 50 + 2 * B))
    # two rows of different lengths; the second's block is the first's: kept once
    assert _keep(prefixes, [*system, 1, 2, 3, 4, 5], [*system[:B], 9, 9]) == 2
    new = [[*system, 6, 6, 6, 6, 6, 6, 6], [*system, 8]]  # a long row and a shorter one
    cache, starts, matches, cols, filled = _seeded(prefixes, new)
    assert [m.tokens for m in matches] == [2 * B, 2 * B]
    assert cols == filled == 2 * B  # the long row's prefix ends first
    for layer in range(LAYERS):
        keys = cache.layers[layer].keys
        assert keys is not None and keys.shape == (2, HEADS, cols, DIM)
        for i, (r, s) in enumerate(zip(new, starts, strict=True)):
            assert torch.equal(keys[i, :, :s], torch.zeros(HEADS, s, DIM))  # masked padding
            assert torch.equal(keys[i, :, s:], _kv_of(r)[layer, 0, :, : cols - s])


def test_a_block_dropped_between_lookup_and_seed_moves_the_start_back() -> None:
    """The lookup runs on the event loop, the seed later in the worker; a store between them
    may drop a matched block and give its slot to another. The seed notices and fills only
    what is left."""
    prefixes = PrefixCache(3 * BLOCK_BYTES)
    ids = [*range(2 * B), 1]
    _keep(prefixes, ids)
    matches = [prefixes.match(ids)]
    assert matches[0].tokens == 2 * B
    fives = [*[5] * (2 * B), 1]
    _keep(prefixes, fives)  # needs two slots: the free one, then the one of ids' leaf
    assert prefixes.match(ids).tokens == B
    got, *_ = _seeded(prefixes, [fives])  # its blocks, in slots not side by side, read back
    assert torch.equal(got.layers[1].values[0], _kv_of(fives)[1, 1, :, : 2 * B])
    cache = _Cache()
    assert prefixes.seed(cache, matches, [0], 2 * B) == B
    assert torch.equal(cache.layers[0].keys[0], _kv_of(ids)[0, 0, :, :B])
    _keep(prefixes, [*[6] * (3 * B), 1])  # every block of ids goes
    assert prefixes.seed(_Cache(), matches, [0], 2 * B) == 0


def test_a_cache_of_sliding_window_layers_is_refused() -> None:
    cache = _Cache()
    for layer in range(LAYERS):
        cache.update(torch.zeros(1, HEADS, B, DIM), torch.zeros(1, HEADS, B, DIM), layer)
    cache.layers[1].is_sliding = True  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="whole prefix"):
        PrefixCache(1 << 30).store(cache, [list(range(B))], [0])


def test_peek_finds_what_a_lookup_would_and_marks_nothing_used() -> None:
    prefixes = PrefixCache(2 * BLOCK_BYTES)
    first = [*range(B), 1]
    _keep(prefixes, first)
    _keep(prefixes, [*[9] * B, 1])
    assert prefixes.peek(first) == B == prefixes.match(first).tokens
    assert prefixes.peek(list(range(B))) == 0  # the last token always runs
    prefixes.peek([*[9] * B, 1])  # a peek leaves the nines least recently used...
    _keep(prefixes, [*[7] * B, 1])
    assert prefixes.peek([*[9] * B, 1]) == 0  # ... so they went
    assert prefixes.peek(first) == B
