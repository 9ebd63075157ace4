"""The KV store in one process: keys, chunks, layout, lifecycle.

Tests taking ``ctx`` or ``store_url`` specify both backends (the
shared-memory store and the Redis store run each); ``shm_ctx`` tests are
about the shared-memory store's directory.
"""

from __future__ import annotations

import gc
import os
import pickle
import tempfile
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import ml_dtypes
import numpy as np
import pytest

from lmcache_mp.errors import (
    CorruptChunkWarning,
    KVCapacityError,
    KVConfigError,
    KVStoreError,
)
from lmcache_mp.kv import (
    DEFAULT_CHUNK_SIZE,
    KVContext,
    KVStore,
    SharedMemoryKVStore,
    StoreStats,
    _connect,
)
from lmcache_mp.kv._chunk import HEADER_SIZE
from lmcache_mp.kv._common import StagedChunks
from lmcache_mp.kv._layout import Layout
from lmcache_mp.kv._pins import PinOwner, pinning
from tests._scripts import run_python
from tests._store_util import (
    RawChunks,
    StoreFactory,
    bits,
    chunk_paths,
    kv_of,
    spawned_pool,
    staged_names,
    temp_names,
    unique_url,
)

C = 4  # chunk size of most tests
TOKENS = list(range(100, 100 + 3 * C))  # exactly three chunks


@pytest.fixture
def ctx(store_url: str, stores: StoreFactory) -> KVStore:
    """A fresh store with 4-token chunks, of each backend."""
    store: KVStore = stores.connect(store_url, chunk_size=C)
    return store


@pytest.fixture
def shm_ctx(stores: StoreFactory) -> SharedMemoryKVStore:
    """A fresh temporary shared-memory store with 4-token chunks."""
    store: SharedMemoryKVStore = stores.connect(chunk_size=C)
    return store


def test_connect_gives_a_kv_context_in_dev_shm(shm_ctx: KVStore) -> None:
    """connect() with no URL makes a fresh KVContext under /dev/shm."""
    assert isinstance(shm_ctx, KVContext)
    assert shm_ctx.path.startswith("/dev/shm/")
    assert "lmcache" in os.path.basename(shm_ctx.path)
    assert shm_ctx.url.startswith("shm:///")
    assert shm_ctx.chunk_size == C
    assert DEFAULT_CHUNK_SIZE == 256


def test_each_connect_without_url_is_a_new_store(stores: StoreFactory) -> None:
    """Two connect() calls without a URL never share a directory."""
    assert stores.connect().path != stores.connect().path


def test_empty_store_retrieves_none(ctx: KVStore) -> None:
    """Nothing stored: retrieve returns None."""
    assert ctx.retrieve(TOKENS) is None


def test_retrieve_returns_longest_cached_prefix(ctx: KVStore) -> None:
    """Three chunks stored, 3.5 chunks asked: the three chunks come back."""
    kv = kv_of(TOKENS)
    assert ctx.store(kv, TOKENS)
    got = ctx.retrieve([*TOKENS, 1, 2])
    assert got is not None
    assert np.array_equal(got, kv)


def test_different_second_chunk_returns_first_chunk_only(
    ctx: KVStore,
) -> None:
    """A prefix that diverges in chunk 2 gets chunk 1 only."""
    kv = kv_of(TOKENS)
    ctx.store(kv, TOKENS)
    other = [*TOKENS[:C], 7, *TOKENS[C + 1 :]]
    got = ctx.retrieve(other)
    assert got is not None
    assert np.array_equal(got, kv[:, :, :C])


def test_same_chunk_after_different_prefix_misses(ctx: KVStore) -> None:
    """A chunk's key covers its prefix: chunk 2 after another chunk 1 misses."""
    ctx.store(kv_of(TOKENS), TOKENS)
    assert ctx.retrieve([9, 9, 9, 9, *TOKENS[C:]]) is None


def test_salts_never_share_chunks(ctx: KVStore) -> None:
    """KV stored under one salt is invisible under another."""
    ctx.store(kv_of(TOKENS), TOKENS, cache_salt="alice")
    assert ctx.retrieve(TOKENS, cache_salt="bob") is None
    assert ctx.retrieve(TOKENS) is None
    assert ctx.retrieve(TOKENS, cache_salt="alice") is not None


def test_chunk_sizes_never_share_chunks(ctx: KVStore, stores: StoreFactory) -> None:
    """Handles of one store with different chunk sizes see different keys."""
    ctx.store(kv_of(TOKENS), TOKENS)
    assert stores.connect(ctx.url, chunk_size=2 * C).retrieve(TOKENS) is None


