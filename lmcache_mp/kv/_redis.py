"""The Redis KV store: the embedded store's semantics on a Redis server,
with its pins, eviction and eviction marks.

Keys, all under the store's prefix (``kind`` is ``kv`` or ``query``;
``{base}`` is ``{prefix}:{kind}``)::

    {base}:layout                the kind's layout (JSON), fixed by SET NX
    {base}:c:{key}               a chunk: the chunk-file bytes, key in hex
    {base}:tmp:{id}              a staged chunk, expiring after 10 minutes
    {base}:pin:{owner}-{stream}  a SET of the chunk keys (hex) one stream of
                                 a batch depends on; it expires with the
                                 batch's lease
    {base}:gone:{key}            an eviction mark, expiring in a day
    {prefix}:claims:{id}         an executor's claims

A value is exactly a chunk file of the shared-memory store (header, digest,
raw payload): it is checked like one and never unpickled. Each chunk is
written by one SET, so readers never see half of one.

The server's own eviction (allkeys-lru/lfu) cannot spare pinned keys, so
the store evicts first: before a write that would take the server past
``maxmemory`` (less a small margin for its own overhead; the server's
``used_memory`` is the measure, so this is approximate) it deletes the least
recently used unpinned chunks (by ``OBJECT IDLETIME``), and refuses the
write when even that would not make room. A batch killed by SIGKILL stops
renewing its pins, which then expire (the lease)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy.typing as npt

from lmcache_mp.cache_kind import LMCacheSDKCacheKind
from lmcache_mp.errors import KVCapacityError, KVStoreError
from lmcache_mp.kv._chunk import CorruptChunk, chunk_views, encode_chunk
from lmcache_mp.kv._common import (
    StagedChunks,
    StoreHandle,
    as_bytes,
    capacity_error,
    join_payloads,
    kv_layout,
    warn_corrupt,
)
from lmcache_mp.kv._keys import Tokens, chunk_keys, token_array
from lmcache_mp.kv._layout import Layout, encode_layout
from lmcache_mp.kv._pins import PinOwner, current_scope
from lmcache_mp.kv._redis_conn import (
    RedisLink,
    RedisTarget,
    check_policy,
    server_memory,
)
from lmcache_mp.kv._redis_ops import (
    KnownLayout,
    chunk_bytes,
    delete_matching,
    drop_if_same,
    fetch,
    plan_writes,
    probe,
    publish,
    set_values,
    stage_values,
    valid_prefix,
)
from lmcache_mp.kv._shm import DEFAULT_CHUNK_SIZE
from lmcache_mp.kv._stats import Counters, Room, StoreStats, lru_victims

if TYPE_CHECKING:
    import redis

__all__ = ["RedisKVStore"]


# Room the store leaves below maxmemory before evicting by itself, for the
# server's own growth (key overhead, buffers), so that the server does
# not evict: this share of maxmemory, and at least _MARGIN_MIN bytes.
_MARGIN_SHARE = 100
_MARGIN_MIN = 64 << 10
# Seconds an eviction mark lives.
_MARK_TTL_S = 86400
_SCAN = 1000


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
) -> Room:
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

    Returns:
        What was found and done; ``fits`` is all of ``keep`` or none.
    """
    count = len(keep)
    if not maxmemory:
        return Room(count, 0, 0, 0, -1)
    used = int(conn.info("memory")["used_memory"])
    budget = maxmemory - max(_MARGIN_MIN, maxmemory // _MARGIN_SHARE)
    if used + need <= budget:
        return Room(count, 0, 0, used, -1)
    pinned_names = live_pins(conn, base) | keep
    prefix = f"{base}:c:"
    keys = [k.decode() for k in conn.scan_iter(match=f"{prefix}*", count=_SCAN)]
    pipe = conn.pipeline(transaction=False)
    for key in keys:
        pipe.strlen(key)
        pipe.object("idletime", key)
    answers = pipe.execute(raise_on_error=False)
    chunks: list[tuple[object, str, int]] = []
    pinned = 0
    for index, key in enumerate(keys):
        size, idle = answers[2 * index], answers[2 * index + 1]
        if isinstance(size, Exception):
            continue
        if key[len(prefix) :] in pinned_names:
            pinned += int(size)
            continue
        # Under an LFU policy the server keeps no idle time: scan order.
        chunks.append(
            (0 if isinstance(idle, Exception) else -int(idle), key, int(size))
        )
    victims = lru_victims(chunks, used, need, budget)
    if victims is None:
        return Room(0, 0, 0, used, pinned)
    freed = sum(size for _, _, size in victims)
    _evict(conn, base, [key[len(prefix) :] for _, key, _ in victims])
    return Room(count, len(victims), freed, used - freed, pinned)


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


def _reopen(url: str, chunk_size: int, kind: LMCacheSDKCacheKind) -> RedisKVStore:
    return RedisKVStore(url, chunk_size=chunk_size, kind=kind)


class RedisKVStore(StoreHandle):
    """A KV context whose chunks are values on a Redis server.

    The semantics of :class:`~lmcache_mp.kv.SharedMemoryKVStore` (salted
    prefix-chained keys, checksummed chunks, kinds, staging), shared by
    every process on every host that reaches the server. Usually made by
    ``lmcache_mp.kv.connect("redis://...")``, which also checks the server.
    Thread-safe.

    It pickles by URL, password included (treat the pickle as a secret);
    the copy connects lazily, on one connection pool per process.

    Args:
        url: ``redis://[[USER]:PASSWORD@]HOST[:PORT][/DB][?prefix=NAME&
            timeout=SECONDS]``; prefix default ``lmcache-mp``, timeout 5 s.
        chunk_size: Tokens per chunk.
        kind: The tensor family it caches (see :meth:`for_kind`).

    Raises:
        KVConfigError: If the URL is malformed or ``chunk_size`` is not a
            positive int.
    """

    def __init__(
        self,
        url: str,
        *,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        kind: LMCacheSDKCacheKind = LMCacheSDKCacheKind.KV,
    ) -> None:
        super().__init__(kind, chunk_size)
        target = RedisTarget.parse(url)
        self._fragment = "" if kind is LMCacheSDKCacheKind.KV else f"#{kind.value}"
        self._link = RedisLink(target, target.url(secret=False) + self._fragment)
        self._layout = KnownLayout(f"{self._link.where} {self._key()}")
        self._counts = Counters()

    @property
    def url(self) -> str:
        """The URL that opens this store, password included (``repr`` and
        error messages mask it); ``#query`` marks the query namespace."""
        return self._link.target.url(secret=True) + self._fragment

    @property
    def capacity_bytes(self) -> int:
        """The server's ``maxmemory``, read now: bytes before it evicts least
        recently used keys. 0 means unbounded (no ``maxmemory``: the server
        never evicts), or unknown where its ACL refuses CONFIG and INFO.

        Raises:
            KVStoreConnectionError: If the server cannot be reached.
            KVStoreError: If the store is closed.
        """
        with self._link.errors():
            return server_memory(self._link.open_client()).maxmemory

    @property
    def layout(self) -> Layout | None:
        """``(layers, width, dtype, planes)`` of the stored tensors; ``None``
        until fixed (read from the server while none is known).

        Raises:
            KVStoreConnectionError: If the server cannot be reached.
            KVStoreError: If the layout value is not a layout document.
        """
        if self._layout.layout is None and not self._link.closed:
            with self._link.errors():
                raw = fetch(self._link.open_client(), [self._key()])[0]
            self._layout.adopt(raw)
        return self._layout.layout

    def __repr__(self) -> str:
        return (
            f"RedisKVStore(url={self._link.where!r}, kind={self._kind.name}, "
            f"chunk_size={self._chunk_size})"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        url = self._link.target.url(secret=True)
        return (_reopen, (url, self._chunk_size, self._kind))

    def _key(self, *parts: str) -> str:
        """A key of this kind's namespace; no parts: its layout's key."""
        return ":".join(
            (self._link.target.prefix, self._kind.value, *(parts or ("layout",)))
        )

    def _base(self) -> str:
        """This kind's namespace: ``{prefix}:{kind}``."""
        return f"{self._link.target.prefix}:{self._kind.value}"

    def _chunk_key(self, key: bytes) -> str:
        return self._key("c", key.hex())

    def claims_key(self, name: str) -> str:
        """Return a key for an executor's claims on a phase's jobs.

        Executors that run a phase on several hosts keep their claims
        beside the KV, on the server every worker reaches. The key is in
        the store's prefix (:meth:`destroy` removes it) and outside every
        kind's namespace (no chunk, pin or stat sees it).

        Args:
            name: The phase's claims name, unique to it.

        Returns:
            The key, for use with :meth:`client`.
        """
        return f"{self._link.target.prefix}:claims:{name}"

    def client(self) -> redis.Redis:
        """Return this process's client of the server (made anew in a forked
        child), for keys kept beside the store's such as :meth:`claims_key`.

        Returns:
            A ``redis.Redis`` client, on the handle's pool whether or not
            the handle is closed.

        Raises:
            KVConfigError: If ``redis`` is not installed.
        """
        return self._link.client()

    def ping(self) -> None:
        """Check that the server answers and accepts the credentials (a
        batch calls this when a phase starts).

        Raises:
            KVStoreAuthError: If it refuses the user or password.
            KVStoreConnectionError: If it is down or does not answer in time.
            KVStoreError: If the store is closed.
        """
        with self._link.errors():
            self._link.open_client().ping()

    def _attach(self, layout: Layout | None) -> None:
        """Connect now (``connect``): check the server and fix ``layout``."""
        with self._link.errors():
            conn = self._link.open_client()
            conn.ping()
            memory = server_memory(conn)
        check_policy(memory, self._link.where)
        if layout is not None:
            self._check_layout(layout)

    def for_kind(self, kind: LMCacheSDKCacheKind) -> RedisKVStore:
        """Open the context of another tensor family in this store.

        Each kind has its own keys under the prefix, with the same chunk
        semantics; its layout is fixed by its first store. ``destroy`` of
        the KV context removes every kind.

        Args:
            kind: The family; ``self.kind`` gives an equal new handle.

        Returns:
            A handle on that kind's namespace, on the same connection pool.

        Raises:
            KVStoreError: If this handle is closed.
        """
        return self._open_kind(kind, None)

    def _open_kind(
        self, kind: LMCacheSDKCacheKind, layout: Layout | None
    ) -> RedisKVStore:
        """:meth:`for_kind`, fixing (or checking) that kind's ``layout``."""
        if self._link.closed:
            raise KVStoreError(f"{self._link.where}: the store is closed")
        url = self._link.target.url(secret=True)
        store = RedisKVStore(url, chunk_size=self._chunk_size, kind=kind)
        if layout is not None:
            store._check_layout(layout)
        return store

    def _check_layout(self, wanted: Layout) -> Layout:
        """Fix ``wanted`` as the layout unless one is; raise if it differs."""
        with self._link.errors():
            conn = self._link.open_client()
            raw, _ = probe(conn, self._key(), encode_layout(wanted), [])
        return self._layout.agree(raw, wanted, self._link.where)

    def retrieve(
        self, tokens: Tokens, cache_salt: str = "", *, start: int = 0
    ) -> npt.NDArray[Any] | None:
        """Return the KV of the longest cached chunk-aligned prefix of ``tokens``.

        The layout and every candidate chunk come in one round trip (MGET,
        which also refreshes their recency). A chunk that fails its checks
        is removed and ends the prefix, with a
        :class:`~lmcache_mp.errors.CorruptChunkWarning`.

        Args:
            tokens: The token ids whose KV is wanted.
            cache_salt: Isolation salt; KV stored under another salt is never
                returned.
            start: Return the KV from this token on (a chunk boundary); as
                :meth:`SharedMemoryKVStore.retrieve`.

        Returns:
            A new contiguous ``[P, L, T, D]`` array (``P`` 2 for KV, 1 for
            queries) of the tokens from ``start`` on, with ``T`` a multiple
            of ``chunk_size``, or ``None`` when the chunk at ``start`` is
            not cached.

        Raises:
            TypeError: If ``tokens`` are not ints or ``cache_salt`` not a str.
            ValueError: If a token id is negative.
            KVConfigError: If ``start`` is not a chunk boundary within
                ``tokens``.
            KVStoreConnectionError: If the server cannot be reached.
            KVStoreError: If the store is closed or the server fails.
        """
        size = self._chunk_size
        keys = list(chunk_keys(token_array(tokens), size, cache_salt, start))
        if not keys:
            return None
        with self._link.errors():
            conn = self._link.open_client()
            values = fetch(conn, [self._key(), *map(self._chunk_key, keys)])
        layout = self._layout.adopt(values[0])
        found: list[memoryview] = []
        if layout is not None:
            found, bad = valid_prefix(keys, values[1:], layout, size)
            if bad is not None:
                self._counts.add(corrupt=1)
                name = self._chunk_key(keys[len(found)])
                with self._link.errors():
                    drop_if_same(conn, name, bad[0])
                warn_corrupt(f"{self._link.where} {name}", bad[1])
        self._counts.add(hits=len(found), misses=int(len(found) < len(keys)))
        if layout is None or not found:
            return None
        return join_payloads(found, layout, size)

    def store(
        self,
        kv: Any,
        tokens: Tokens,
        cache_salt: str = "",
        *,
        overwrite: bool = False,
        start: int = 0,
    ) -> bool:
        """Store every full chunk of ``kv`` that is not cached yet.

        Chunks already cached count as used (TOUCH, for the server's LRU);
        new ones are written with SET NX, each atomically. Before the
        server would evict, the store evicts least recently used chunks
        itself, never those pinned by open batches; what does not fit even
        then raises :class:`KVCapacityError` at once. A value at a chunk's
        key that is not a string (planted) is replaced, as a corrupt chunk.

        Args:
            kv: ``[2, L, len(tokens), D]`` (``[1, ...]`` for queries): a numpy
                array, a torch tensor or anything ``np.asarray`` accepts; a
                sub-chunk tail is not stored.
            tokens: The token ids the KV belongs to.
            cache_salt: Isolation salt.
            overwrite: Also replace the chunks already cached (each one
                atomically; one the server refuses is removed, so that no
                prefix mixes old and new chunks).
            start: The first token ``kv`` holds (a chunk boundary); as
                :meth:`SharedMemoryKVStore.store`.

        Returns:
            Whether any chunk was written.

        Raises:
            KVConfigError: If ``start`` is not a chunk boundary within
                ``tokens``, ``kv`` has the wrong shape or dtype, or its
                layout differs from the store's.
            TypeError: If ``kv`` is not an array, ``tokens`` not ints or
                ``cache_salt`` not a str.
            ValueError: If a token id is negative.
            KVCapacityError: If the new chunks do not fit.
            KVStoreConnectionError: If the server cannot be reached.
            KVStoreError: If the store is closed or the server fails.
        """
        written, _ = self._write(
            kv, tokens, cache_salt, overwrite, staged=False, start=start
        )
        return written > 0

    def stage(self, kv: Any, tokens: Tokens, cache_salt: str = "") -> StagedChunks:
        """Write every full chunk of ``kv`` aside, to replace the cached ones
        only when the returned handle is committed.

        Staged values expire after 10 minutes, so a dead worker's staging
        vanishes by itself. :meth:`StagedChunks.commit` moves them all onto
        their chunks in one transaction.

        Args:
            kv: As :meth:`store`.
            tokens: The token ids the KV belongs to.
            cache_salt: Isolation salt.

        Returns:
            The staged chunks; they pickle by the store's URL.

        Raises:
            KVConfigError: As :meth:`store`.
            KVStoreError: If the store is closed, or the server fails or
                cannot hold every staged chunk (nothing is staged then).
        """
        _, moves = self._write(kv, tokens, cache_salt, True, staged=True)
        return StagedChunks(self, tuple(moves))

    def _write(
        self,
        kv: Any,
        tokens: Tokens,
        salt: str,
        overwrite: bool,
        *,
        staged: bool,
        start: int = 0,
    ) -> tuple[int, list[tuple[str, str]]]:
        """Write the chunks of ``kv`` (from token ``start`` on): return how
        many were written, and the ``(staged key, chunk key)`` moves when
        ``staged``."""
        size = self._chunk_size
        arr, toks, wanted = kv_layout(kv, tokens, self._kind, size, start)
        # Indices count from ``start``: they index ``arr``'s chunks.
        keys = list(chunk_keys(toks, size, salt, start))
        names = [self._chunk_key(key) for key in keys]
        with self._link.errors():
            conn = self._link.open_client()
            raw_layout, types = probe(conn, self._key(), encode_layout(wanted), names)
        layout = self._layout.agree(raw_layout, wanted, self._link.where)
        todo, missing, planted = plan_writes(types, staged or overwrite)
        for i in planted:
            self._counts.add(corrupt=1)
            bad = CorruptChunk(f"a Redis {types[i].decode()}, not a string")
            warn_corrupt(f"{self._link.where} {names[i]}", bad)
        raw = as_bytes(arr, layout)
        values = {
            names[i]: encode_chunk(
                keys[i], chunk_views(raw, i * size, (i + 1) * size), layout, size
            )
            for i in todo
        }
        hexes = [key.hex() for key in keys]
        new = todo if staged else missing
        self._make_room(conn, hexes, sum(len(values[names[i]]) for i in new))
        with self._link.errors():
            if staged:
                moves = stage_values(conn, self._key("tmp"), list(values.items()))
                self._counts.add(writes=len(moves))
                return len(moves), moves
            nx = {names[i] for i in missing}
            items = [(name, value, name in nx) for name, value in values.items()]
            written, refused = set_values(conn, items)
            clear_marks(conn, self._base(), [hexes[i] for i in todo])
        self._counts.add(writes=written)
        if refused:
            raise self._capacity_error(sum(map(len, values.values())), -1)
        return written, []

    def _publish(self, moves: Sequence[tuple[str, str]], keep: bool) -> None:
        """Move staged chunks onto their chunks in one transaction (``keep``),
        or delete them; each is a no-op the second time.

        Raises:
            KVStoreError: If a staged chunk expired or was evicted before the
                commit: the cached chunks are left as they were, and the
                rest of the staging is deleted.
        """
        with self._link.errors():
            lost = publish(self._link.open_client(), moves, keep)
        if lost:
            raise KVStoreError(
                f"{self._link.where}: {lost} of {len(moves)} staged chunks "
                "expired or were evicted before the commit; the cached chunks "
                "are unchanged"
            )

    def sweep(self, owner: PinOwner | None = None) -> int:
        """Nothing to remove: a chunk write is one SET (never half done), and
        staged chunks that no one commits expire by themselves.

        Args:
            owner: Accepted for the shared-memory store's signature; a
                batch's uncommitted staging expires like any other.

        Returns:
            0.

        Raises:
            KVStoreError: If the store is closed.
        """
        with self._link.errors():
            self._link.open_client()
        return 0

    def close(self) -> None:
        """Stop using the server through this handle; the store stays.

        Idempotent. A closed handle raises :class:`KVStoreError` when used;
        the process's connection pool stays for its other handles.
        """
        self._link.closed = True

    def destroy(self) -> None:
        """Close this handle and delete the store's keys. Idempotent.

        The KV context deletes every key of its prefix (every kind, staged
        chunks, claims); another kind's context deletes that kind's keys
        (as the shared-memory store removes that kind's directory).

        Raises:
            KVStoreConnectionError: If the server cannot be reached.
            KVStoreError: If the server fails.
        """
        self.close()
        prefix = self._link.target.prefix
        if self._kind is LMCacheSDKCacheKind.KV:
            pattern = f"{prefix}:*"
        else:
            pattern = self._key("*")
        with self._link.errors():
            delete_matching(self._link.client(), pattern)

    def _make_room(self, conn: redis.Redis, hexes: list[str], need: int) -> None:
        """Pin the chunks being written to the current stream's batch, then
        evict unpinned chunks so that ``need`` bytes fit.

        Raises:
            KVCapacityError: If they do not fit even so (nothing written).
        """
        scope = current_scope()
        base = self._base()
        with self._link.errors():
            if scope is not None and scope.owner is not None:
                set_pin(conn, base, scope.owner, scope.stream_id, hexes, add=True)
            maxmemory = server_memory(conn).maxmemory
            keep = set(hexes)
            room = make_room(conn, base, need, maxmemory, keep)
        self._counts.add(evictions=room.evicted, evicted_bytes=room.evicted_bytes)
        if room.fits < len(keep):
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
        expires after the batch's lease unless pinned again.

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
