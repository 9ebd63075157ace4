"""The store shared by processes: pickled handles, atomic writes, crashes."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import random
import select
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator

import numpy as np
import pytest

from lmcache_mp.errors import CorruptChunkWarning
from lmcache_mp.kv import SharedMemoryKVStore, connect
from tests._scripts import run_python
from tests._store_util import (
    StoreFactory,
    chunk_paths,
    kv_of,
    spawned_pool,
    temp_names,
    unique_url,
)

C = 16
TOKENS = list(range(3 * C))
JOIN_TIMEOUT_S = 60


@pytest.fixture
def pool() -> Iterator[multiprocessing.pool.Pool]:
    with spawned_pool(4) as workers:
        yield workers


def _store_in_child(ctx: SharedMemoryKVStore, tokens: list[int]) -> bool:
    return ctx.store(kv_of(tokens), tokens)


def _retrieve_in_child(
    ctx: SharedMemoryKVStore, tokens: list[int]
) -> np.ndarray | None:
    return ctx.retrieve(tokens)


def test_child_stores_what_the_parent_retrieves(
    stores: StoreFactory, pool: multiprocessing.pool.Pool
) -> None:
    """A spawned child given the pickled store writes chunks the parent reads."""
    ctx = stores.connect(chunk_size=C)
    assert pool.apply_async(_store_in_child, (ctx, TOKENS)).get(JOIN_TIMEOUT_S)
    got = ctx.retrieve(TOKENS)
    assert got is not None and np.array_equal(got, kv_of(TOKENS))


def test_parent_stores_what_a_child_retrieves(
    stores: StoreFactory, pool: multiprocessing.pool.Pool
) -> None:
    """A spawned child given the pickled store reads the parent's chunks."""
    ctx = stores.connect(chunk_size=C)
    ctx.store(kv_of(TOKENS), TOKENS)
    got = pool.apply_async(_retrieve_in_child, (ctx, TOKENS)).get(JOIN_TIMEOUT_S)
    assert got is not None and np.array_equal(got, kv_of(TOKENS))


def _full_kv(value: int) -> np.ndarray:
    return np.full((2, 4, C, 512), value, np.float32)


def _overwrite_loop(
    ctx: SharedMemoryKVStore, writer: int, start_at: float, rounds: int
) -> None:
    """Repeatedly replace the one chunk with a KV full of ``writer``."""
    kv = _full_kv(writer)
    time.sleep(max(0.0, start_at - time.time()))
    for _ in range(rounds):
        for path in chunk_paths(ctx):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        ctx.store(kv, TOKENS[:C])


def _read_until(
    ctx: SharedMemoryKVStore, start_at: float, writers_done: threading.Event
) -> tuple[int, list[list[float]]]:
    """Retrieve the chunk until the writers are done; return hits, mixed reads."""
    warnings.simplefilter("error", CorruptChunkWarning)
    time.sleep(max(0.0, start_at - time.time()))
    hits, mixed = 0, []
    for attempt in range(100_000):
        if attempt % 20 == 0 and writers_done.is_set():
            break
        got = ctx.retrieve(TOKENS[:C])
        if got is not None:
            hits += 1
            values = np.unique(got).tolist()
            if len(values) != 1:
                mixed.append(values)
    return hits, mixed


def test_concurrent_overwrites_are_never_torn(
    stores: StoreFactory, pool: multiprocessing.pool.Pool
) -> None:
    """Three writers replacing one chunk, one reader: every read is one writer's."""
    ctx = stores.connect(chunk_size=C)
    ctx.store(_full_kv(0), TOKENS[:C])
    start_at = time.time() + 2.0  # all four processes are up by then
    with multiprocessing.get_context("spawn").Manager() as manager:
        writers_done = manager.Event()
        reader = pool.apply_async(_read_until, (ctx, start_at, writers_done))
        writers = [
            pool.apply_async(_overwrite_loop, (ctx, writer, start_at, 150))
            for writer in (1, 2, 3)
        ]
        for result in writers:
            result.get(JOIN_TIMEOUT_S)
        writers_done.set()
        hits, mixed = reader.get(JOIN_TIMEOUT_S)
    assert hits > 0
    assert mixed == []


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(timeout=JOIN_TIMEOUT_S)
    return child.pid