def test_sub_chunk_tail_is_not_stored(ctx: KVStore) -> None:
    """2.5 chunks stored: two chunk files, and retrieve gives two chunks."""
    toks = TOKENS[: 2 * C + C // 2]
    kv = kv_of(toks)
    ctx.store(kv, toks)
    assert ctx.stats().chunks == 2
    got = ctx.retrieve(toks)
    assert got is not None
    assert np.array_equal(got, kv[:, :, : 2 * C])


def test_store_of_less_than_a_chunk_returns_false(ctx: KVStore) -> None:
    """Fewer tokens than a chunk: nothing to write, store returns False."""
    toks = TOKENS[: C - 1]
    assert ctx.store(kv_of(toks), toks) is False
    assert ctx.stats().chunks == 0


def test_store_returns_false_when_every_chunk_exists(
    ctx: KVStore,
) -> None:
    """Storing the same chunks again writes nothing and returns False."""
    assert ctx.store(kv_of(TOKENS), TOKENS) is True
    assert ctx.store(kv_of(TOKENS, seed=1), TOKENS) is False


def test_overwrite_replaces_cached_chunks(ctx: KVStore) -> None:
    """overwrite=True replaces chunks already cached (how same-token edits land)."""
    ctx.store(kv_of(TOKENS), TOKENS)
    edited = kv_of(TOKENS, seed=1)
    assert ctx.store(edited, TOKENS, overwrite=True) is True
    got = ctx.retrieve(TOKENS)
    assert got is not None
    np.testing.assert_array_equal(bits(got), bits(edited[:, :, : got.shape[2]]))


def test_staged_chunks_are_invisible_until_committed(ctx: KVStore) -> None:
    """stage() writes aside: retrieve sees the old KV until commit(), then the new."""
    ctx.store(kv_of(TOKENS), TOKENS)
    edited = kv_of(TOKENS, seed=1)
    staged = pickle.loads(pickle.dumps(ctx.stage(edited, TOKENS)))
    np.testing.assert_array_equal(bits(ctx.retrieve(TOKENS)), bits(kv_of(TOKENS)))
    staged.commit()
    staged.commit()
    np.testing.assert_array_equal(bits(ctx.retrieve(TOKENS)), bits(edited))
    assert staged_names(ctx) == []


def test_discarded_staged_chunks_leave_the_cache_alone(
    ctx: KVStore,
) -> None:
    """discard() removes the staged files; the cached KV is unchanged."""
    ctx.store(kv_of(TOKENS), TOKENS)
    staged = ctx.stage(kv_of(TOKENS, seed=1), TOKENS)
    assert len(staged_names(ctx)) == 3
    staged.discard()
    staged.discard()
    assert staged_names(ctx) == []
    np.testing.assert_array_equal(bits(ctx.retrieve(TOKENS)), bits(kv_of(TOKENS)))


def test_store_writes_only_the_missing_chunks(ctx: KVStore) -> None:
    """Extending a cached prefix writes the new chunks and keeps the old."""
    ctx.store(kv_of(TOKENS[:C]), TOKENS[:C])
    longer = kv_of(TOKENS, seed=1)
    assert ctx.store(longer, TOKENS)
    got = ctx.retrieve(TOKENS)
    assert got is not None
    assert np.array_equal(got[:, :, :C], kv_of(TOKENS[:C])[:, :, :C])
    assert np.array_equal(got[:, :, C:], longer[:, :, C:])
    assert ctx.stats().writes == 3


@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16])
def test_values_round_trip_bit_exactly(ctx: KVStore, dtype: type) -> None:
    """float32, float16 and bfloat16 come back bit for bit (NaN, -0.0, inf too)."""
    kv = kv_of(TOKENS, dtype=dtype)
    kv[0, 0, 0, :3] = np.array([np.nan, -0.0, np.inf]).astype(dtype)
    ctx.store(kv, TOKENS)
    got = ctx.retrieve(TOKENS)
    assert got is not None
    assert got.dtype == np.dtype(dtype)
    assert np.array_equal(bits(got), bits(kv))


def test_big_endian_input_is_stored_as_its_values(ctx: KVStore) -> None:
    """A big-endian float32 KV is stored by value and returned little-endian."""
    kv = kv_of(TOKENS)
    ctx.store(kv.astype(">f4"), TOKENS)
    got = ctx.retrieve(TOKENS)
    assert got is not None
    assert got.dtype == np.dtype("<f4")
    assert np.array_equal(got, kv)


def test_non_contiguous_input_is_stored(ctx: KVStore) -> None:
    """A strided view (every other width column) stores its values."""
    wide = kv_of(TOKENS, width=8)
    kv = wide[:, :, :, ::2]
    ctx.store(kv, TOKENS)
    got = ctx.retrieve(TOKENS)
    assert got is not None
    assert np.array_equal(got, kv)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16])
