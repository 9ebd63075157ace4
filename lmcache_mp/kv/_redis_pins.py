"""The Redis store's pins, eviction and eviction marks (issue #20).

Keys, under a kind's namespace ``{base}`` = ``{prefix}:{kind}``::

    {base}:pin:{owner tag}-{stream}   a SET of the chunk keys (hex) one
                                      stream of a batch depends on; it
                                      expires with the batch's lease
    {base}:gone:{key hex}             an eviction mark, expiring in a day

The server's own eviction (allkeys-lru/lfu) cannot spare pinned keys, so
the store evicts first: before a write that would take the server past
``maxmemory`` (less a small margin for its own overhead; the server's
``used_memory`` is the measure, so this is approximate) it deletes the least
recently used unpinned chunks (by ``OBJECT IDLETIME``), and refuses the
write when even that would not make room. A batch killed by SIGKILL stops
renewing its pins, which then expire (the lease).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, NamedTuple

from lmcache_mp.kv._pins import PinOwner

if TYPE_CHECKING:
    import redis

__all__ = [
    "RedisRoom",
    "clear_marks",
    "is_marked",
    "live_pins",
    "make_room",
    "remove_pins",
    "set_pin",
]

# Room the store leaves below maxmemory before evicting by itself, for the
# server's own growth (key overhead, buffers), so that the server does
# not evict: this share of maxmemory, and at least _MARGIN_MIN bytes.
_MARGIN_SHARE = 100
_MARGIN_MIN = 64 << 10
# Seconds an eviction mark lives.
_MARK_TTL_S = 86400
_SCAN = 1000


class RedisRoom(NamedTuple):
    """What making room found: whether the write fits, what was evicted,
    and the bytes in use and pinned (-1: not looked at)."""

    fits: bool
    evicted: int
    evicted_bytes: int
    used: int
    pinned: int


def _pin_key(base: str, owner: PinOwner, stream_id: str) -> str:
    return f"{base}:pin:{owner.tag(stream_id)}"


def set_pin(
    conn: redis.Redis,
    base: str,
    owner: PinOwner,
    stream_id: str,
    names: Iterable[str],
    add: bool,
) -> None:
    """Pin chunk keys (hex) for one stream of ``owner``, renewing its lease.

    Args:
        conn: The client.
        base: The kind's namespace.
        owner: The batch.
        stream_id: The stream.
        names: Its chunks' key hex.
        add: Keep what is pinned for it too; else replace it.
    """
    key = _pin_key(base, owner, stream_id)
    members = list(names)
    pipe = conn.pipeline(transaction=True)
    if not add:
        pipe.delete(key)
    if members:
        pipe.sadd(key, *members)
        pipe.expire(key, math.ceil(owner.lease_s))
    pipe.execute()


def remove_pins(
    conn: redis.Redis, base: str, owner: PinOwner, stream_id: str | None
) -> None:
    """Release the pins of one stream of ``owner``, or all of its pins."""
    if stream_id is not None:
        conn.delete(_pin_key(base, owner, stream_id))
        return
    keys = list(conn.scan_iter(match=f"{base}:pin:{owner.tag()}-*", count=_SCAN))
    if keys:
        conn.delete(*keys)


def live_pins(conn: redis.Redis, base: str) -> set[str]:
    """The chunk keys (hex) pinned by batches whose lease runs."""
    keys = list(conn.scan_iter(match=f"{base}:pin:*", count=_SCAN))
    if not keys:
        return set()
    pipe = conn.pipeline(transaction=False)
    for key in keys:
        pipe.smembers(key)
    return {m.decode() for members in pipe.execute() for m in members}


def make_room(
    conn: redis.Redis, base: str, need: int, maxmemory: int, keep: set[str]
) -> RedisRoom:
    """Evict least recently used unpinned chunks so that ``need`` more
    bytes fit under ``maxmemory`` without the server evicting.

    Nothing is evicted when the bytes would not fit even then. Each
    eviction leaves a mark.

    Args:
        conn: The client.
        base: The kind's namespace.
        need: Bytes about to be written.
        maxmemory: The server's limit (0: unbounded, nothing to do).
        keep: Chunk keys (hex) never to evict: the ones being written.
    """
    if not maxmemory:
        return RedisRoom(True, 0, 0, 0, -1)
    used = int(conn.info("memory")["used_memory"])
    budget = maxmemory - max(_MARGIN_MIN, maxmemory // _MARGIN_SHARE)
    if used + need <= budget:
        return RedisRoom(True, 0, 0, used, -1)
    pinned_names = live_pins(conn, base) | keep
    prefix = f"{base}:c:"
    keys = [k.decode() for k in conn.scan_iter(match=f"{prefix}*", count=_SCAN)]
    pipe = conn.pipeline(transaction=False)
    for key in keys:
        pipe.strlen(key)
        pipe.object("idletime", key)
    answers = pipe.execute(raise_on_error=False)
    chunks = []
    pinned = 0
    for index, key in enumerate(keys):
        size, idle = answers[2 * index], answers[2 * index + 1]
        if isinstance(size, Exception):
            continue
        if key[len(prefix) :] in pinned_names:
            pinned += int(size)
            continue
        # Under an LFU policy the server keeps no idle time: scan order.
        chunks.append((0 if isinstance(idle, Exception) else -int(idle), key, size))
    evictable = sum(size for _, _, size in chunks)
    if used - evictable + need > budget:
        return RedisRoom(False, 0, 0, used, pinned)
    gone: list[str] = []
    freed = 0
    for _, key, size in sorted(chunks):
        if used - freed + need <= budget:
            break
        gone.append(key)
        freed += int(size)
    _evict(conn, base, [key[len(prefix) :] for key in gone])
    return RedisRoom(True, len(gone), freed, used - freed, pinned)


def _evict(conn: redis.Redis, base: str, names: list[str]) -> None:
    """Delete chunks (by key hex) and mark them evicted."""
    if not names:
        return
    pipe = conn.pipeline(transaction=False)
    for name in names:
        pipe.delete(f"{base}:c:{name}")
        pipe.set(f"{base}:gone:{name}", b"", ex=_MARK_TTL_S)
    pipe.execute()


def clear_marks(conn: redis.Redis, base: str, names: Iterable[str]) -> None:
    """Forget that chunks (key hex) were evicted: they are stored again."""
    keys = [f"{base}:gone:{name}" for name in names]
    if keys:
        conn.delete(*keys)


def is_marked(conn: redis.Redis, base: str, name: str) -> bool:
    """Whether chunk ``name`` (key hex) was evicted and not stored since."""
    return bool(conn.exists(f"{base}:gone:{name}"))
