"""The store loses nothing silently: an open batch pins its
streams' KV, a store that cannot fit fails at once, a retrieve of evicted
KV fails at once, and a crashed batch's pins are reclaimed."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

import lmcache_mp.batch as lmc_batch
import lmcache_mp.stream as lmc_stream
from lmcache_mp.errors import (
    CorruptChunkWarning,
    KVCapacityError,
    KVEvictedError,
    LMCacheBatchedStreamError,
)
from lmcache_mp.kv import SharedMemoryKVStore, connect
from lmcache_mp.kv import _files as _capacity
from lmcache_mp.kv._chunk import HEADER_SIZE
from lmcache_mp.kv._layout import resolve_dtype
from lmcache_mp.kv._stats import lru_victims
from tests._fakes import FakeEngine, kv_for
from tests._redis_server import RedisServer, running
from tests._store_util import StoreFactory, bits, kv_of

C = 4
#: A FakeEngine chunk file: [2, 2 layers, 4 tokens, 4 wide] float32.
CHUNK = HEADER_SIZE + 2 * 2 * C * 4 * 4
PROMPTS = [list(range(10 * i, 10 * i + 2 * C)) for i in range(4)]


def _double(kv: Any, tokens: list[int]) -> tuple[Any, list[int]]:
    return kv * 2, tokens


def _filled_batch(ctx: SharedMemoryKVStore, executor: str) -> Any:
    """A batch of the four PROMPTS, prefilled: its KV fills ``ctx``."""
    batch = lmc_batch.LMCacheBatchedStream(executor, max_workers=2)
    for prompt in PROMPTS:
        batch.add(lmc_stream.create_request(ctx, FakeEngine(ctx), prompt))
    batch.prefill({})
    return batch


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_pinned_kv_survives_a_store_past_capacity(
    stores: StoreFactory, executor: str
) -> None:
    """With an open batch's KV filling the store, a new store fails with
    KVCapacityError (nothing evicted), and every member stream still
    modifies and decodes."""
    ctx = stores.connect(chunk_size=C, capacity_bytes=len(PROMPTS) * 2 * CHUNK)
    with _filled_batch(ctx, executor) as batch:
        assert ctx.stats().pinned_bytes == len(PROMPTS) * 2 * CHUNK
        other = list(range(500, 500 + C))
        with pytest.raises(KVCapacityError, match="pinned") as info:
            ctx.store(kv_for(other), other)
        assert info.value.pinned == info.value.allowed == len(PROMPTS) * 2 * CHUNK
        batch.modify(_double, timeout=1.0)
        batch.decode({"max_tokens": 2})
        for stream in batch.streams.values():
            prompt = stream.tokens[: 2 * C]
            kv = ctx.retrieve(prompt)
            assert kv is not None and np.array_equal(kv, kv_for(prompt) * 2)
    assert ctx.stats().evictions == 0


def test_a_stream_that_cannot_fit_fails_its_phase_naming_it(
    stores: StoreFactory,
) -> None:
    """A prefill whose KV does not fit beside the pinned KV fails for that
    stream with KVCapacityError naming it; the streams before it keep
    their KV."""
    ctx = stores.connect(chunk_size=C, capacity_bytes=3 * 2 * CHUNK)
    with lmc_batch.LMCacheBatchedStream("serial") as batch:
        streams = [lmc_stream.create_request(ctx, FakeEngine(ctx), p) for p in PROMPTS]
        for stream in streams:
            batch.add(stream)
        with pytest.raises(LMCacheBatchedStreamError) as info:
            batch.prefill({})
        last = streams[-1].stream_id()
        assert list(info.value.failures) == [last]
        error = info.value.failures[last]
        assert isinstance(error, KVCapacityError) and last in str(error)
        assert error.stream_id == last and error.asked == 2 * CHUNK
        for stream in streams[:-1]:
            assert ctx.retrieve(stream.tokens) is not None


def test_closing_the_batch_releases_its_pins(stores: StoreFactory) -> None:
    """After close, the batch's KV is evictable again: a new store fits."""
    ctx = stores.connect(chunk_size=C, capacity_bytes=len(PROMPTS) * 2 * CHUNK)
    _filled_batch(ctx, "serial").close()
    assert ctx.stats().pinned_bytes == 0
    other = list(range(500, 500 + 2 * C))
    assert ctx.store(kv_for(other), other)
    assert ctx.stats().evictions == 2


