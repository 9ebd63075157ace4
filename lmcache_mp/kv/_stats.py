"""Store statistics and room: what is in a store, what this handle did, and
the eviction policy both backends use to make room (least recently used
first, never a pinned chunk)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

__all__ = ["Counters", "Room", "StoreStats", "lru_victims"]

_Candidate = TypeVar("_Candidate", bound=tuple[Any, str, int])


class Room(NamedTuple):
    """What making room for new chunks found and did.

    Attributes:
        fits: How many of the new chunks fit (a write that does not fit
            whole writes none of them).
        evicted: Chunks evicted for them.
        evicted_bytes: Their bytes.
        used: Bytes in use, counting the new chunks if all fit.
        pinned: Bytes of pinned chunks; -1 when not looked at (no eviction
            was needed).
    """

    fits: int
    evicted: int
    evicted_bytes: int
    used: int
    pinned: int


def lru_victims(
    candidates: Sequence[_Candidate], used: int, need: int, budget: int
) -> list[_Candidate] | None:
    """Choose what to evict so that ``need`` more bytes fit in ``budget``.

    Args:
        candidates: What may be evicted (pinned chunks and the chunks being
            written left out), as ``(recency, name, bytes)``; the smallest
            recency is the least recently used and goes first.
        used: Bytes in use now, the candidates included.
        need: Bytes about to be written.
        budget: Bytes the store may hold.

    Returns:
        The candidates to evict, in order (none when all fits already);
        ``None`` when evicting every candidate would not make room, so that
        nothing is evicted for nothing.
    """
    if used - sum(size for _, _, size in candidates) + need > budget:
        return None
    victims: list[_Candidate] = []
    for candidate in sorted(candidates):
        if used + need <= budget:
            break
        victims.append(candidate)
        used -= candidate[2]
    return victims


@dataclass(frozen=True)
class StoreStats:
    """A snapshot of a store.

    ``chunks`` and ``bytes`` describe the whole store (this kind's
    namespace) as it is now, shared by every process. The other counts are
    this process handle's own, since it was connected or unpickled: each
    chunk lookup is a hit or a miss, and a retrieve stops looking at its
    first miss.

    Attributes:
        chunks: Chunks in the store (files, or Redis values).
        bytes: Their total size, headers included.
        hits: Chunks this handle found and returned.
        misses: Lookups by this handle that found no valid chunk.
        evictions: Shared-memory store: chunks this handle removed to make
            room. Redis store: keys the server evicted since this handle
            connected (its ``evicted_keys``; the server does not say whose,
            so this counts every key it evicted).
        writes: Chunks this handle wrote.
        corrupt: Chunks this handle found corrupt (and removed).
        capacity_bytes: Bytes kept before least recently used chunks are
            evicted: the store's capacity, or the Redis server's
            ``maxmemory``; 0 means unbounded (a Redis server without
            ``maxmemory`` never evicts) or, where the server's ACL hides
            it, unknown.
        pinned_bytes: Of ``bytes``, those pinned by the streams of open
            batches: never evicted.
        evicted_bytes: Bytes of the chunks this handle evicted.
        free_bytes: Bytes still free before the capacity, and on a
            shared-memory store at most what its filesystem has free (0
            when unbounded or unknown).
    """

    chunks: int
    bytes: int
    hits: int
    misses: int
    evictions: int
    writes: int
    corrupt: int
    capacity_bytes: int = 0
    pinned_bytes: int = 0
    evicted_bytes: int = 0
    free_bytes: int = 0


class Counters:
    """A handle's hit/miss/eviction/write/corrupt counts. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(
            ("hits", "misses", "evictions", "writes", "corrupt", "evicted_bytes"),
            0,
        )

    def add(self, **deltas: int) -> None:
        """Add to the named counts."""
        with self._lock:
            for name, delta in deltas.items():
                self._counts[name] += delta

    def get(self, name: str) -> int:
        """One count."""
        with self._lock:
            return self._counts[name]

    def snapshot(
        self,
        chunks: int,
        size: int,
        *,
        capacity_bytes: int = 0,
        evictions: int | None = None,
        pinned_bytes: int = 0,
        free_bytes: int = 0,
    ) -> StoreStats:
        """The counts with the store's current ``chunks``, bytes and capacity.

        Args:
            chunks: Chunks in the store.
            size: Their bytes.
            capacity_bytes: The store's capacity (0: unbounded or unknown).
            evictions: The evictions to report instead of this handle's own
                count (a server that evicts by itself counts them).
            pinned_bytes: Bytes pinned by open batches.
            free_bytes: Bytes free before the capacity.
        """
        with self._lock:
            counts = dict(self._counts)
        if evictions is not None:
            counts["evictions"] = evictions
        return StoreStats(
            chunks=chunks,
            bytes=size,
            capacity_bytes=capacity_bytes,
            pinned_bytes=pinned_bytes,
            free_bytes=free_bytes,
            **counts,
        )
