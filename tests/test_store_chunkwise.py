"""Chunk-wise store and retrieve (``start=``): how an engine offloads a
prefill, or loads a long prefix, a chunk at a time (as
LMCache's store and retrieve masks skip the tokens a caller holds).

Every test runs on both backends (the shared-memory and Redis stores).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from lmcache_mp.errors import KVConfigError
from lmcache_mp.kv import KVStore
from tests._store_util import StoreFactory, bits, kv_of

C = 4  # chunk size
TOKENS = list(range(100, 100 + 3 * C))  # exactly three chunks


@pytest.fixture
def ctx(store_url: str, stores: StoreFactory) -> KVStore:
    """A fresh store with 4-token chunks, of each backend."""
    store: KVStore = stores.connect(store_url, chunk_size=C)
    return store


@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16])
def test_a_kv_stored_a_chunk_at_a_time_reads_back_whole(
    ctx: KVStore, dtype: type
) -> None:
    """Three calls of one chunk each store what one call of three would:
    the whole prefix reads back bit for bit."""
    kv = kv_of(TOKENS, dtype=dtype)
    for start in range(0, len(TOKENS), C):
        end = start + C
        assert ctx.store(kv[:, :, start:end], TOKENS[:end], start=start)
    got = ctx.retrieve(TOKENS)
    assert got is not None
    np.testing.assert_array_equal(bits(got), bits(kv))


def test_retrieve_from_start_returns_the_tokens_from_there(ctx: KVStore) -> None:
    """retrieve(start=4) of a cached prefix is its KV from token 4 on."""
    kv = kv_of(TOKENS)
    ctx.store(kv, TOKENS)
    got = ctx.retrieve(TOKENS, start=C)
    assert got is not None
    np.testing.assert_array_equal(bits(got), bits(kv[:, :, C:]))


def test_retrieve_one_chunk_at_a_time_walks_the_prefix(ctx: KVStore) -> None:
    """A loop of one-chunk retrieves reads each chunk once, in order, and
    ends with None past the cached prefix."""
    kv = kv_of(TOKENS)
    ctx.store(kv[:, :, : 2 * C], TOKENS[: 2 * C])
    parts = []
    for start in range(0, len(TOKENS), C):
        part = ctx.retrieve(TOKENS[: start + C], start=start)
        if part is None:
            break
        parts.append(part)
    assert len(parts) == 2
    np.testing.assert_array_equal(
        bits(np.concatenate(parts, 2)), bits(kv[:, :, : 2 * C])
    )


def test_a_start_chunk_not_cached_retrieves_none(ctx: KVStore) -> None:
    """Only chunk 0 cached: retrieve(start=4) finds nothing."""
    ctx.store(kv_of(TOKENS[:C]), TOKENS[:C])
    assert ctx.retrieve(TOKENS, start=C) is None


def test_a_tail_shorter_than_a_chunk_retrieves_none(ctx: KVStore) -> None:
    """start at the last chunk boundary with no full chunk after it: None."""
    ctx.store(kv_of(TOKENS), TOKENS)
    assert ctx.retrieve(TOKENS[: 3 * C - 1], start=2 * C) is None


def test_chunks_before_start_are_neither_read_nor_written(ctx: KVStore) -> None:
    """A chunk stored with start=4 is keyed by its whole prefix, written
    alone, and read back from start=4 while the prefix's chunk 0 is
    missing (which a retrieve from 0 reports as a miss)."""
    kv = kv_of(TOKENS)
    assert ctx.store(kv[:, :, C : 2 * C], TOKENS[: 2 * C], start=C)
    assert ctx.stats().chunks == 1
    assert ctx.retrieve(TOKENS) is None
    got = ctx.retrieve(TOKENS, start=C)
    assert got is not None
    np.testing.assert_array_equal(bits(got), bits(kv[:, :, C : 2 * C]))


def test_overwrite_from_start_keeps_the_chunks_before_it(ctx: KVStore) -> None:
    """overwrite=True with start=4 replaces chunks 1-2 and leaves chunk 0."""
    old, new = kv_of(TOKENS), kv_of(TOKENS, seed=1)
    ctx.store(old, TOKENS)
    assert ctx.store(new[:, :, C:], TOKENS, overwrite=True, start=C)
    got = ctx.retrieve(TOKENS)
    assert got is not None
    np.testing.assert_array_equal(bits(got[:, :, :C]), bits(old[:, :, :C]))
    np.testing.assert_array_equal(bits(got[:, :, C:]), bits(new[:, :, C:]))


def test_store_from_the_end_of_the_tokens_writes_nothing(ctx: KVStore) -> None:
    """start=len(tokens) with an empty KV is valid and stores nothing."""
    assert ctx.store(kv_of(TOKENS)[:, :, :0], TOKENS, start=len(TOKENS)) is False
    assert ctx.stats().chunks == 0


@pytest.mark.parametrize("start", [-C, 1, C + 1, 4 * C, 4.0, True, "4"])
def test_a_start_off_a_chunk_boundary_is_refused(ctx: KVStore, start: object) -> None:
    """A start that is not an int multiple of the chunk size within the
    tokens fails store and retrieve alike, naming it; nothing is written."""
    with pytest.raises(KVConfigError, match=f"start must be .*got {start!r}"):
        ctx.store(kv_of(TOKENS)[:, :, C:], TOKENS, start=start)  # type: ignore[arg-type]
    with pytest.raises(KVConfigError, match="start must be"):
        ctx.retrieve(TOKENS, start=start)  # type: ignore[arg-type]
    assert ctx.stats().chunks == 0


def test_a_kv_of_all_the_tokens_with_a_start_is_refused(ctx: KVStore) -> None:
    """With start=4 the KV must hold tokens[4:]; the whole prefix's KV is
    refused, and the message says which tokens were expected."""
    with pytest.raises(KVConfigError, match=r"8 tokens on axis 2 \(tokens\[4:\]\)"):
        ctx.store(kv_of(TOKENS), TOKENS, start=C)