@pytest.mark.parametrize("executor", ["serial", "process"])
def test_a_removed_stream_leaves_the_batch_and_its_pins(
    stores: StoreFactory, executor: str
) -> None:
    """remove() takes a stream out of an open batch: no later phase runs
    it, its KV is no longer pinned (a store past capacity evicts it), and
    the other streams' pins hold."""
    ctx = stores.connect(chunk_size=C, capacity_bytes=len(PROMPTS) * 2 * CHUNK)
    with _filled_batch(ctx, executor) as batch:
        first = next(iter(batch.streams))
        removed = batch.remove(first)
        assert first not in batch.streams and removed.stream_id() == first
        assert ctx.stats().pinned_bytes == (len(PROMPTS) - 1) * 2 * CHUNK
        batch.decode({"max_tokens": 1})
        assert len(removed.state.output_ids) == 1
        other = list(range(500, 500 + 2 * C))
        assert ctx.store(kv_for(other), other)
        assert ctx.retrieve(removed.tokens) is None
        for stream in batch.streams.values():
            assert len(stream.state.output_ids) == 2
            assert ctx.retrieve(stream.tokens[: 2 * C]) is not None
        with pytest.raises(LMCacheBatchedStreamError, match=first):
            batch.remove(first)


def test_an_evicted_prefix_fails_at_once_naming_the_stream(
    stores: StoreFactory,
) -> None:
    """A stream outside a batch whose KV was evicted: retrieve_kv raises
    KVEvictedError naming it within a second, not after its timeout."""
    ctx = stores.connect(chunk_size=C, capacity_bytes=2 * CHUNK)
    stream = lmc_stream.create_request(ctx, FakeEngine(ctx), PROMPTS[0])
    stream.generate({})
    other = PROMPTS[1]
    ctx.store(kv_for(other), other)
    start = time.monotonic()
    with pytest.raises(KVEvictedError, match=stream.stream_id()) as info:
        stream.retrieve_kv(timeout=30.0)
    assert time.monotonic() - start < 1.0
    assert info.value.stream_id == stream.stream_id()


def test_a_stream_whose_kv_never_came_still_waits(stores: StoreFactory) -> None:
    """KV never stored (not evicted) is polled for until the timeout, as
    upstream: it may still arrive."""
    ctx = stores.connect(chunk_size=C)
    stream = lmc_stream.create_request(ctx, FakeEngine(ctx), PROMPTS[0])
    start = time.monotonic()
    with pytest.raises(Exception, match="no cached KV") as info:
        stream.retrieve_kv(timeout=0.5, poll_interval=0.05)
    assert not isinstance(info.value, KVEvictedError)
    assert time.monotonic() - start >= 0.5


def test_storing_again_clears_the_eviction(stores: StoreFactory) -> None:
    """KV evicted and then stored again is retrieved normally."""
    ctx = stores.connect(chunk_size=C, capacity_bytes=2 * CHUNK)
    stream = lmc_stream.create_request(ctx, FakeEngine(ctx), PROMPTS[0])
    stream.generate({})
    ctx.store(kv_for(PROMPTS[1]), PROMPTS[1])
    stream.generate({})  # the engine stores the prompt's KV again
    assert stream.retrieve_kv(timeout=1.0).shape[2] == 2 * C


_CRASHED_BATCH = """
import sys, time
sys.path.insert(0, {cwd!r})
import lmcache_mp.batch as lmc_batch, lmcache_mp.stream as lmc_stream
from lmcache_mp.kv import connect
from tests._fakes import FakeEngine
ctx = connect({url!r}, chunk_size={chunk})
batch = lmc_batch.LMCacheBatchedStream("thread", pin_lease={lease})
for prompt in {prompts!r}:
    batch.add(lmc_stream.create_request(ctx, FakeEngine(ctx), prompt))
{then}
print("ready", flush=True)
time.sleep(60)
"""


@contextlib.contextmanager
def _killed_batch(
    ctx: Any, prompts: list[list[int]], then: str, lease: float
) -> Iterator[None]:
    """A child process opens a batch of ``prompts`` on ``ctx``, runs
    ``then``, and is SIGKILLed when the block ends."""
    script = _CRASHED_BATCH.format(
        cwd=os.getcwd(), url=ctx.url, chunk=C, prompts=prompts, then=then, lease=lease
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        yield
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=15)
    finally:
        proc.kill()
        proc.wait(timeout=15)