def test_kv_strided_along_its_tokens_round_trips_bit_exactly(
    ctx: KVStore, dtype: type
) -> None:
    """An edit's view keeping every other token (staged chunk by chunk)
    stores each chunk's own tokens, bit for bit."""
    longer = list(range(500, 500 + 6 * C))
    kv = kv_of(longer, dtype=dtype)[:, :, ::2]
    kept = longer[::2]
    assert ctx.store(kv, kept)
    got = ctx.retrieve(kept)
    assert got is not None
    assert np.array_equal(bits(got), bits(np.ascontiguousarray(kv)))


def test_threads_storing_strided_kvs_at_once_keep_their_own_chunks(
    ctx: KVStore,
) -> None:
    """Eight threads store strided KVs at once; each prefix comes back with
    its own values (each thread stages its chunks apart)."""

    def store(i: int) -> list[int]:
        tokens = list(range(1000 * (i + 1), 1000 * (i + 1) + 8 * C))
        ctx.store(kv_of(tokens)[:, :, ::2], tokens[::2])
        return tokens

    with ThreadPoolExecutor(8) as pool:
        stored = list(pool.map(store, range(8)))
    for tokens in stored:
        got = ctx.retrieve(tokens[::2])
        assert got is not None
        assert np.array_equal(got, kv_of(tokens)[:, :, ::2])


def test_retrieve_returns_a_new_contiguous_array(ctx: KVStore) -> None:
    """Writing into a retrieved array does not change the stored chunks."""
    ctx.store(kv_of(TOKENS), TOKENS)
    first = ctx.retrieve(TOKENS)
    assert first is not None
    assert first.flags.c_contiguous and first.flags.owndata
    first[...] = 0
    again = ctx.retrieve(TOKENS)
    assert again is not None
    assert np.array_equal(again, kv_of(TOKENS))


def test_numpy_int_tokens_hash_like_python_ints(ctx: KVStore) -> None:
    """Tokens as numpy int32/uint16 arrays or np.int64 items match plain ints."""
    ctx.store(kv_of(TOKENS), TOKENS)
    for toks in (
        np.asarray(TOKENS, dtype=np.int32),
        np.asarray(TOKENS, dtype=np.uint16),
        [np.int64(t) for t in TOKENS],
    ):
        assert ctx.retrieve(toks) is not None


def test_negative_token_is_rejected(ctx: KVStore) -> None:
    """A negative token id is a ValueError naming it."""
    with pytest.raises(ValueError, match="-5"):
        ctx.retrieve([1, 2, -5, 3])


def test_non_integer_tokens_are_rejected(ctx: KVStore) -> None:
    """Float token ids are a TypeError, not silently truncated."""
    with pytest.raises(TypeError, match="float64"):
        ctx.store(kv_of(TOKENS), [float(t) for t in TOKENS])  # type: ignore[misc]


def test_non_str_salt_is_rejected(ctx: KVStore) -> None:
    """cache_salt must be a str."""
    with pytest.raises(TypeError, match="cache_salt"):
        ctx.retrieve(TOKENS, cache_salt=b"x")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("layers", "width", "dtype"),
    [(3, 4, np.float32), (2, 5, np.float32), (2, 4, np.float16)],
)
def test_layout_mismatch_raises_naming_both(
    ctx: KVStore, layers: int, width: int, dtype: type
) -> None:
    """A KV whose layers, width or dtype differ from the store's is refused."""
    ctx.store(kv_of(TOKENS), TOKENS)
    with pytest.raises(KVConfigError) as err:
        ctx.store(kv_of(TOKENS, layers, width, dtype), TOKENS)
    message = str(err.value)
    assert "layers=2, width=4, dtype=float32" in message
    assert f"layers={layers}, width={width}, dtype={np.dtype(dtype).name}" in message


def test_layout_is_shared_by_every_handle(ctx: KVStore, stores: StoreFactory) -> None:
    """The first store fixes the layout for other handles of the store too."""
    first, second = ctx, stores.connect(ctx.url, chunk_size=C)
    assert second.layout is None
    first.store(kv_of(TOKENS), TOKENS)
    assert second.layout == Layout(2, 4, np.dtype(np.float32), planes=2)
    with pytest.raises(KVConfigError):
        second.store(kv_of(TOKENS, dtype=np.float16), TOKENS)


def test_layout_given_at_connect_is_enforced(
    store_url: str, stores: StoreFactory
) -> None:
    """connect(layers, width, dtype) fixes the layout before any store."""
    ctx = stores.connect(store_url, chunk_size=C, layers=2, width=4, dtype="bfloat16")
    assert ctx.layout == Layout(2, 4, np.dtype(ml_dtypes.bfloat16), planes=2)
    with pytest.raises(KVConfigError, match="bfloat16"):
        ctx.store(kv_of(TOKENS), TOKENS)


