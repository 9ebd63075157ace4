"""Helpers for the store tests: a tracking factory, KVs, and raw access to
the chunks of either backend (files, or Redis values)."""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.pool
import os
import secrets
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from lmcache_mp.kv import KVStore, RedisKVStore, SharedMemoryKVStore, connect
from lmcache_mp.kv._files import CHUNK_SUFFIX, TEMP_PREFIX, temp_name
from lmcache_mp.kv._keys import chunk_keys, token_array


@contextlib.contextmanager
def spawned_pool(processes: int) -> Iterator[multiprocessing.pool.Pool]:
    """A pool of ``processes`` spawned workers, closed and joined on exit."""
    with multiprocessing.get_context("spawn").Pool(processes) as pool:
        yield pool
        pool.close()
        pool.join()


class StoreFactory:
    """Connects stores and destroys every one of them at teardown."""

    def __init__(self) -> None:
        self.made: list[Any] = []

    def connect(self, url: str | None = None, **kwargs: Any) -> Any:
        """``lmcache_mp.kv.connect``, remembered for teardown (typed Any: the
        tests use either backend's own attributes)."""
        return self.track(connect(url, **kwargs))

    def named(self, **kwargs: Any) -> SharedMemoryKVStore:
        """Connect a named store with a fresh unique name."""
        ctx: SharedMemoryKVStore = self.connect(unique_url(), **kwargs)
        return ctx

    def track(self, ctx: Any) -> Any:
        """Remember a store made elsewhere (e.g. unpickled) for teardown."""
        self.made.append(ctx)
        return ctx

    def destroy_all(self) -> None:
        """Destroy every store made and check that its directory is gone
        (the keys of a Redis store are checked by ``no_redis_leaks``)."""
        for ctx in self.made:
            ctx.destroy()
        leaked = [
            ctx.path
            for ctx in self.made
            if isinstance(ctx, SharedMemoryKVStore) and os.path.lexists(ctx.path)
        ]
        assert not leaked, f"store directories left behind: {leaked}"


def unique_url() -> str:
    """A ``shm:///`` URL no other test uses."""
    return f"shm:///test-{secrets.token_hex(8)}"


def kv_of(
    tokens: Sequence[int],
    layers: int = 2,
    width: int = 4,
    dtype: Any = np.float32,
    seed: int = 0,
) -> np.ndarray:
    """A random ``[2, L, len(tokens), D]`` KV of ``dtype`` (reproducible)."""
    rng = np.random.default_rng(seed)
    values = rng.standard_normal((2, layers, len(tokens), width), dtype=np.float32)
    return values.astype(dtype)


def address(arr: np.ndarray) -> int:
    """Where an array's data starts: which buffer it lies in."""
    return int(arr.__array_interface__["data"][0])


def pooled(pool: Any) -> set[int]:
    """The addresses of the mappings a ``_buffers._Pool`` keeps."""
    return {address(np.frombuffer(region, np.uint8)) for region in pool._regions}


def bits(arr: np.ndarray) -> np.ndarray:
    """The raw bytes of an array, so NaNs and -0.0 compare exactly."""
    return np.ascontiguousarray(arr).view(np.uint8)


def chunk_paths(ctx: SharedMemoryKVStore) -> list[str]:
    """The store's chunk files, sorted."""
    names = sorted(n for n in os.listdir(ctx.path) if n.endswith(CHUNK_SUFFIX))
    return [os.path.join(ctx.path, n) for n in names]


def temp_names(ctx: SharedMemoryKVStore) -> list[str]:
    """The store's temp files (writes in progress or abandoned)."""
    return [n for n in os.listdir(ctx.path) if n.startswith(TEMP_PREFIX)]


def staged_names(ctx: KVStore) -> list[str]:
    """The store's staged chunks: temp files, or Redis staged keys."""
    if isinstance(ctx, RedisKVStore):
        return [k.decode() for k in ctx.client().keys(ctx._key("tmp", "*"))]
    return temp_names(ctx)


class RawChunks:
    """Direct access to the chunks of ``tokens`` in a store of either
    backend, by chunk index: what tests damage, forge or move.

    Args:
        ctx: The store.
        tokens: The token ids whose chunks are addressed.
        salt: Their cache salt.
    """

    def __init__(self, ctx: KVStore, tokens: Sequence[int], salt: str = "") -> None:
        self.ctx = ctx
        self.keys = list(chunk_keys(token_array(tokens), ctx.chunk_size, salt))

    def _name(self, index: int) -> str:
        if isinstance(self.ctx, RedisKVStore):
            return self.ctx._chunk_key(self.keys[index])
        return os.path.join(self.ctx.path, self.keys[index].hex() + CHUNK_SUFFIX)

    def get(self, index: int) -> bytes | None:
        """Chunk ``index``'s bytes, or ``None`` when it is not there."""
        if isinstance(self.ctx, RedisKVStore):
            value: bytes | None = self.ctx.client().get(self._name(index))
            return value
        try:
            with open(self._name(index), "rb") as fh:
                return fh.read()
        except FileNotFoundError:
            return None

    def put(self, index: int, data: bytes) -> None:
        """Replace chunk ``index`` by ``data`` (atomically, as a writer would)."""
        if isinstance(self.ctx, RedisKVStore):
            self.ctx.client().set(self._name(index), data)
            return
        tmp = os.path.join(self.ctx.path, temp_name())
        with open(tmp, "wb") as fh:
            fh.write(data)
        os.replace(tmp, self._name(index))

    def put_layout(self, data: bytes) -> None:
        """Replace the store's layout document by ``data``."""
        if isinstance(self.ctx, RedisKVStore):
            self.ctx.client().set(self.ctx._key(), data)
            return
        with open(os.path.join(self.ctx.path, "layout.json"), "wb") as fh:
            fh.write(data)