def test_a_killed_batchs_pins_are_reclaimed(stores: StoreFactory) -> None:
    """A batch whose process is SIGKILLed leaves its pins behind; the next
    store that needs room drops them and evicts its KV."""
    ctx = stores.connect(
        "shm:///pins-killed", chunk_size=C, capacity_bytes=len(PROMPTS) * 2 * CHUNK
    )
    with _killed_batch(ctx, PROMPTS, "batch.prefill({})", 600.0):
        assert ctx.stats().pinned_bytes == len(PROMPTS) * 2 * CHUNK
    other = list(range(500, 500 + 2 * C))
    assert ctx.store(kv_for(other), other)
    assert ctx.stats().pinned_bytes == 0
    assert not [n for n in os.listdir(ctx.path) if n.startswith(".pin-")]


def _stride(kv: Any, tokens: list[int]) -> tuple[Any, list[int]]:
    return kv[:, :, ::2], tokens[::2]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_edits_round_trip_bit_exactly(
    stores: StoreFactory, dtype: str
) -> None:
    """bf16 and f16 KV edited in worker processes (a same-token edit and a
    token-dropping one) lands in the store bit for bit."""
    ctx = stores.connect(chunk_size=C)
    tokens = list(range(8 * C))
    kv = kv_of(tokens, dtype=resolve_dtype(dtype))
    ctx.store(kv, tokens)
    with lmc_batch.LMCacheBatchedStream("process", max_workers=2) as batch:
        stream = lmc_stream.create_request(ctx, FakeEngine(ctx), tokens)
        batch.add(stream)
        batch.modify(_double, timeout=1.0)
        doubled = ctx.retrieve(tokens)
        assert doubled is not None and np.array_equal(bits(doubled), bits(kv * 2))
        batch.modify(_stride, timeout=1.0)
    got = ctx.retrieve(tokens[::2])
    assert got is not None and got.dtype == kv.dtype
    assert np.array_equal(bits(got), bits((kv * 2)[:, :, ::2]))


#: A Redis chunk of kv_of(..., layers=8, width=1024): 256 KiB of payload.
BIG = {"layers": 8, "width": 1024}


def test_pinned_kv_survives_a_store_past_redis_capacity() -> None:
    """On Redis, a store that would push pinned KV out fails with
    KVCapacityError (the store evicts before the server would), and the
    pinned streams still modify."""
    with running(maxmemory="8mb") as server, _redis_store(server, "pins") as ctx:
        prompts = [list(range(10 * i, 10 * i + 2 * C)) for i in range(2)]
        for prompt in prompts:
            ctx.store(kv_of(prompt, **BIG), prompt)
        with lmc_batch.LMCacheBatchedStream("thread") as batch:
            for prompt in prompts:
                batch.add(lmc_stream.create_request(ctx, FakeEngine(ctx), prompt))
            assert ctx.stats().pinned_bytes > 2 * 2 * 256 * 1024
            other = list(range(500, 500 + 24 * C))
            with pytest.raises(KVCapacityError, match="maxmemory"):
                ctx.store(kv_of(other, **BIG), other)
            batch.modify(_double, timeout=1.0)
        for prompt in prompts:
            got = ctx.retrieve(prompt)
            assert got is not None
            assert np.array_equal(bits(got), bits(kv_of(prompt, **BIG) * 2))


def test_a_killed_batchs_redis_pins_expire() -> None:
    """A batch whose process is SIGKILLed stops renewing its pins: after
    its lease they are gone and its KV can be evicted."""
    with running(maxmemory="4mb") as server, _redis_store(server, "killed") as ctx:
        prompts = [list(range(10 * i, 10 * i + 2 * C)) for i in range(2)]
        for prompt in prompts:
            ctx.store(kv_of(prompt, **BIG), prompt)
        with _killed_batch(ctx, prompts, "", 2.0):
            assert ctx.stats().pinned_bytes > 0
        time.sleep(3.0)  # the 2 s lease runs out
        assert ctx.stats().pinned_bytes == 0
        other = list(range(500, 500 + 8 * C))
        assert ctx.store(kv_of(other, **BIG), other)


@contextlib.contextmanager
def _redis_store(server: RedisServer, prefix: str) -> Iterator[Any]:
    """A store on ``server`` with 4-token chunks, destroyed while it runs."""
    ctx = connect(server.url(prefix), chunk_size=C)
    try:
        yield ctx
    finally:
        ctx.destroy()


