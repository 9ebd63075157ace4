"""Reading a prefix's chunk files out of a shared-memory store's directory,
and the store's size.

Each chunk is read straight into its place in one new KV
(:func:`~lmcache_mp.kv._chunk.read_chunk`); the prefix ends at the first
chunk that is missing or fails its check.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import numpy as np
import numpy.typing as npt

from lmcache_mp.kv._buffers import contiguous, empty_kv
from lmcache_mp.kv._chunk import CorruptChunk, chunk_views, read_chunk
from lmcache_mp.kv._common import warn_corrupt
from lmcache_mp.kv._files import CHUNK_SUFFIX, list_chunks, list_free, live_pins
from lmcache_mp.kv._layout import Layout
from lmcache_mp.kv._stats import Counters, StoreStats

__all__ = ["read_prefix", "store_stats"]


def read_prefix(
    dir_fd: int,
    path: str,
    counts: Counters,
    layout: Layout,
    chunk_size: int,
    keys: Iterable[bytes],
    wanted: int,
) -> npt.NDArray[Any] | None:
    """Read the longest cached prefix of chunks ``keys`` into one new
    ``[P, L, T, D]`` KV.

    Args:
        dir_fd: The store directory.
        path: Its path (named in warnings).
        counts: The handle's counters (hits, misses, corrupt chunks).
        layout: The store's layout.
        chunk_size: The store's chunk size.
        keys: The keys of the caller's whole chunks, in order (made as
            they are asked for).
        wanted: How many whole chunks the caller's tokens hold.

    Returns:
        The KV of the chunks read up to the first missing or corrupt one
        (which is removed, with a
        :class:`~lmcache_mp.errors.CorruptChunkWarning`), or ``None`` when
        the first one cannot be read.
    """
    found: list[tuple[str, bytes]] = []
    for key in keys:
        name = key.hex() + CHUNK_SUFFIX
        try:
            os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            break
        found.append((name, key))
    if not found:
        counts.add(misses=1)
        return None
    out = empty_kv(
        (layout.planes, layout.layers, len(found) * chunk_size, layout.width),
        layout.dtype,
    )
    raw = out.view(np.uint8)
    got = 0
    for name, key in found:
        views = chunk_views(raw, got * chunk_size, (got + 1) * chunk_size)
        try:
            read_chunk(dir_fd, name, key, views, layout, chunk_size)
        except FileNotFoundError:
            break
        except CorruptChunk as exc:
            counts.add(corrupt=1)
            # Points at the caller of the store's retrieve.
            warn_corrupt(f"{path}/{name}", exc, stacklevel=4)
            break
        got += 1
    counts.add(hits=got, misses=int(got < wanted))
    if got == 0:
        return None
    if got < len(found):
        return contiguous(out[:, :, : got * chunk_size], layout.dtype)
    return out


def store_stats(dir_fd: int, counts: Counters, capacity: int) -> StoreStats:
    """The store's size, read from its directory, and a handle's counters.

    Args:
        dir_fd: The store directory.
        counts: The handle's counters.
        capacity: The handle's capacity in bytes.

    Returns:
        The stats: chunk files and bytes, pinned bytes, and the free bytes
        (capacity less the chunks and the free files kept for reuse).
    """
    entries = list_chunks(dir_fd)
    pinned = live_pins(dir_fd)
    used = sum(e.size for e in entries)
    spare = sum(e.size for e in list_free(dir_fd))
    return counts.snapshot(
        len(entries),
        used,
        capacity_bytes=capacity,
        pinned_bytes=sum(e.size for e in entries if e.name in pinned),
        free_bytes=max(0, capacity - used - spare),
    )