def test_temp_files_of_dead_writers_are_removed_at_open(
    stores: StoreFactory,
) -> None:
    """Opening a store removes a dead writer's temp file, keeps a live one's."""
    url = unique_url()
    ctx = stores.connect(url)
    dead = os.path.join(ctx.path, f".tmp-{_dead_pid()}-0a1b2c")
    live = os.path.join(ctx.path, f".tmp-{os.getpid()}-3d4e5f")
    for path in (dead, live):
        with open(path, "wb") as fh:
            fh.write(b"half a chunk")
    stores.connect(url)
    assert temp_names(ctx) == [os.path.basename(live)]


def test_old_temp_files_are_removed_at_open(stores: StoreFactory) -> None:
    """A temp file untouched for an hour goes, even if its pid is alive."""
    url = unique_url()
    ctx = stores.connect(url)
    old = os.path.join(ctx.path, f".tmp-{os.getpid()}-abcdef")
    with open(old, "wb") as fh:
        fh.write(b"abandoned")
    an_hour_ago = time.time() - 3600
    os.utime(old, (an_hour_ago, an_hour_ago))
    stores.connect(url)
    assert temp_names(ctx) == []


def test_forked_child_exit_keeps_the_parents_store() -> None:
    """A forked child that exits normally does not remove its parent's store."""
    script = (
        "import os, lmcache_mp.kv as kv\n"
        "ctx = kv.connect()\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    raise SystemExit(0)\n"
        "os.waitpid(pid, 0)\n"
        "print(ctx.path, os.path.isdir(ctx.path), flush=True)\n"
    )
    done = run_python(script, timeout=JOIN_TIMEOUT_S)
    assert done.returncode == 0, done.stderr
    path, alive_after_child = done.stdout.split()
    assert alive_after_child == "True"
    assert not os.path.exists(path)


WRITER = """
import sys
import numpy as np
import lmcache_mp.kv as kv

ctx = kv.connect(sys.argv[1], chunk_size=16)
print("ready", flush=True)
for i in range(10_000):
    ctx.store(np.full((2, 8, 64, 1024), i, np.float32), range(i * 64, i * 64 + 64))
"""


def _kill_writer_at_random(url: str, rng: random.Random) -> None:
    """Start a writer, wait until it is storing, SIGKILL it 0-30 ms later."""
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, url], stdout=subprocess.PIPE, text=True
    )
    try:
        assert writer.stdout is not None
        ready, _, _ = select.select([writer.stdout], [], [], JOIN_TIMEOUT_S)
        assert ready and writer.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.0, 0.030))
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=JOIN_TIMEOUT_S)
        writer.stdout.close()  # type: ignore[union-attr]


def _check_every_chunk(ctx: SharedMemoryKVStore) -> None:
    """Every chunk file is reachable, verifies, and holds its sequence's value."""
    verified = 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i in range(10_000):
            got = ctx.retrieve(range(i * 64, i * 64 + 64))
            if got is None:
                break
            assert np.all(got == i)
            verified += got.shape[2] // 16
    assert verified == len(chunk_paths(ctx))


@pytest.mark.slow
def test_writer_killed_at_random_leaves_only_whole_chunks(
    stores: StoreFactory,
) -> None:
    """100 writers SIGKILLed mid-store: every chunk left verifies, no temp stays."""
    rng = random.Random(1234)
    torn_temps = chunks = 0
    for _ in range(100):
        url = unique_url()
        ctx = connect(url, chunk_size=16)
        try:
            _kill_writer_at_random(url, rng)
            torn_temps += bool(temp_names(ctx))
            chunks += len(chunk_paths(ctx))
            reopened = connect(url, chunk_size=16)
            assert temp_names(reopened) == []
            _check_every_chunk(reopened)
            reopened.close()
        finally:
            ctx.destroy()
    print(
        f"RELIABILITY: store writer kills=100 with a half-written temp file="
        f"{torn_temps} chunks left={chunks}, all verified, no temp after reopen"
    )