def test_readers_never_see_a_recycled_chunk_change_under_them(
    stores: StoreFactory,
) -> None:
    """While a writer commits two versions of a KV in turn (each commit
    recycles the replaced files), every retrieve returns, chunk by chunk,
    one version or the other, and no chunk is ever reported corrupt."""
    ctx = stores.connect(chunk_size=C)
    tokens = list(range(4 * C))
    versions = [kv_of(tokens, seed=seed, **BIG) for seed in (1, 2)]
    ctx.store(versions[0], tokens)
    stop = threading.Event()

    def write() -> None:
        n = 0
        while not stop.is_set():
            n += 1
            ctx.stage(versions[n % 2], tokens).commit()

    writer = threading.Thread(target=write)
    writer.start()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", CorruptChunkWarning)
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline:
                got = ctx.retrieve(tokens)
                assert got is not None and got.shape[2] == 4 * C
                for start in range(0, 4 * C, C):
                    piece = bits(got[:, :, start : start + C])
                    assert any(
                        np.array_equal(piece, bits(v[:, :, start : start + C]))
                        for v in versions
                    )
    finally:
        stop.set()
        writer.join(timeout=30)
    assert not writer.is_alive()


@pytest.mark.parametrize(
    ("total", "available", "disk", "expected"),
    [
        (24, 14, 19, 11),  # RAM bounds it: available less an eighth of the RAM
        (24, 14, 6, 6),  # /dev/shm's free space bounds it
        (2, 1, 8, 0.5),  # a small machine keeps at most half its free RAM
    ],
)
def test_default_capacity_is_what_the_store_can_hold(
    monkeypatch: pytest.MonkeyPatch,
    total: float,
    available: float,
    disk: float,
    expected: float,
) -> None:
    """The default capacity is the filesystem's free space, at most the
    available RAM less a reserve (not a quarter of free RAM)."""
    gib = 2**30
    memory = SimpleNamespace(total=int(total * gib), available=int(available * gib))
    monkeypatch.setattr(_capacity.psutil, "virtual_memory", lambda: memory)
    usage = SimpleNamespace(free=int(disk * gib))
    monkeypatch.setattr(_capacity.shutil, "disk_usage", lambda path: usage)
    assert _capacity.default_capacity("/dev/shm") == int(expected * gib)


def test_threads_storing_at_once_never_take_a_handle_past_capacity(
    stores: StoreFactory,
) -> None:
    """Sixteen threads of one process store a chunk each at once into a
    store with room for four: older chunks are evicted, and a store whose
    room other writes under way hold is refused (KVCapacityError); the
    chunks left never exceed the capacity."""
    ctx = stores.connect(chunk_size=C, capacity_bytes=4 * CHUNK)
    start = threading.Barrier(16)

    def store(i: int) -> bool:
        tokens = list(range(1000 * (i + 1), 1000 * (i + 1) + C))
        start.wait(timeout=30)
        try:
            return ctx.store(kv_for(tokens), tokens)
        except KVCapacityError:
            return False

    with ThreadPoolExecutor(16) as pool:
        stored = list(pool.map(store, range(16)))
    assert any(stored)
    assert ctx.stats().bytes <= ctx.capacity_bytes


def test_a_listing_while_another_is_half_read_sees_every_chunk(
    stores: StoreFactory,
) -> None:
    """A handle lists its store through a descriptor of its own: a listing
    of the handle's directory left half read (another thread's) does not
    move it past chunks, which would leave them out of the capacity count
    (os.scandir on the shared descriptor saw none of them)."""
    ctx = stores.connect(chunk_size=C)
    for i in range(3):
        tokens = list(range(100 * i, 100 * i + C))
        ctx.store(kv_for(tokens), tokens)
    assert isinstance(ctx, SharedMemoryKVStore)
    with os.scandir(ctx._dir_fd()) as other:
        next(other)
        assert ctx.stats().chunks == 3


def test_the_eviction_policy_takes_the_least_recently_used_until_it_fits() -> None:
    """Both backends' policy: oldest first, only as many as the write needs,
    and nothing at all when even every candidate would not make room."""
    candidates = [(3, "c", 10), (1, "a", 10), (2, "b", 10)]
    assert lru_victims(candidates, used=30, need=5, budget=35) == []
    assert lru_victims(candidates, used=30, need=15, budget=30) == [
        (1, "a", 10),
        (2, "b", 10),
    ]
    assert lru_victims(candidates, used=40, need=15, budget=20) is None
