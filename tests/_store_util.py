"""Helpers for the shared-memory store tests: a tracking factory, KVs, files."""

from __future__ import annotations

import os
import secrets
from collections.abc import Sequence
from typing import Any

import numpy as np

from lmcache_mp.kv import SharedMemoryKVStore, connect
from lmcache_mp.kv._files import CHUNK_SUFFIX, TEMP_PREFIX


class StoreFactory:
    """Connects stores and destroys every one of them at teardown."""

    def __init__(self) -> None:
        self.made: list[SharedMemoryKVStore] = []

    def connect(self, url: str | None = None, **kwargs: Any) -> SharedMemoryKVStore:
        """``lmcache_mp.kv.connect``, remembered for teardown."""
        return self.track(connect(url, **kwargs))

    def named(self, **kwargs: Any) -> SharedMemoryKVStore:
        """Connect a named store with a fresh unique name."""
        return self.connect(unique_url(), **kwargs)

    def track(self, ctx: SharedMemoryKVStore) -> SharedMemoryKVStore:
        """Remember a store made elsewhere (e.g. unpickled) for teardown."""
        self.made.append(ctx)
        return ctx

    def destroy_all(self) -> None:
        """Destroy every store made and check that its directory is gone."""
        for ctx in self.made:
            ctx.destroy()
        leaked = [ctx.path for ctx in self.made if os.path.lexists(ctx.path)]
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
