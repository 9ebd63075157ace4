"""Specification of cache kinds in the stores.

A store keeps each ``LMCacheSDKCacheKind`` in its own namespace with the
same chunk semantics: KV is ``[2, L, T, D]``, QUERY ``[1, L, T, Dq]``.
Tests taking ``kv_store`` run on both backends (shared memory, Redis).
"""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest

from lmcache_mp import LMCacheSDKCacheKind
from lmcache_mp.errors import CorruptChunkWarning, KVConfigError
from lmcache_mp.kv import KVStore, connect
from tests._store_util import RawChunks, StoreFactory

KV, QUERY = LMCacheSDKCacheKind.KV, LMCacheSDKCacheKind.QUERY
C = 4
TOKENS = list(range(1, 9))


def queries(tokens: list[int], layers: int = 2, width: int = 6) -> np.ndarray:
    """A [1, L, T, Dq] query tensor whose values encode token and layer."""
    t = np.asarray(tokens, np.float32)[None, None, :, None]
    layer = np.arange(layers, dtype=np.float32)[None, :, None, None]
    col = np.arange(width, dtype=np.float32)[None, None, None, :]
    return (t + 10 * layer + 100 * col).astype(np.float32)


def keys_values(tokens: list[int]) -> np.ndarray:
    """A [2, 2, T, 4] KV, distinct from :func:`queries`."""
    return -np.stack([queries(tokens, width=4)[0]] * 2)


@pytest.fixture
def kv_store(store_url: str, stores: StoreFactory) -> KVStore:
    """A named KV store with 4-token chunks, of each backend."""
    store: KVStore = stores.connect(store_url, chunk_size=C)
    return store


def test_the_kinds_are_upstreams() -> None:
    """KV and QUERY carry upstream's values; KV has two planes, QUERY one."""
    assert (KV.value, QUERY.value) == ("kv", "query")
    assert (KV.planes, QUERY.planes) == (2, 1)


def test_a_store_is_the_kv_kind(kv_store: KVStore) -> None:
    """connect() returns the KV context."""
    assert kv_store.kind is KV


def test_query_round_trips_through_its_namespace(kv_store: KVStore) -> None:
    """A [1, L, T, Dq] query tensor stored in the QUERY namespace comes back
    bit for bit, chunk-aligned."""
    q_store = kv_store.for_kind(QUERY)
    try:
        assert q_store.store(queries(TOKENS), TOKENS)
        got = q_store.retrieve(TOKENS)
        assert got is not None and got.shape == (1, 2, 8, 6)
        np.testing.assert_array_equal(got, queries(TOKENS))
    finally:
        q_store.close()


def test_kinds_never_answer_for_each_other(kv_store: KVStore) -> None:
    """The same tokens cached as KV and as queries are two entries: each
    kind retrieves its own tensor, and a kind with nothing cached misses."""
    q_store = kv_store.for_kind(QUERY)
    try:
        kv_store.store(keys_values(TOKENS), TOKENS)
        assert q_store.retrieve(TOKENS) is None
        q_store.store(queries(TOKENS), TOKENS)
        np.testing.assert_array_equal(kv_store.retrieve(TOKENS), keys_values(TOKENS))
        np.testing.assert_array_equal(q_store.retrieve(TOKENS), queries(TOKENS))
        assert kv_store.stats().chunks == q_store.stats().chunks == 2
    finally:
        q_store.close()


@pytest.mark.parametrize(
    ("kind", "shape", "needle"),
    [
        (QUERY, (2, 2, 8, 6), r"QUERY has shape \(2, 2, 8, 6\), expected 4-D \[1,"),
        (KV, (1, 2, 8, 4), r"KV has shape \(1, 2, 8, 4\), expected 4-D \[2,"),
    ],
)
def test_a_tensor_of_the_wrong_kind_is_refused(
    kv_store: KVStore,
    kind: LMCacheSDKCacheKind,
    shape: tuple[int, ...],
    needle: str,
) -> None:
    """Each kind checks its first axis and names itself in the error."""
    ctx = kv_store.for_kind(kind)
    try:
        with pytest.raises(KVConfigError, match=needle):
            ctx.store(np.zeros(shape, np.float32), TOKENS)
    finally:
        ctx.close()


def test_a_kind_pickles_by_location_and_kind(kv_store: KVStore) -> None:
    """An unpickled QUERY handle (what a worker gets) reads the same namespace."""
    q_store = kv_store.for_kind(QUERY)
    q_store.store(queries(TOKENS), TOKENS)
    copy = pickle.loads(pickle.dumps(q_store))
    try:
        assert copy.kind is QUERY and copy.url == q_store.url
        np.testing.assert_array_equal(copy.retrieve(TOKENS), queries(TOKENS))
    finally:
        copy.close()
        q_store.close()


def test_connect_opens_a_named_stores_query_namespace(
    kv_store: KVStore,
) -> None:
    """connect(url, kind=QUERY) is the same namespace as for_kind(QUERY),
    and its layout arguments fix that namespace's layout."""
    first = connect(
        kv_store.url, chunk_size=C, kind=QUERY, layers=2, width=6, dtype="float32"
    )
    try:
        assert first.layout is not None and first.layout.planes == 1
        first.store(queries(TOKENS), TOKENS)
        again = kv_store.for_kind(QUERY)
        np.testing.assert_array_equal(again.retrieve(TOKENS), queries(TOKENS))
        again.close()
        with pytest.raises(KVConfigError, match="does not match"):
            connect(
                kv_store.url,
                chunk_size=C,
                kind=QUERY,
                layers=3,
                width=6,
                dtype="float32",
            )
    finally:
        first.close()


def test_a_temporary_store_has_no_query_namespace_by_url() -> None:
    """connect(kind=QUERY) without a URL is refused, naming for_kind()."""
    with pytest.raises(KVConfigError, match="for_kind"):
        connect(kind=QUERY)


def test_removing_the_store_removes_every_kind(stores: StoreFactory) -> None:
    """destroy() of the KV store removes the query namespace's files too."""
    kv_store = stores.named(chunk_size=C)
    q_store = kv_store.for_kind(QUERY)
    q_store.store(queries(TOKENS), TOKENS)
    q_path = q_store.path
    q_store.close()
    assert os.path.isdir(q_path) and q_path.startswith(kv_store.path + os.sep)
    kv_store.destroy()
    assert not os.path.lexists(q_path)


def test_a_corrupt_query_chunk_is_a_miss(kv_store: KVStore) -> None:
    """The checksum guards the query namespace as it guards KV."""
    q_store = kv_store.for_kind(QUERY)
    try:
        q_store.store(queries(TOKENS), TOKENS)
        raw = RawChunks(q_store, TOKENS)
        data = raw.get(1)
        assert data is not None
        raw.put(1, data[:-1] + bytes([data[-1] ^ 0xFF]))
        with pytest.warns(CorruptChunkWarning, match="checksum"):
            got = q_store.retrieve(TOKENS)
        assert got is not None and got.shape[2] == C
        assert raw.get(1) is None
    finally:
        q_store.close()
