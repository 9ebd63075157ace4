"""The shared-memory store's arena: chunk-file pages allocated before the
store needs them, which its writes then fill."""

from __future__ import annotations

import os
from typing import Any

import pytest

from lmcache_mp.cache_kind import LMCacheSDKCacheKind
from lmcache_mp.errors import KVCapacityError, KVConfigError
from lmcache_mp.kv import SharedMemoryKVStore, connect
from lmcache_mp.kv._chunk import HEADER_SIZE
from lmcache_mp.kv._files import CHUNK_SUFFIX, FREE_PREFIX
from tests._fakes import LAYERS, WIDTH, kv_for
from tests._store_util import StoreFactory, unique_url

C = 4
CHUNK = HEADER_SIZE + 2 * LAYERS * C * WIDTH * 4
LAYOUT: dict[str, Any] = {"layers": LAYERS, "width": WIDTH, "dtype": "float32"}


def _inodes(ctx: SharedMemoryKVStore, prefix: str = "", suffix: str = "") -> set[int]:
    """The inodes of the store's files named ``prefix...suffix``."""
    return {
        os.stat(os.path.join(ctx.path, name)).st_ino
        for name in os.listdir(ctx.path)
        if name.startswith(prefix) and name.endswith(suffix)
    }


def _store(ctx: SharedMemoryKVStore, first: int, chunks: int = 1) -> None:
    tokens = list(range(first, first + chunks * C))
    ctx.store(kv_for(tokens), tokens)


def test_an_arena_is_allocated_as_the_layout_is_fixed(stores: StoreFactory) -> None:
    """A store connected with its layout and an arena holds that many bytes
    of free chunk files at once, counted as used."""
    ctx = stores.connect(chunk_size=C, arena_bytes=3 * CHUNK + 1, **LAYOUT)
    sizes = [
        os.path.getsize(os.path.join(ctx.path, name))
        for name in os.listdir(ctx.path)
        if name.startswith(FREE_PREFIX)
    ]
    assert sizes == [CHUNK] * 3
    stats = ctx.stats()
    assert (stats.chunks, stats.free_bytes) == (0, ctx.capacity_bytes - 3 * CHUNK)


def test_stores_write_into_the_arenas_files(stores: StoreFactory) -> None:
    """Chunks stored after the arena is allocated are its files, rewritten
    and renamed: no new file is allocated while the arena lasts."""
    ctx = stores.connect(chunk_size=C, arena_bytes=3 * CHUNK, **LAYOUT)
    arena = _inodes(ctx, prefix=FREE_PREFIX)
    _store(ctx, 100, chunks=2)
    assert _inodes(ctx, suffix=CHUNK_SUFFIX) <= arena
    assert len(_inodes(ctx, prefix=FREE_PREFIX)) == 1
    tokens = list(range(100, 100 + 2 * C))
    assert (ctx.retrieve(tokens) == kv_for(tokens)).all()


def test_without_a_layout_the_first_store_allocates_the_arena(
    stores: StoreFactory,
) -> None:
    """A store whose layout the first store fixes allocates its arena then,
    and that store already fills one of its files."""
    ctx = stores.connect(chunk_size=C, arena_bytes=3 * CHUNK)
    assert not _inodes(ctx, prefix=FREE_PREFIX)
    _store(ctx, 100)
    assert len(_inodes(ctx, prefix=FREE_PREFIX)) == 2
    assert ctx.stats().free_bytes == ctx.capacity_bytes - 3 * CHUNK


def test_reopening_a_named_store_keeps_its_arena_size(stores: StoreFactory) -> None:
    """A second handle on a named store asking for the same arena finds it
    there and allocates nothing more."""
    url = unique_url()
    stores.connect(url, chunk_size=C, arena_bytes=2 * CHUNK, **LAYOUT)
    again = stores.connect(url, chunk_size=C, arena_bytes=2 * CHUNK, **LAYOUT)
    assert len(_inodes(again, prefix=FREE_PREFIX)) == 2


def test_an_arena_past_what_is_stored_is_a_capacity_error(
    stores: StoreFactory,
) -> None:
    """An arena that does not fit besides the chunks already stored fails
    with KVCapacityError naming the store; it evicts no chunk for its
    files, and allocates nothing."""
    url = unique_url()
    first = stores.connect(url, chunk_size=C, capacity_bytes=3 * CHUNK, **LAYOUT)
    _store(first, 100, chunks=3)
    with pytest.raises(KVCapacityError, match=f"store {url}: an arena of") as info:
        connect(
            url, chunk_size=C, capacity_bytes=3 * CHUNK, arena_bytes=CHUNK, **LAYOUT
        )
    assert info.value.asked == CHUNK and info.value.allowed == 3 * CHUNK
    assert not _inodes(first, prefix=FREE_PREFIX)
    assert first.stats().chunks == 3


@pytest.mark.parametrize(
    ("arena", "needle"),
    [
        (-1, r"arena_bytes must be in \[0, capacity_bytes = 1000\], got -1"),
        (1001, r"arena_bytes must be in \[0, capacity_bytes = 1000\], got 1001"),
        (True, "arena_bytes must be an int >= 0, got True"),
        (1.5, "arena_bytes must be an int >= 0, got 1.5"),
    ],
)
def test_a_bad_arena_is_a_config_error(arena: Any, needle: str) -> None:
    """An arena that is not an int in [0, capacity] is refused, named."""
    with pytest.raises(KVConfigError, match=needle):
        connect(capacity_bytes=1000, arena_bytes=arena)


@pytest.mark.parametrize(
    ("url", "kind", "needle"),
    [
        ("redis://localhost:1/0", LMCacheSDKCacheKind.KV, "Redis server allocates"),
        (None, LMCacheSDKCacheKind.QUERY, "arena_bytes is for the KV namespace"),
    ],
)
def test_an_arena_is_the_shared_memory_kv_stores_only(
    url: str | None, kind: LMCacheSDKCacheKind, needle: str
) -> None:
    """Redis allocates its own memory, and a QUERY namespace is opened from
    a KV store: both refuse an arena, saying so."""
    with pytest.raises(KVConfigError, match=needle):
        connect(url, arena_bytes=1 << 20, kind=kind)
