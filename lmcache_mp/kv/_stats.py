"""Store statistics: what is on disk, and what this handle did."""

from __future__ import annotations

import threading
from dataclasses import dataclass

__all__ = ["Counters", "StoreStats"]


@dataclass(frozen=True)
class StoreStats:
    """A snapshot of a store.

    ``chunks`` and ``bytes`` describe the whole store as it is on disk,
    shared by every process. The other counts are this process handle's
    own, since it was connected or unpickled: each chunk lookup is a hit or
    a miss, and a retrieve stops looking at its first miss.

    Attributes:
        chunks: Chunk files in the store.
        bytes: Their total size, headers included.
        hits: Chunks this handle found and returned.
        misses: Lookups by this handle that found no valid chunk.
        evictions: Chunks this handle removed to make room.
        writes: Chunks this handle wrote.
        corrupt: Chunks this handle found corrupt (and removed).
    """

    chunks: int
    bytes: int
    hits: int
    misses: int
    evictions: int
    writes: int
    corrupt: int


class Counters:
    """A handle's hit/miss/eviction/write/corrupt counts. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(
            ("hits", "misses", "evictions", "writes", "corrupt"), 0
        )

    def add(self, **deltas: int) -> None:
        """Add to the named counts."""
        with self._lock:
            for name, delta in deltas.items():
                self._counts[name] += delta

    def snapshot(self, chunks: int, size: int) -> StoreStats:
        """The counts with the store's current ``chunks`` and bytes."""
        with self._lock:
            return StoreStats(chunks=chunks, bytes=size, **self._counts)
