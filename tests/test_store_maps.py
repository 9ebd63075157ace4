"""A store's arena kept mapped in each process that uses it: reads and
writes go through mappings made once, and a removed store's pages are freed
even where an idle process still maps them."""

from __future__ import annotations

import multiprocessing
import os
import pickle
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from lmcache_mp.bench._monitor import _shmem_kib
from lmcache_mp.errors import KVConfigError
from lmcache_mp.kv import SharedMemoryKVStore, _buffers
from lmcache_mp.kv import _arena as _maps
from lmcache_mp.kv._chunk import HEADER_SIZE, decode_chunk
from lmcache_mp.kv._files import (
    CHUNK_SUFFIX,
    FREE_PREFIX,
    TEMP_PREFIX,
    punch,
    remove_free,
)
from lmcache_mp.kv._layout import LAYOUT_FILE, load_layout
from tests._fakes import LAYERS, WIDTH, kv_for
from tests._store_util import StoreFactory, address, pooled, spawned_pool

C = 4
CHUNK = HEADER_SIZE + 2 * LAYERS * C * WIDTH * 4
LAYOUT: dict[str, Any] = {"layers": LAYERS, "width": WIDTH, "dtype": "float32"}
TOKENS = list(range(100, 100 + 2 * C))
JOIN_TIMEOUT_S = 60


@pytest.fixture
def worker() -> Iterator[multiprocessing.pool.Pool]:
    """One spawned worker process, kept for the whole test."""
    with spawned_pool(1) as pool:
        yield pool


def _files(ctx: SharedMemoryKVStore) -> list[os.stat_result]:
    """The stats of the store's chunk and free files."""
    return [
        os.stat(os.path.join(ctx.path, name))
        for name in os.listdir(ctx.path)
        if name.endswith(CHUNK_SUFFIX) or name.startswith(FREE_PREFIX)
    ]


def _retrieve_and_pid(ctx: SharedMemoryKVStore, tokens: list[int]) -> tuple[Any, int]:
    return ctx.retrieve(tokens), os.getpid()


def _overwrite(ctx: SharedMemoryKVStore, tokens: list[int]) -> bool:
    return ctx.store(kv_for(tokens) + 1, tokens, overwrite=True)


def test_a_store_with_an_arena_keeps_all_its_files_mapped(
    stores: StoreFactory,
) -> None:
    """Once a process has used a store with an arena, every chunk and free
    file of it has a kept mapping of its size."""
    ctx = stores.connect(chunk_size=C, arena_bytes=4 * CHUNK, **LAYOUT)
    ctx.store(kv_for(TOKENS), TOKENS)
    files = _files(ctx)
    assert len(files) == 4
    assert all(_maps.kept(st) is not None for st in files)


def test_a_store_without_an_arena_keeps_no_mapping(stores: StoreFactory) -> None:
    """A store with no free file is read and written as before, through
    mappings made for one copy."""
    ctx = stores.connect(chunk_size=C, **LAYOUT)
    ctx.store(kv_for(TOKENS), TOKENS)
    assert (ctx.retrieve(TOKENS) == kv_for(TOKENS)).all()
    files = _files(ctx)
    assert files and all(_maps.kept(st) is None for st in files)


def test_writes_through_a_kept_mapping_land_in_the_file(
    stores: StoreFactory,
) -> None:
    """A chunk written through its kept mapping is whole in the file: read
    back with plain ``read``, it decodes and checks against its key."""
    ctx = stores.connect(chunk_size=C, arena_bytes=4 * CHUNK, **LAYOUT)
    ctx.store(kv_for(TOKENS), TOKENS)
    names = sorted(n for n in os.listdir(ctx.path) if n.endswith(CHUNK_SUFFIX))
    assert len(names) == 2
    for name in names:
        st = os.stat(os.path.join(ctx.path, name))
        assert _maps.kept(st) is not None
        with open(os.path.join(ctx.path, name), "rb") as file:
            data = file.read()
        assert ctx.layout is not None
        key = bytes.fromhex(name.removesuffix(CHUNK_SUFFIX))
        decode_chunk(data, key, ctx.layout, C)  # raises on a bad digest


def test_a_kept_mapping_reads_what_another_process_rewrote(
    stores: StoreFactory, worker: multiprocessing.pool.Pool
) -> None:
    """A chunk another process overwrites (into a recycled arena file) is
    read new through this process's kept mappings."""
    ctx = stores.connect(chunk_size=C, arena_bytes=6 * CHUNK, **LAYOUT)
    ctx.store(kv_for(TOKENS), TOKENS)
    assert (ctx.retrieve(TOKENS) == kv_for(TOKENS)).all()
    assert worker.apply_async(_overwrite, (ctx, TOKENS)).get(JOIN_TIMEOUT_S)
    assert all(_maps.kept(st) is not None for st in _files(ctx))
    assert (ctx.retrieve(TOKENS) == kv_for(TOKENS) + 1).all()


