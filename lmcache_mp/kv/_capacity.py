"""Capacity: the default size of a store and least-recently-used eviction.

Recency is a chunk file's mtime, refreshed on every hit and every store of
an existing chunk, so eviction order is shared by all processes. Byte
accounting is approximate under concurrency: a handle trusts its own count
for a second before listing the directory again.
"""

from __future__ import annotations

import os
import shutil
import threading
import time

import psutil

from lmcache_mp.errors import KVStoreError
from lmcache_mp.kv._files import list_chunks

__all__ = ["Usage", "default_capacity"]

# Default capacity: this fraction of both free RAM and free space.
_CAPACITY_FRACTION = 4
# How long a handle trusts its own count of the bytes in use before listing
# the directory again: other processes' writes are unseen for at most this.
_USAGE_TTL_S = 1.0


def default_capacity(directory: str) -> int:
    """A quarter of the free RAM or of ``directory``'s free space, if smaller.

    Raises:
        KVStoreError: If ``directory``'s free space cannot be read.
    """
    free_ram = psutil.virtual_memory().available
    try:
        free_disk = shutil.disk_usage(directory).free
    except OSError as exc:
        raise KVStoreError(f"{directory}: cannot read its free space: {exc}") from exc
    return max(1, min(free_ram, free_disk) // _CAPACITY_FRACTION)


def evict_lru(
    dir_fd: int, need: int, capacity: int, keep: frozenset[str]
) -> tuple[int, int]:
    """Remove least recently used chunks until ``need`` more bytes fit.

    Recency is the file's mtime, which a hit refreshes. Processes evicting
    at the same time may remove the same file; only removals that succeed
    here are counted.

    Args:
        dir_fd: The store directory.
        need: Bytes about to be written.
        capacity: The store's capacity in bytes.
        keep: Chunk names never to evict (the chunks being stored).

    Returns:
        ``(evicted, used)``: chunks removed here, and the bytes still used.
    """
    entries = list_chunks(dir_fd)
    used = sum(e.size for e in entries)
    evicted = 0
    if used + need <= capacity:
        return evicted, used
    for entry in sorted(entries, key=lambda e: (e.mtime_ns, e.name)):
        if used + need <= capacity:
            break
        if entry.name in keep:
            continue
        try:
            os.unlink(entry.name, dir_fd=dir_fd)
            evicted += 1
        except FileNotFoundError:
            pass
        used -= entry.size
    return evicted, used


class Usage:
    """One handle's estimate of the bytes a store uses. Thread-safe.

    Args:
        capacity: The store's capacity in bytes.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._lock = threading.Lock()
        self._used: int | None = None
        self._listed_at = 0.0

    def make_room(
        self, dir_fd: int, count: int, file_size: int, keep: frozenset[str]
    ) -> tuple[int, int]:
        """Evict as needed for ``count`` new chunk files of ``file_size`` bytes.

        Args:
            dir_fd: The store directory.
            count: Chunk files about to be written.
            file_size: Bytes of each.
            keep: Chunk names never to evict.

        Returns:
            ``(fits, evicted)``: how many of the new files fit, and how many
            chunks were evicted for them. The fitting ones are counted as
            used from now on.
        """
        need = count * file_size
        with self._lock:
            used = self._used
            fresh = time.monotonic() - self._listed_at < _USAGE_TTL_S
        evicted = 0
        if used is None or not fresh or used + need > self.capacity:
            evicted, used = evict_lru(dir_fd, need, self.capacity, keep)
            with self._lock:
                self._listed_at = time.monotonic()
        fits = min(count, max(0, self.capacity - used) // file_size)
        with self._lock:
            self._used = used + fits * file_size
        return fits, evicted