def test_connect_with_other_layout_than_the_named_store_raises(
    store_url: str, stores: StoreFactory
) -> None:
    """Opening a named store with a different layout is a KVConfigError."""
    stores.connect(store_url, layers=2, width=4, dtype="float16")
    with pytest.raises(KVConfigError, match="float16"):
        stores.connect(store_url, layers=2, width=4, dtype="float32")


def test_partial_layout_at_connect_raises(stores: StoreFactory) -> None:
    """layers, width and dtype are given together or not at all."""
    with pytest.raises(KVConfigError, match="width, dtype"):
        stores.connect(layers=2)


@pytest.mark.parametrize("dtype", [np.float64, np.int32, np.complex64])
def test_unsupported_dtype_raises(ctx: KVStore, dtype: type) -> None:
    """Only float32, float16 and bfloat16 KV can be stored."""
    with pytest.raises(KVConfigError, match=np.dtype(dtype).name):
        ctx.store(kv_of(TOKENS).astype(dtype), TOKENS)


def test_axis_2_length_must_match_tokens(ctx: KVStore) -> None:
    """A KV with more tokens on axis 2 than token ids is refused."""
    with pytest.raises(KVConfigError, match=f"with {len(TOKENS) - 1} tokens"):
        ctx.store(kv_of(TOKENS), TOKENS[:-1])


@pytest.mark.parametrize("shape", [(2, 2, 12), (3, 2, 12, 4), (2, 2, 12, 4, 1)])
def test_kv_must_be_2_l_t_d(ctx: KVStore, shape: tuple[int, ...]) -> None:
    """A KV that is not 4-D with K/V on axis 0 is refused."""
    with pytest.raises(KVConfigError, match="expected 4-D"):
        ctx.store(np.zeros(shape, np.float32), TOKENS)


@pytest.mark.parametrize("url", ["rediss://localhost:6379", "foo://x", "mystore"])
def test_unknown_scheme_lists_supported_ones(url: str) -> None:
    """An unknown or missing scheme names itself and the supported schemes."""
    with pytest.raises(KVConfigError) as err:
        _connect.connect(url)
    assert url in str(err.value)
    for scheme in ("shm://", "file://", "redis://"):
        assert scheme in str(err.value)


@pytest.mark.parametrize(
    "url", ["shm:///", "shm:///a/b", "shm:///.hidden", "shm:///x?y"]
)
def test_malformed_shm_url_raises(url: str) -> None:
    """A shm:// URL needs one plain name."""
    with pytest.raises(KVConfigError, match="shm:///NAME"):
        _connect.connect(url)


@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_chunk_size_must_be_a_positive_int(bad: object) -> None:
    """chunk_size 0, negative, float or bool is a KVConfigError."""
    with pytest.raises(KVConfigError, match="chunk_size"):
        _connect.connect(chunk_size=bad)  # type: ignore[arg-type]


def test_named_store_is_shared_by_name(store_url: str, stores: StoreFactory) -> None:
    """Two handles of one URL (shm:///NAME, redis://...) read each other's chunks."""
    writer = stores.connect(store_url, chunk_size=C)
    reader = stores.connect(store_url, chunk_size=C)
    assert writer.url == reader.url == store_url
    writer.store(kv_of(TOKENS), TOKENS)
    got = reader.retrieve(TOKENS)
    assert got is not None
    assert np.array_equal(got, kv_of(TOKENS))


def test_file_scheme_uses_the_given_directory(
    stores: StoreFactory, tmp_path: os.PathLike[str]
) -> None:
    """file:///PATH keeps the chunks in that directory."""
    path = os.path.join(tmp_path, "kv")
    ctx = stores.connect(f"file://{path}", chunk_size=C)
    ctx.store(kv_of(TOKENS), TOKENS)
    assert ctx.path == path and ctx.url == f"file://{path}"
    assert len(chunk_paths(ctx)) == 3