def test_a_removed_store_frees_the_pages_an_idle_process_keeps_mapped(
    stores: StoreFactory, worker: multiprocessing.pool.Pool
) -> None:
    """Destroying a store empties its files first: a process that keeps
    its arena mapped and does nothing more holds none of its memory."""
    # Chunks of 1 MiB, so that the pages measured are the arena's.
    kv = np.ones((2, 2, len(TOKENS), 1 << 14), np.float32)
    arena = 16 << 20
    ctx = stores.connect(
        chunk_size=C, arena_bytes=arena, layers=2, width=1 << 14, dtype="float32"
    )
    ctx.store(kv, TOKENS)
    got, pid = worker.apply_async(_retrieve_and_pid, (ctx, TOKENS)).get(JOIN_TIMEOUT_S)
    assert (got == kv).all()
    assert _shmem_kib(pid) << 10 >= arena // 2
    ctx.destroy()
    assert _shmem_kib(pid) << 10 < 1 << 20


def test_the_mappings_of_a_removed_store_are_dropped_at_the_next_call(
    stores: StoreFactory,
) -> None:
    """A process's next call on any store forgets the mappings of stores
    removed since."""
    old = stores.connect(chunk_size=C, arena_bytes=4 * CHUNK, **LAYOUT)
    old.store(kv_for(TOKENS), TOKENS)
    files = _files(old)
    assert all(_maps.kept(st) is not None for st in files)
    old.destroy()
    new = stores.connect(chunk_size=C, arena_bytes=4 * CHUNK, **LAYOUT)
    new.store(kv_for(TOKENS), TOKENS)
    assert all(_maps.kept(st) is None for st in files)
    assert all(_maps.kept(st) is not None for st in _files(new))


def test_punching_a_file_frees_its_pages_under_a_mapping(
    stores: StoreFactory,
) -> None:
    """``punch`` keeps the file and its size but frees its pages, and a
    mapping of it then reads zeros."""
    ctx = stores.connect(chunk_size=C, arena_bytes=CHUNK, **LAYOUT)
    ctx.store(kv_for(TOKENS[:C]), TOKENS[:C])
    (name,) = (n for n in os.listdir(ctx.path) if n.endswith(CHUNK_SUFFIX))
    path = os.path.join(ctx.path, name)
    mapped = _maps.kept(os.stat(path))
    assert mapped is not None and any(mapped[:HEADER_SIZE])
    fd = os.open(ctx.path, os.O_RDONLY)
    try:
        punch(fd, name)
    finally:
        os.close(fd)
    st = os.stat(path)
    assert (st.st_size, st.st_blocks) == (CHUNK, 0)
    assert not np.frombuffer(mapped, np.uint8).any()


def test_a_stale_temp_name_of_a_live_file_leaves_its_pages(
    stores: StoreFactory,
) -> None:
    """A temp name that a writer killed between ``os.link`` and ``unlink``
    left on the store's layout is swept, and the layout keeps its bytes
    (a new handle reads the store): only a file's last name is emptied."""
    ctx = stores.connect(chunk_size=C, **LAYOUT)
    ctx.store(kv_for(TOKENS[:C]), TOKENS[:C])
    # Not a pid: its writer counts as dead.
    stale = f"{TEMP_PREFIX}dead-0"
    os.link(os.path.join(ctx.path, LAYOUT_FILE), os.path.join(ctx.path, stale))
    assert ctx.sweep() == 1
    assert stale not in os.listdir(ctx.path)
    fd = os.open(ctx.path, os.O_RDONLY)
    try:
        assert load_layout(fd, ctx.path) == ctx.layout
    finally:
        os.close(fd)
    reopened = stores.track(pickle.loads(pickle.dumps(ctx)))
    np.testing.assert_array_equal(reopened.retrieve(TOKENS[:C]), kv_for(TOKENS[:C]))


