"""Capacity: the default size of a store and least-recently-used eviction
that never touches pinned chunks.

Recency is a chunk file's mtime, refreshed on every hit and every store of
an existing chunk, so eviction order is shared by all processes. Byte
accounting is approximate across processes: a handle trusts its own count
(its own writes under way included) for a second before listing the
directory again. Chunks pinned by open batches
(:mod:`~lmcache_mp.kv._pinfiles`) are never evicted; what does not fit
besides them is reported, for the store to refuse (issue #20).
"""

from __future__ import annotations

import shutil
import threading
import time
from typing import NamedTuple

import psutil

from lmcache_mp.errors import KVStoreError
from lmcache_mp.kv._files import list_chunks
from lmcache_mp.kv._pinfiles import live_pins, mark_evicted
from lmcache_mp.kv._recycle import list_free, remove_free, retire

__all__ = ["Room", "Usage", "default_capacity"]

# Memory the default capacity leaves to processes: this share of the RAM,
# and at least _RESERVE_MIN bytes.
_RESERVE_SHARE = 8
_RESERVE_MIN = 1 << 30
# How long a handle trusts its own count of the bytes in use before listing
# the directory again: other processes' writes are unseen for at most this.
_USAGE_TTL_S = 1.0


def default_capacity(directory: str) -> int:
    """What the store can really hold: the free space of ``directory``'s
    filesystem (for ``/dev/shm``, its size less what is in it), and no more
    than the available RAM less a reserve for the processes (an eighth of
    the RAM, at least 1 GiB, at most half of what is available). Issue #20:
    a quarter of the free RAM evicted KV that a batch needed long before
    memory was short.

    Raises:
        KVStoreError: If ``directory``'s free space cannot be read.
    """
    memory = psutil.virtual_memory()
    # Never more than half of what is available: a small or busy machine
    # still gets a store.
    reserve = min(
        max(_RESERVE_MIN, memory.total // _RESERVE_SHARE), memory.available // 2
    )
    try:
        free_disk = shutil.disk_usage(directory).free
    except OSError as exc:
        raise KVStoreError(f"{directory}: cannot read its free space: {exc}") from exc
    return max(1, min(free_disk, memory.available - reserve))


class Room(NamedTuple):
    """What making room for new chunks found and did.

    Attributes:
        fits: How many of the new chunk files fit.
        evicted: Chunks evicted for them.
        evicted_bytes: Their bytes.
        used: Bytes of chunks in the store, counting the new ones if all fit.
        pinned: Bytes of pinned chunks; -1 when not looked at (no eviction
            was needed).
    """

    fits: int
    evicted: int
    evicted_bytes: int
    used: int
    pinned: int


def evict_lru(
    dir_fd: int, need: int, capacity: int, keep: frozenset[str], evict: bool = True
) -> tuple[int, int, int, int]:
    """Remove least recently used unpinned chunks until ``need`` more bytes fit.

    Nothing is removed when they would not fit even then. Free files
    (:mod:`~lmcache_mp.kv._recycle`) count as used and go first. Recency is
    the file's mtime, which a hit refreshes. An evicted chunk is retired
    for reuse and leaves an eviction mark.

    Args:
        dir_fd: The store directory.
        need: Bytes about to be written.
        capacity: The store's capacity in bytes.
        keep: Chunk names never to evict (the chunks being stored).
        evict: ``False``: only count the bytes used (an arena evicts no KV).

    Returns:
        ``(evicted, evicted bytes, used, pinned)``: chunks removed here,
        their bytes, the bytes still used, and the bytes pinned (-1 when
        nothing had to be evicted).
    """
    entries = list_chunks(dir_fd)
    free = list_free(dir_fd)
    used = sum(e.size for e in entries) + sum(e.size for e in free)
    if used + need <= capacity or not evict:
        return 0, 0, used, -1
    pinned_names = live_pins(dir_fd)
    pinned = sum(e.size for e in entries if e.name in pinned_names)
    held = sum(e.size for e in entries if e.name in keep or e.name in pinned_names)
    if held + need > capacity:
        return 0, 0, used, pinned  # cannot fit: evict nothing for nothing
    # Free files go first (removed); then chunks, retired for reuse by the
    # write that needs the room (the bytes stay, as that write's).
    for entry in free:
        if used + need <= capacity:
            break
        remove_free(dir_fd, entry.name)
        used -= entry.size
    gone: list[str] = []
    freed = 0
    for entry in sorted(entries, key=lambda e: (e.mtime_ns, e.name)):
        if used + need <= capacity:
            break
        if entry.name in keep or entry.name in pinned_names:
            continue
        retire(dir_fd, entry.name)
        gone.append(entry.name)
        freed += entry.size
        used -= entry.size
    mark_evicted(dir_fd, gone)
    return len(gone), freed, used, pinned


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
        # Bytes this handle made room for that are not written yet: a
        # listing of the directory cannot see them.
        self._inflight = 0

    def make_room(
        self,
        dir_fd: int,
        count: int,
        file_size: int,
        keep: frozenset[str],
        evict: bool = True,
    ) -> Room:
        """Evict as needed for ``count`` new chunk files of ``file_size`` bytes.

        Args:
            dir_fd: The store directory.
            count: Chunk files about to be written.
            file_size: Bytes of each.
            keep: Chunk names never to evict.
            evict: ``False``: evict nothing; only what is free fits.

        Returns:
            What fits and what was evicted. When all fit, they are counted
            as used from now on, and as under way until :meth:`written`.
        """
        need = count * file_size
        # One count per handle, read and updated under one lock, with the
        # bytes of writes under way added to every listing: threads of one
        # process storing at once (a thread batch's prefill) each added
        # their chunks to a count another overwrote, or a listing missed
        # the chunks still being written, and stores past the capacity were
        # let in (issue #20's pinned-capacity test failed 1 run in 2).
        with self._lock:
            used = self._used
            fresh = time.monotonic() - self._listed_at < _USAGE_TTL_S
            evicted = freed = 0
            pinned = -1
            if used is None or not fresh or used + need > self.capacity:
                evicted, freed, listed, pinned = evict_lru(
                    dir_fd, need + self._inflight, self.capacity, keep, evict
                )
                used = listed + self._inflight
                self._listed_at = time.monotonic()
            fits = min(count, max(0, self.capacity - used) // file_size)
            # A store that does not fit whole writes nothing.
            if fits == count:
                used += need
                self._inflight += need
            self._used = used
        return Room(fits, evicted, freed, used, pinned)

    def written(self, nbytes: int) -> None:
        """The writes that :meth:`make_room` made room for (``nbytes``) are
        over, done or failed: a listing sees what they left from now on."""
        with self._lock:
            self._inflight = max(0, self._inflight - nbytes)
