"""The Redis store's pins as a batch and a write see them (issue #20): pin
a stream's chunks, release them, ask whether a chunk was evicted, make
room for a write without touching pinned chunks, and report the pinned,
evicted and free bytes."""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING

from lmcache_mp.errors import KVCapacityError
from lmcache_mp.kv._common import capacity_error
from lmcache_mp.kv._keys import Tokens, chunk_keys, token_array
from lmcache_mp.kv._pins import PinOwner, current_scope
from lmcache_mp.kv._redis_conn import RedisLink, server_memory
from lmcache_mp.kv._redis_ops import chunk_bytes
from lmcache_mp.kv._redis_pins import (
    is_marked,
    live_pins,
    make_room,
    remove_pins,
    set_pin,
)
from lmcache_mp.kv._stats import Counters, StoreStats

if TYPE_CHECKING:
    import redis

__all__ = ["KeyPins"]


class KeyPins(abc.ABC):
    """Pins, eviction and stats of a Redis store's namespace (a store's
    methods)."""

    _chunk_size: int
    _link: RedisLink
    _counts: Counters

    @abc.abstractmethod
    def _base(self) -> str:
        """The namespace: ``{prefix}:{kind}``."""

    @abc.abstractmethod
    def _key(self, *parts: str) -> str:
        """A key of the namespace: ``{prefix}:{kind}:{parts...}``."""

    @property
    @abc.abstractmethod
    def capacity_bytes(self) -> int:
        """The server's ``maxmemory``."""

    def _make_room(self, conn: redis.Redis, hexes: list[str], need: int) -> None:
        """Pin the chunks being written to the current stream's batch, then
        evict unpinned chunks so that ``need`` bytes fit (issue #20).

        Raises:
            KVCapacityError: If they do not fit even so (nothing written).
        """
        scope = current_scope()
        base = self._base()
        with self._link.errors():
            if scope is not None and scope.owner is not None:
                set_pin(conn, base, scope.owner, scope.stream_id, hexes, add=True)
            maxmemory = server_memory(conn).maxmemory
            room = make_room(conn, base, need, maxmemory, set(hexes))
        self._counts.add(evictions=room.evicted, evicted_bytes=room.evicted_bytes)
        if not room.fits:
            raise self._capacity_error(need, room.pinned, room.used, maxmemory)

    def _capacity_error(
        self, asked: int, pinned: int, used: int = -1, maxmemory: int = -1
    ) -> KVCapacityError:
        if maxmemory < 0:
            maxmemory = self.capacity_bytes
        return capacity_error(
            self._link.where,
            current_scope(),
            asked,
            pinned,
            used,
            maxmemory,
            "Raise the server's maxmemory (CONFIG SET maxmemory BYTES)",
        )

    def pin(
        self, owner: PinOwner, stream_id: str, tokens: Tokens, cache_salt: str = ""
    ) -> None:
        """As :meth:`SharedMemoryKVStore.pin
        <lmcache_mp.kv.SharedMemoryKVStore.pin>`; the pin is a key that
        expires after the batch's lease unless pinned again (issue #20).

        Raises:
            KVStoreConnectionError: If the server cannot be reached.
            KVStoreError: If the store is closed or the server fails.
        """
        keys = chunk_keys(token_array(tokens), self._chunk_size, cache_salt)
        with self._link.errors():
            conn = self._link.open_client()
            set_pin(
                conn, self._base(), owner, stream_id, [k.hex() for k in keys], False
            )

    def unpin(self, owner: PinOwner, stream_id: str | None = None) -> None:
        """Release the pins of one stream of a batch, or all of the batch's.

        Raises:
            KVStoreConnectionError: If the server cannot be reached.
            KVStoreError: If the store is closed or the server fails.
        """
        with self._link.errors():
            remove_pins(self._link.open_client(), self._base(), owner, stream_id)

    def was_evicted(self, tokens: Tokens, cache_salt: str = "", start: int = 0) -> bool:
        """As :meth:`SharedMemoryKVStore.was_evicted
        <lmcache_mp.kv.SharedMemoryKVStore.was_evicted>`: the store evicted
        it (the server's own evictions leave no mark).

        Raises:
            KVStoreConnectionError: If the server cannot be reached.
            KVStoreError: If the store is closed or the server fails.
        """
        keys = list(chunk_keys(token_array(tokens), self._chunk_size, cache_salt))
        index = start // self._chunk_size
        if index >= len(keys):
            return False
        with self._link.errors():
            return is_marked(self._link.open_client(), self._base(), keys[index].hex())

    def stats(self) -> StoreStats:
        """Return this kind's chunks and bytes, the server's capacity, the
        keys it evicted since this handle connected, and this handle's
        counters.

        Raises:
            KVStoreConnectionError: If the server cannot be reached.
            KVStoreError: If the store is closed or the server fails.
        """
        with self._link.errors():
            conn = self._link.open_client()
            sizes = chunk_bytes(conn, self._key("c", "*"))
            capacity = server_memory(conn).maxmemory
            evictions = self._link.evictions(conn)
            pinned = live_pins(conn, self._base())
            pinned_sizes = chunk_bytes(conn, self._key("c", "*"), pinned)
            used = int(conn.info("memory")["used_memory"]) if capacity else 0
        return self._counts.snapshot(
            len(sizes),
            sum(sizes),
            capacity_bytes=capacity,
            # The server's evictions and the store's own (made before the
            # server would evict, sparing pinned chunks).
            evictions=evictions + self._counts.get("evictions"),
            pinned_bytes=sum(pinned_sizes),
            free_bytes=max(0, capacity - used) if capacity else 0,
        )