def test_a_process_keeps_no_more_mappings_than_its_limit(
    stores: StoreFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store whose files would take the process past its limit of kept
    mappings is left unmapped, and still reads and writes."""
    monkeypatch.setattr(_maps, "_MAX_FILES", 3)
    ctx = stores.connect(chunk_size=C, arena_bytes=4 * CHUNK, **LAYOUT)
    ctx.store(kv_for(TOKENS), TOKENS)
    assert (ctx.retrieve(TOKENS) == kv_for(TOKENS)).all()
    assert all(_maps.kept(st) is None for st in _files(ctx))


def test_a_free_file_removed_for_room_frees_its_pages_under_a_mapping(
    stores: StoreFactory,
) -> None:
    """A free file removed for good (``remove_free``, as eviction does) has
    no pages left, though this process still keeps it mapped."""
    ctx = stores.connect(chunk_size=C, arena_bytes=2 * CHUNK, **LAYOUT)
    ctx.store(kv_for(TOKENS[:C]), TOKENS[:C])
    (name,) = (n for n in os.listdir(ctx.path) if n.startswith(FREE_PREFIX))
    fd = os.open(os.path.join(ctx.path, name), os.O_RDONLY)
    dir_fd = os.open(ctx.path, os.O_RDONLY)
    try:
        assert _maps.kept(os.fstat(fd)) is not None
        assert os.fstat(fd).st_blocks > 0
        remove_free(dir_fd, name)
        assert name not in os.listdir(ctx.path)
        assert os.fstat(fd).st_blocks == 0
    finally:
        os.close(dir_fd)
        os.close(fd)


def _mapped_here(ctx: SharedMemoryKVStore) -> int:
    return sum(_maps.kept(st) is not None for st in _files(ctx))


def test_map_arena_maps_the_arena_in_the_calling_process(
    stores: StoreFactory, worker: multiprocessing.pool.Pool
) -> None:
    """``map_arena`` maps the store's files in the process that calls it,
    before any read or write there, and says how many."""
    ctx = stores.connect(chunk_size=C, arena_bytes=4 * CHUNK, **LAYOUT)
    ctx.store(kv_for(TOKENS), TOKENS)
    assert worker.apply_async(_mapped_here, (ctx,)).get(JOIN_TIMEOUT_S) == 0
    assert worker.apply_async(ctx.map_arena).get(JOIN_TIMEOUT_S) == 4
    assert worker.apply_async(_mapped_here, (ctx,)).get(JOIN_TIMEOUT_S) == 4


def test_map_arena_maps_nothing_without_an_arena(stores: StoreFactory) -> None:
    """A store without an arena, or without a layout yet, has nothing to
    map."""
    assert stores.connect(chunk_size=C).map_arena() == 0
    ctx = stores.connect(chunk_size=C, **LAYOUT)
    ctx.store(kv_for(TOKENS), TOKENS)
    assert ctx.map_arena() == 0


BIG = {"layers": 2, "width": 1 << 16, "dtype": "float32"}  # 4 MiB chunks: pooled


def _retrieve_after_map(
    ctx: SharedMemoryKVStore, tokens: list[int], reserve_tokens: int
) -> tuple[int, bool]:
    """In this process: map the arena reserving buffers, then retrieve.

    Returns:
        How many pooled buffers the map made, and whether the retrieved
        KV lies in one of them.
    """
    ctx.map_arena(reserve_tokens=reserve_tokens)
    made = pooled(_buffers._POOL)
    kv = ctx.retrieve(tokens)
    return len(made), kv is not None and address(kv) in made


@pytest.mark.parametrize(
    ("reserve_tokens", "expected"), [(2 * C, (2, True)), (0, (0, False))]
)
def test_map_arena_reserves_the_buffers_of_a_workers_first_retrieve(
    stores: StoreFactory,
    worker: multiprocessing.pool.Pool,
    reserve_tokens: int,
    expected: tuple[int, bool],
) -> None:
    """``map_arena(reserve_tokens=N)`` touches two pooled buffers for a
    retrieve of N tokens in the calling process, and that process's first
    such retrieve lands in one; without it, the retrieve maps new memory."""
    ctx = stores.connect(chunk_size=C, arena_bytes=2 * (HEADER_SIZE + (4 << 20)), **BIG)
    kv = np.ones((2, BIG["layers"], 2 * C, BIG["width"]), np.float32)
    ctx.store(kv, TOKENS)
    args = (ctx, TOKENS, reserve_tokens)
    assert worker.apply_async(_retrieve_after_map, args).get(JOIN_TIMEOUT_S) == expected


@pytest.mark.parametrize("bad", [-1, 1.5, True, "4"])
def test_reserve_tokens_must_be_a_non_negative_int(
    stores: StoreFactory, bad: object
) -> None:
    """A bad ``reserve_tokens`` is refused with a typed error naming it."""
    ctx = stores.connect(chunk_size=C, **LAYOUT)
    with pytest.raises(KVConfigError, match=f"reserve_tokens must be .*{bad!r}"):
        ctx.map_arena(reserve_tokens=bad)  # type: ignore[arg-type]