def test_falls_back_to_tempdir_without_dev_shm(
    stores: StoreFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where /dev/shm is not writable, stores live in the temp directory."""
    real_access = os.access
    monkeypatch.setattr(
        os, "access", lambda path, mode: path != "/dev/shm" and real_access(path, mode)
    )
    ctx = stores.connect()
    assert os.path.dirname(ctx.path) == tempfile.gettempdir()


def test_stats_count_this_handles_work(ctx: KVStore) -> None:
    """stats() counts the store's chunks/bytes, its capacity and this handle's hits/misses/writes."""
    ctx.store(kv_of(TOKENS), TOKENS)
    ctx.retrieve(TOKENS)  # 3 hits
    ctx.retrieve([*TOKENS[:C], 0, 0, 0, 0])  # 1 hit, 1 miss
    ctx.retrieve([0] * C)  # 1 miss
    payload = 2 * 2 * C * 4 * 4
    stats = ctx.stats()
    assert stats == StoreStats(
        chunks=3,
        bytes=3 * (HEADER_SIZE + payload),
        hits=4,
        misses=2,
        evictions=0,
        writes=3,
        corrupt=0,
        capacity_bytes=ctx.capacity_bytes,
        free_bytes=stats.free_bytes,
    )


def test_least_recently_used_chunk_is_evicted(stores: StoreFactory) -> None:
    """Over capacity, the oldest untouched chunk goes; a retrieved one stays."""
    chunk_bytes = HEADER_SIZE + 2 * 2 * C * 4 * 4
    ctx = stores.connect(chunk_size=C, capacity_bytes=3 * chunk_bytes)
    a, b, c, d = ([n] * C for n in (1, 2, 3, 4))
    for toks in (a, b, c):
        ctx.store(kv_of(toks), toks)
    assert ctx.retrieve(a) is not None
    ctx.store(kv_of(d), d)
    assert ctx.retrieve(b) is None
    assert all(ctx.retrieve(t) is not None for t in (a, c, d))
    stats = ctx.stats()
    assert (stats.chunks, stats.evictions) == (3, 1)


def test_a_store_that_cannot_fit_stores_nothing(stores: StoreFactory) -> None:
    """A store whose chunks do not fit even after eviction raises
    KVCapacityError at once, naming bytes asked and allowed, and writes no
    chunk of it (nothing dropped silently)."""
    chunk_bytes = HEADER_SIZE + 2 * 2 * C * 4 * 4
    ctx = stores.connect(chunk_size=C, capacity_bytes=2 * chunk_bytes)
    with pytest.raises(KVCapacityError, match="capacity_bytes") as info:
        ctx.store(kv_of(TOKENS), TOKENS)
    assert (info.value.asked, info.value.allowed) == (3 * chunk_bytes, 2 * chunk_bytes)
    assert ctx.retrieve(TOKENS) is None and ctx.stats().chunks == 0


def test_chunk_larger_than_capacity_is_not_stored(stores: StoreFactory) -> None:
    """A chunk bigger than the whole capacity: KVCapacityError, nothing stored."""
    ctx = stores.connect(chunk_size=C, capacity_bytes=100)
    with pytest.raises(KVCapacityError, match="capacity is 100 bytes"):
        ctx.store(kv_of(TOKENS), TOKENS)
    assert ctx.stats().chunks == 0


def _flip_payload_byte(data: bytes) -> bytes:
    flipped = bytearray(data)
    flipped[HEADER_SIZE + 5] ^= 0x01
    return bytes(flipped)


def _truncate(data: bytes) -> bytes:
    return data[:-1]


def _bad_magic(data: bytes) -> bytes:
    return b"NOTACHNK" + data[8:]


@pytest.mark.parametrize("damage", [_flip_payload_byte, _truncate, _bad_magic])
def test_corrupt_chunk_is_a_warned_miss(
    ctx: KVStore, damage: Callable[[bytes], bytes]
) -> None:
    """Each damaged chunk warns, ends the prefix, is removed and re-stored."""
    ctx.store(kv_of(TOKENS), TOKENS)
    raw = RawChunks(ctx, TOKENS)
    for index in (2, 0, 1):
        data = raw.get(index)
        assert data is not None
        raw.put(index, damage(data))
        with pytest.warns(CorruptChunkWarning, match="corrupt chunk"):
            got = ctx.retrieve(TOKENS)
        assert got is None or got.shape[2] == index * C
        assert raw.get(index) is None
        assert ctx.store(kv_of(TOKENS), TOKENS)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = ctx.retrieve(TOKENS)
    assert got is not None and np.array_equal(got, kv_of(TOKENS))
    assert ctx.stats().corrupt == 3


def test_destroy_removes_the_directory_and_is_idempotent(
    stores: StoreFactory,
) -> None:
    """destroy() removes a named store; a second destroy() is a no-op."""
    ctx = stores.named(chunk_size=C)
    ctx.store(kv_of(TOKENS), TOKENS)
    ctx.destroy()
    assert not os.path.exists(ctx.path)
    ctx.destroy()


def test_destroy_of_a_store_already_gone_is_safe(stores: StoreFactory) -> None:
    """destroy() on a handle whose directory another handle removed is fine."""
    url = unique_url()
    first, second = stores.connect(url), stores.connect(url)
    first.destroy()
    second.destroy()
    assert not os.path.exists(second.path)


def test_closing_the_owner_removes_a_temporary_store(stores: StoreFactory) -> None:
    """close() of the connect() owner removes its directory; twice is fine."""
    ctx = stores.connect(chunk_size=C)
    ctx.store(kv_of(TOKENS), TOKENS)
    ctx.close()
    assert not os.path.exists(ctx.path)
    ctx.close()


def test_with_block_removes_a_temporary_store(stores: StoreFactory) -> None:
    """Leaving ``with connect() as ctx`` removes the store."""
    with stores.connect(chunk_size=C) as ctx:
        ctx.store(kv_of(TOKENS), TOKENS)
        assert os.path.isdir(ctx.path)
    assert not os.path.exists(ctx.path)


def test_garbage_collecting_the_owner_removes_the_store() -> None:
    """Dropping the last reference to a connect() store removes it."""
    ctx = _connect.connect(chunk_size=C)
    path = ctx.path
    del ctx
    gc.collect()
    assert not os.path.exists(path)


def test_closing_a_named_store_keeps_it(ctx: KVStore, stores: StoreFactory) -> None:
    """close() of a named store keeps the chunks for the next opener."""
    ctx.store(kv_of(TOKENS), TOKENS)
    ctx.close()
    again = stores.connect(ctx.url, chunk_size=C)
    assert again.retrieve(TOKENS) is not None


def test_a_closed_store_refuses_use(ctx: KVStore) -> None:
    """retrieve/store/stats on a closed handle raise KVStoreError."""
    ctx.close()
    with pytest.raises(KVStoreError, match="closed"):
        ctx.retrieve(TOKENS)
    with pytest.raises(KVStoreError, match="closed"):
        ctx.store(kv_of(TOKENS), TOKENS)
    with pytest.raises(KVStoreError, match="closed"):
        ctx.stats()


def test_pickle_holds_the_location_only(ctx: KVStore) -> None:
    """A pickled store carries no KV data and reconnects to the same chunks."""
    big = list(range(64 * C))
    ctx.store(kv_of(big, width=64), big)
    blob = pickle.dumps(ctx)
    assert len(blob) < 1000
    copy = pickle.loads(blob)
    assert (type(copy), copy.url, copy.chunk_size) == (type(ctx), ctx.url, C)
    assert copy.capacity_bytes == ctx.capacity_bytes
    got = copy.retrieve(big)
    assert got is not None and got.shape[2] == len(big)
    assert copy.stats().hits == 64


def test_closing_an_unpickled_copy_keeps_the_store(ctx: KVStore) -> None:
    """An unpickled copy does not own the directory: its close() keeps it."""
    ctx.store(kv_of(TOKENS), TOKENS)
    copy = pickle.loads(pickle.dumps(ctx))
    copy.close()
    del copy
    gc.collect()
    assert ctx.retrieve(TOKENS) is not None


def test_store_is_removed_at_interpreter_exit() -> None:
    """A connect() store left open is removed when the interpreter exits."""
    script = (
        "import numpy as np, lmcache_mp.kv as kv\n"
        "ctx = kv.connect(chunk_size=4)\n"
        "ctx.store(np.ones((2, 1, 8, 2), np.float32), list(range(8)))\n"
        "print(ctx.path, flush=True)\n"
    )
    done = run_python(script, timeout=60)
    path = done.stdout.strip()
    assert done.returncode == 0, done.stderr
    assert "lmcache" in path
    assert not os.path.exists(path)


def test_short_writes_are_resumed(
    shm_ctx: SharedMemoryKVStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunks survive pwrite moving at most 7 bytes a call."""
    real_pwrite = os.pwrite
    monkeypatch.setattr(
        os, "pwrite", lambda fd, data, offset: real_pwrite(fd, data[:7], offset)
    )
    kv = kv_of(TOKENS, layers=3)
    shm_ctx.store(kv, TOKENS)
    got = shm_ctx.retrieve(TOKENS)
    assert got is not None and np.array_equal(got, kv)


def test_a_write_that_moves_nothing_fails_the_store_and_leaves_no_file(
    shm_ctx: SharedMemoryKVStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pwrite that writes 0 bytes is an error naming the chunk; no temp
    file or chunk is left."""
    monkeypatch.setattr(os, "pwrite", lambda fd, data, offset: 0)
    with pytest.raises(KVStoreError, match="short write"):
        shm_ctx.store(kv_of(TOKENS), TOKENS)
    monkeypatch.undo()
    assert shm_ctx.retrieve(TOKENS) is None
    assert os.listdir(shm_ctx.path) == ["layout.json"]


def test_threads_share_one_handle(ctx: KVStore, stores: StoreFactory) -> None:
    """Threads storing and retrieving through one lazily opened handle agree."""
    copy = stores.track(pickle.loads(pickle.dumps(ctx)))

    def work(n: int) -> bool:
        toks = [n] * (3 * C)
        copy.store(kv_of(toks, seed=n), toks)
        got = copy.retrieve(toks)
        return got is not None and np.array_equal(got, kv_of(toks, seed=n))

    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(work, range(32), timeout=60))
    assert copy.stats().writes == 32 * 3


def test_unpickled_copy_of_a_destroyed_store_raises(
    shm_ctx: SharedMemoryKVStore,
) -> None:
    """A copy reconnecting after the store was destroyed gets KVStoreError."""
    copy = pickle.loads(pickle.dumps(shm_ctx))
    shm_ctx.destroy()
    with pytest.raises(KVStoreError, match="does not exist"):
        copy.retrieve(TOKENS)


def test_sweep_removes_temp_files_of_dead_writers(shm_ctx: SharedMemoryKVStore) -> None:
    """sweep() removes what a dead writer left (a staged edit never committed)."""
    ctx = shm_ctx
    ctx.store(kv_of(TOKENS), TOKENS)
    staged = ctx.stage(kv_of(TOKENS, seed=1), TOKENS)
    for tmp, _ in staged.moves:  # pretend the writer (this pid) has died
        os.rename(
            os.path.join(ctx.path, tmp),
            os.path.join(ctx.path, ".tmp-999999999-x" + tmp[-4:]),
        )
    assert ctx.sweep() == 3
    assert temp_names(ctx) == []
    np.testing.assert_array_equal(bits(ctx.retrieve(TOKENS)), bits(kv_of(TOKENS)))


def _stage_for(ctx: SharedMemoryKVStore, owner: PinOwner) -> StagedChunks:
    """Stage an edit of TOKENS for ``owner``'s batch, in a worker process."""
    with pinning(owner, "s"):
        return ctx.stage(kv_of(TOKENS, seed=1), TOKENS)


def test_a_staged_edit_outlives_its_writer(shm_ctx: SharedMemoryKVStore) -> None:
    """An edit staged for this process's batch by a worker that has exited
    survives the store being opened (and swept) by another process, and
    commits."""
    ctx = shm_ctx
    ctx.store(kv_of(TOKENS), TOKENS)
    with spawned_pool(1) as pool:
        staged = pool.apply(_stage_for, (ctx, PinOwner.new()))
    result = run_python(
        "from lmcache_mp.kv import connect\n"
        f"print(connect({ctx.url!r}, chunk_size={C}).sweep())"
    )
    assert result.returncode == 0 and result.stdout.split() == ["0"], result.stderr
    staged.commit()
    np.testing.assert_array_equal(
        bits(ctx.retrieve(TOKENS)), bits(kv_of(TOKENS, seed=1))
    )


def test_a_sweep_for_a_batch_drops_only_its_staging(
    shm_ctx: SharedMemoryKVStore,
) -> None:
    """sweep(owner) removes the staged chunks of that batch, not another's."""
    ctx = shm_ctx
    ctx.store(kv_of(TOKENS), TOKENS)
    mine, other = PinOwner.new(), PinOwner.new()
    _stage_for(ctx, mine)
    kept = _stage_for(ctx, other)
    assert ctx.sweep(mine) == 3
    assert sorted(staged_names(ctx)) == sorted(tmp for tmp, _ in kept.moves)
    kept.commit()
    np.testing.assert_array_equal(
        bits(ctx.retrieve(TOKENS)), bits(kv_of(TOKENS, seed=1))
    )


@pytest.mark.parametrize("lease", ["dead pid", "reused pid"])
def test_staging_of_a_gone_publisher_is_swept(
    shm_ctx: SharedMemoryKVStore, lease: str
) -> None:
    """A staged chunk whose publisher is gone (its pid, or a pid now another
    process's) is removed by sweep(), whatever its age."""
    ctx = shm_ctx
    ctx.store(kv_of(TOKENS), TOKENS)
    gone = PinOwner("b" * 32, 999_999_999, 1)
    if lease == "reused pid":
        gone = PinOwner("b" * 32, os.getpid(), 1)
    _stage_for(ctx, gone)
    assert ctx.sweep() == 3
    assert staged_names(ctx) == []


def test_a_commit_whose_staging_is_gone_keeps_the_old_kv(
    shm_ctx: SharedMemoryKVStore,
) -> None:
    """One staged chunk removed behind its back: commit() raises KVStoreError,
    publishes none of the others, and drops them."""
    ctx = shm_ctx
    ctx.store(kv_of(TOKENS), TOKENS)
    staged = ctx.stage(kv_of(TOKENS, seed=1), TOKENS)
    os.unlink(os.path.join(ctx.path, staged.moves[1][0]))
    with pytest.raises(KVStoreError, match="1 of 3 staged chunks are gone"):
        staged.commit()
    np.testing.assert_array_equal(bits(ctx.retrieve(TOKENS)), bits(kv_of(TOKENS)))
    assert staged_names(ctx) == []


def test_free_bytes_never_exceed_the_filesystems_free_space(
    stores: StoreFactory,
) -> None:
    """A capacity larger than the filesystem: ``stats().free_bytes`` is the
    filesystem's free space, not what the capacity would allow."""
    kv = stores.connect(capacity_bytes=1 << 60)
    fs = os.statvfs(kv.path)
    assert 0 < kv.stats().free_bytes <= fs.f_bavail * fs.f_frsize + (64 << 20)


def _full_once(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Make the next chunk write fail with ENOSPC, as a full tmpfs does;
    return the list that counts the failures."""
    import errno

    import lmcache_mp.kv._chunk as chunk_module

    put = chunk_module._put
    failures: list[int] = []

    def full_once(*args: object) -> None:
        if not failures:
            failures.append(1)
            raise OSError(errno.ENOSPC, "No space left on device")
        put(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(chunk_module, "_put", full_once)
    return failures


def test_a_full_filesystem_evicts_unpinned_chunks_before_it_fails(
    stores: StoreFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ENOSPC below the capacity: the store evicts its least recently used
    unpinned chunk, writes the new one, and counts the eviction."""
    kv = stores.connect(chunk_size=4)
    old, new = [1, 2, 3, 4], [5, 6, 7, 8]
    kv.store(np.ones((2, 1, 4, 2), np.float32), old)
    failures = _full_once(monkeypatch)
    kv.store(np.full((2, 1, 4, 2), 2.0, np.float32), new)
    assert failures == [1]
    assert kv.retrieve(old) is None
    got = kv.retrieve(new)
    assert got is not None and (got == 2.0).all()
    assert kv.stats().evictions == 1


def test_a_full_filesystem_never_evicts_a_pinned_chunk(
    stores: StoreFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ENOSPC when every other chunk is pinned: the write fails with a
    ``KVStoreError`` naming the cause, and the pinned chunk stays."""
    kv = stores.connect(chunk_size=4)
    old, new = [1, 2, 3, 4], [5, 6, 7, 8]
    owner = PinOwner.new()
    with pinning(owner, "kept"):
        kv.store(np.ones((2, 1, 4, 2), np.float32), old)
    _full_once(monkeypatch)
    try:
        with pytest.raises(KVStoreError, match="No space left"):
            kv.store(np.ones((2, 1, 4, 2), np.float32), new)
        assert kv.retrieve(old) is not None
    finally:
        kv.unpin(owner)


def test_a_full_filesystem_evicts_an_unpinned_chunk_to_pin(
    stores: StoreFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ENOSPC while a batch pins its streams: the store gives back the pages
    of its least recently used unpinned chunk, pins once more, and leaves
    no half-written pin behind."""
    import errno

    kv = stores.connect(chunk_size=4)
    old, new = [1, 2, 3, 4], [5, 6, 7, 8]
    kv.store(np.ones((2, 1, 4, 2), np.float32), old)
    kv.store(np.ones((2, 1, 4, 2), np.float32), new)
    os.utime(RawChunks(kv, old)._name(0), ns=(1, 1))  # the least recent
    fdopen = os.fdopen
    failures: list[int] = []

    class Full:
        def __init__(self, fh: object) -> None:
            self._fh = fh

        def __enter__(self) -> Full:
            return self

        def __exit__(self, *exc: object) -> None:
            self._fh.close()  # type: ignore[attr-defined]

        def write(self, text: str) -> int:
            failures.append(1)
            raise OSError(errno.ENOSPC, "No space left on device")

    def full_once(fd: int, *args: object, **kwargs: object) -> object:
        fh = fdopen(fd, *args, **kwargs)  # type: ignore[call-overload]
        return fh if failures else Full(fh)

    monkeypatch.setattr(os, "fdopen", full_once)
    owner = PinOwner.new()
    kv.pin(owner, "s", new)
    monkeypatch.undo()
    try:
        assert failures == [1]
        assert kv.retrieve(old) is None
        assert kv.retrieve(new) is not None
        assert not [p for p in os.listdir(kv.path) if p.startswith("tmp-")]
        assert kv.stats().pinned_bytes == kv.stats().bytes > 0
    finally:
        kv.unpin(owner)
