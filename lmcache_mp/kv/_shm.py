"""The embedded shared-memory KV store: chunk files every process reads.

Reads fill one new KV straight from the chunk files of a prefix
(:func:`~lmcache_mp.kv._chunk.read_chunk`), stopping at the first chunk
that is missing or fails its check. Writes go through a temp file (a free
file claimed for reuse when there is one) renamed onto the chunk's name,
or left staged for the batch to publish. Pins and eviction marks are files
of the directory (:mod:`~lmcache_mp.kv._files`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
import weakref
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from lmcache_mp.cache_kind import LMCacheSDKCacheKind
from lmcache_mp.errors import KVStoreError
from lmcache_mp.kv._arena import check_arena, fill_arena, keep_arena
from lmcache_mp.kv._buffers import (
    check_reserve_tokens,
    contiguous,
    empty_kv,
    reserve_kv,
)
from lmcache_mp.kv._chunk import (
    CorruptChunk,
    chunk_file_size,
    chunk_views,
    read_chunk,
    write_chunk,
)
from lmcache_mp.kv._common import (
    StagedChunks,
    StoreHandle,
    capacity_error,
    check_positive,
    chunk_payloads,
    kv_layout,
    require_layout,
    warn_corrupt,
)
from lmcache_mp.kv._files import (
    CHUNK_SUFFIX,
    DirHandle,
    Usage,
    clear_evicted,
    evict_lru,
    is_evicted,
    kind_location,
    list_chunks,
    list_free,
    live_pins,
    open_store_dir,
    remove_free,
    remove_pins,
    remove_stale_temps,
    remove_store_dir,
    retire,
    retire_replaced,
    staged_name,
    write_pin,
)
from lmcache_mp.kv._keys import Tokens, chunk_keys, token_array
from lmcache_mp.kv._layout import Layout, load_layout, publish_layout
from lmcache_mp.kv._pins import PinOwner, PinScope, current_scope
from lmcache_mp.kv._stats import Counters, StoreStats

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "SharedMemoryKVStore",
    "StagedChunks",
    "Touched",
    "publish_staged",
    "read_prefix",
    "store_stats",
    "touch_chunks",
    "write_chunks",
]


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
        (capacity less the chunks and the free files kept for reuse, at
        most what the filesystem has free plus those files).
    """
    entries = list_chunks(dir_fd)
    pinned = live_pins(dir_fd)
    used = sum(e.size for e in entries)
    spare = sum(e.size for e in list_free(dir_fd))
    # A capacity may exceed what the filesystem has left (other stores and
    # programs share a tmpfs): new chunks fit in its free pages and in the
    # free files kept for reuse, whichever the capacity allows.
    fs = os.fstatvfs(dir_fd)
    room = fs.f_bavail * fs.f_frsize + spare
    return counts.snapshot(
        len(entries),
        used,
        capacity_bytes=capacity,
        pinned_bytes=sum(e.size for e in entries if e.name in pinned),
        free_bytes=max(0, min(capacity - used - spare, room)),
    )


class Touched(NamedTuple):
    """The chunks of a KV given to ``store``, sorted by :func:`touch_chunks`."""

    #: Each chunk's key and file name, in order.
    keys: list[bytes]
    names: list[str]
    #: Indices of the chunks not cached, and of those cached.
    missing: list[int]
    present: list[int]


def touch_chunks(dir_fd: int, keys: Iterable[bytes]) -> Touched:
    """Mark each cached chunk of ``keys`` used now (its recency, for
    eviction) and sort the chunks into missing and present.

    Args:
        dir_fd: The store directory.
        keys: The chunks' keys, in order.

    Returns:
        The chunks, with indices counted from the first key.
    """
    touched = Touched([], [], [], [])
    now = time.time_ns()
    for index, key in enumerate(keys):
        name = key.hex() + CHUNK_SUFFIX
        touched.keys.append(key)
        touched.names.append(name)
        try:
            os.utime(name, ns=(now, now), dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            touched.missing.append(index)
        else:
            touched.present.append(index)
    return touched


def write_chunks(
    dir_fd: int,
    path: str,
    counts: Counters,
    arr: Any,
    layout: Layout,
    chunk_size: int,
    chunks: Sequence[tuple[int, str, bytes]],
    stage_for: str | None = None,
) -> list[tuple[str, str]]:
    """Write some chunks of a KV into a store directory.

    Args:
        dir_fd: The store directory.
        path: Its path (named in errors).
        counts: The handle's counters (one write per chunk).
        arr: The KV, checked against ``layout``.
        layout: The store's layout.
        chunk_size: The store's chunk size.
        chunks: ``(index along the tokens, file name, key)`` of each chunk.
        stage_for: ``None`` to rename each chunk onto its name now; else
            the tag of the batch that will publish them, to which each
            chunk is left staged (:func:`~lmcache_mp.kv._files.staged_name`).

    Returns:
        The ``(staged, chunk)`` names of the chunks left unpublished.

    Raises:
        KVStoreError: If a chunk cannot be written.
    """
    moves: list[tuple[str, str]] = []
    try:
        _write_all(
            dir_fd, path, counts, arr, layout, chunk_size, chunks, stage_for, moves
        )
    except BaseException:
        # What was staged before the failure has no publisher any more.
        publish_staged(dir_fd, path, moves, keep=False)
        raise
    return moves


def _write_all(
    dir_fd: int,
    path: str,
    counts: Counters,
    arr: Any,
    layout: Layout,
    chunk_size: int,
    chunks: Sequence[tuple[int, str, bytes]],
    stage_for: str | None,
    moves: list[tuple[str, str]],
) -> None:
    """The loop of :func:`write_chunks`; appends each staged chunk to
    ``moves`` as it is made."""
    free = [entry.name for entry in list_free(dir_fd)]
    names = {index: (name, key) for index, name, key in chunks}
    for index, views in chunk_payloads(arr, layout, chunk_size, list(names)):
        name, key = names[index]
        try:
            tmp = write_chunk(
                dir_fd,
                name,
                key,
                views,
                layout,
                chunk_size,
                publish=stage_for is None,
                free=free,
            )
            if stage_for is not None:
                # Leased to the publisher: the writer (a pool worker) may be
                # gone before the parent publishes the stream's edit.
                staged = staged_name(stage_for)
                os.rename(tmp, staged, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
                moves.append((staged, name))
        except OSError as exc:
            raise KVStoreError(f"{path}/{name}: cannot write chunk: {exc}") from exc
        counts.add(writes=1)
        clear_evicted(dir_fd, name)


def publish_staged(
    dir_fd: int, path: str, moves: Sequence[tuple[str, str]], keep: bool
) -> None:
    """Rename staged files onto their chunks (``keep``) or drop them; the
    files replaced or dropped are kept for reuse.

    Every staged file is checked before any is renamed, so that a stream
    whose staging was lost keeps its old chunks, never a mix of old and new.

    Args:
        dir_fd: The store directory.
        path: Its path (named in errors).
        moves: ``(staged name, chunk name)`` of each staged chunk.
        keep: Publish (``True``) or discard.

    Raises:
        KVStoreError: If ``keep`` and a staged file is gone (the store was
            swept by hand, or its publisher's lease looked expired); the
            rest are discarded and the cached chunks stay as they were.
    """
    if keep:
        lost = [tmp for tmp, _ in moves if not _exists(dir_fd, tmp)]
        if lost:
            publish_staged(dir_fd, path, moves, keep=False)
            raise KVStoreError(
                f"{path}: {len(lost)} of {len(moves)} staged chunks are gone "
                "before the commit; the cached chunks are unchanged"
            )
    for tmp, name in moves:
        with contextlib.suppress(FileNotFoundError):
            if keep:
                retire_replaced(dir_fd, tmp, name)
            else:
                retire(dir_fd, tmp)


def _exists(dir_fd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


#: Tokens per chunk, as LMCache's default.
DEFAULT_CHUNK_SIZE = 256


def _reopen(
    path: str,
    url: str,
    chunk_size: int,
    capacity_bytes: int,
    kind: LMCacheSDKCacheKind = LMCacheSDKCacheKind.KV,
) -> SharedMemoryKVStore:
    return SharedMemoryKVStore(
        path, url=url, chunk_size=chunk_size, capacity_bytes=capacity_bytes, kind=kind
    )


class SharedMemoryKVStore(StoreHandle):
    """A KV context whose chunks are files in a private shared directory.

    Every process on the machine that opens the same directory shares the
    cache: reads and writes go straight to the files, never through a pipe.
    Usually made by :func:`lmcache_mp.kv.connect`. Thread-safe.

    A store pickles by location only; the copy reconnects lazily in the
    process that unpickles it and never removes the directory on close.

    Args:
        path: The store directory (created by ``connect``).
        url: The URL it was opened by, e.g. ``"shm:///name"``.
        chunk_size: Tokens per chunk.
        capacity_bytes: Chunk bytes kept before least recently used chunks
            are evicted.
        owner: Whether this handle owns the directory: closing it, garbage
            collecting it or leaving the interpreter then removes it.
        kind: The tensor family it caches: ``KV`` (``[2, L, T, D]``) or
            ``QUERY`` (``[1, L, T, D]``); see :meth:`for_kind`.
        arena_bytes: Bytes of chunk files this handle writes as soon as
            the layout is fixed, for writes to fill (:mod:`._arena`).

    Raises:
        KVConfigError: If ``chunk_size`` or ``capacity_bytes`` is not a
            positive int, or ``arena_bytes`` not in ``[0, capacity_bytes]``.
    """

    def __init__(
        self,
        path: str,
        *,
        url: str,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        capacity_bytes: int,
        owner: bool = False,
        kind: LMCacheSDKCacheKind = LMCacheSDKCacheKind.KV,
        arena_bytes: int = 0,
    ) -> None:
        super().__init__(kind, chunk_size)
        check_positive("capacity_bytes", capacity_bytes)
        check_arena(arena_bytes, capacity_bytes)
        # Allocated once, by this handle only (a copy unpickled elsewhere
        # does not carry it).
        self._arena = arena_bytes
        self._path = path
        self._url = url
        self._handle = DirHandle(path, owner)
        self._finalizer = weakref.finalize(self, self._handle.cleanup)
        self._lock = threading.Lock()
        self._closed = False
        self._layout: Layout | None = None
        # Whether this handle has had the store's arena mapped.
        self._mapped = False
        self._usage = Usage(capacity_bytes)
        self._counts = Counters()

    @property
    def path(self) -> str:
        """The store directory."""
        return self._path

    @property
    def url(self) -> str:
        """The URL that opens this store, e.g. ``"shm:///name"``."""
        return self._url

    @property
    def capacity_bytes(self) -> int:
        """Chunk bytes kept before least recently used chunks are evicted."""
        return self._usage.capacity

    @property
    def layout(self) -> Layout | None:
        """``(layers, width, dtype, planes)`` of the stored tensors; ``None``
        until fixed."""
        if self._layout is None and not self._closed:
            self._layout = load_layout(self._dir_fd(), self._path)
        return self._layout

    def __repr__(self) -> str:
        return (
            f"SharedMemoryKVStore(url={self._url!r}, path={self._path!r}, "
            f"chunk_size={self._chunk_size})"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            _reopen,
            (
                self._path,
                self._url,
                self._chunk_size,
                self._usage.capacity,
                self._kind,
            ),
        )

    def for_kind(self, kind: LMCacheSDKCacheKind) -> SharedMemoryKVStore:
        """Open the context of another tensor family in this store.

        Each kind lives in its own namespace (a subdirectory), with the same
        chunk keys, checksums, atomic writes and eviction, so that the
        queries of a prompt never answer for its KV (upstream namespaces
        the model name by kind). Its layout is fixed by its first store.
        Each namespace keeps this handle's capacity for itself: a store of
        two kinds may hold up to twice ``capacity``.
        Removing the store (``destroy``, or closing a temporary one) removes
        every kind.

        Args:
            kind: The family; ``self.kind`` gives an equal new handle.

        Returns:
            A handle on that kind's namespace (not owning the store).

        Raises:
            KVStoreError: If the store is closed or the namespace cannot be
                created.
        """
        return self._open_kind(kind, None)

    def _open_kind(
        self, kind: LMCacheSDKCacheKind, layout: Layout | None
    ) -> SharedMemoryKVStore:
        """:meth:`for_kind`, fixing (or checking) that kind's ``layout``."""
        path, url = kind_location(self._path, self._url, self._kind, kind)
        self._dir_fd()  # the store must be open (and exist) first
        store = SharedMemoryKVStore(
            path,
            url=url,
            chunk_size=self._chunk_size,
            capacity_bytes=self._usage.capacity,
            kind=kind,
        )
        try:
            store._attach(create=True, layout=layout)
        except BaseException:
            store.close()
            raise
        return store

    def _attach(self, create: bool, layout: Layout | None) -> None:
        """Open the directory now (creating it) and fix ``layout`` if given."""
        fd = self._dir_fd(create=create)
        if layout is not None:
            self._check_layout(fd, layout)

    def _dir_fd(self, create: bool = False) -> int:
        with self._lock:
            if self._closed:
                raise KVStoreError(f"{self._url}: the store is closed")
            if self._handle.fd is None:
                fd = open_store_dir(self._path, create)
                try:
                    remove_stale_temps(fd)
                except OSError:
                    os.close(fd)
                    raise
                self._handle.fd = fd
            return self._handle.fd

    def _check_layout(self, fd: int, wanted: Layout) -> Layout:
        layout = self._layout
        if layout is None:
            layout = load_layout(fd, self._path) or publish_layout(
                fd, self._path, wanted
            )
            self._layout = layout
        checked = require_layout(layout, wanted, self._url)
        if self._arena:  # a store's hot path takes no lock once it is filled
            with self._lock:
                arena, self._arena = self._arena, 0
            size = chunk_file_size(layout, self._chunk_size)
            fill_arena(fd, self._usage, arena, size, self._url)
        if not self._mapped:
            self._keep_arena(fd, layout)
        return checked

    def map_arena(self, *, reserve_tokens: int = 0) -> int:
        """Map the store's arena in this process now, as its first read or
        write here would.

        Each process keeps the files of a store with an arena mapped, to
        copy through them at memcpy's speed, from its first call (mapping
        them takes a moment per GiB; see docs/design.md). In a batch's
        ``preload``, each worker maps them as the pool starts instead.

        Args:
            reserve_tokens: Also touch this process's buffers for two
                retrieves of this many tokens now, so that they fill pages
                already touched (:mod:`._reserve`). 0: none.

        Returns:
            How many of the store's files this process keeps mapped (0 for
            a store without an arena, or before its layout is fixed).

        Raises:
            KVStoreError: If the store is closed.
            KVConfigError: If ``reserve_tokens`` is not an int >= 0.
        """
        check_reserve_tokens(reserve_tokens)
        fd = self._dir_fd()
        layout = self.layout
        if layout is None:
            return 0
        reserve_kv(layout, self._chunk_size, reserve_tokens)
        return self._keep_arena(fd, layout)

    def _keep_arena(self, fd: int, layout: Layout) -> int:
        """:meth:`map_arena` with the directory and layout already at hand."""
        self._mapped = True
        return keep_arena(fd, chunk_file_size(layout, self._chunk_size))

    def retrieve(
        self, tokens: Tokens, cache_salt: str = "", *, start: int = 0
    ) -> npt.NDArray[Any] | None:
        """Return the KV of the longest cached chunk-aligned prefix of ``tokens``.

        Each chunk is read straight into its place in the result. A chunk
        that fails its checksum is removed and ends the prefix, with a
        :class:`~lmcache_mp.errors.CorruptChunkWarning`.

        Args:
            tokens: The token ids whose KV is wanted.
            cache_salt: Isolation salt; KV stored under another salt is never
                returned.
            start: Return the KV from this token on (a chunk boundary), for
                an engine that loads a long prefix a chunk at a time, as
                LMCache's ``retrieve`` mask skips the tokens a caller
                holds. The chunks before it are not read.

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
            KVStoreError: If the store is closed or cannot be read.
        """
        toks = token_array(tokens)
        size = self._chunk_size
        keys = chunk_keys(toks, size, cache_salt, start)
        if len(toks) - start < size:
            return None
        fd = self._dir_fd()
        layout = self.layout
        if layout is None:
            self._counts.add(misses=1)
            return None
        if not self._mapped:
            self._keep_arena(fd, layout)
        wanted = (len(toks) - start) // size
        return read_prefix(fd, self._path, self._counts, layout, size, keys, wanted)

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

        Chunks already cached count as used (for eviction). When the new
        chunks do not fit, least recently used chunks of other prefixes are
        evicted, never chunks pinned by open batches; when they do not fit
        even then, nothing is stored and :class:`KVCapacityError` is raised
        at once.

        Args:
            kv: ``[2, L, len(tokens), D]``: a numpy array, a torch tensor or
                anything ``np.asarray`` accepts; a sub-chunk tail is not
                stored.
            tokens: The token ids the KV belongs to.
            cache_salt: Isolation salt.
            overwrite: Also replace the chunks already cached (each one
                atomically): how an edit that keeps the tokens, such as
                quantization, lands in the store.
            start: The first token ``kv`` holds (a chunk boundary): ``kv``
                is then ``[2, L, len(tokens) - start, D]``, so that an
                engine offloads a prefill a chunk at a time, as LMCache's
                ``store`` mask skips a stored prefix. The
                chunks before it are left as they are.

        Returns:
            Whether any chunk was written.

        Raises:
            KVConfigError: If ``start`` is not a chunk boundary within
                ``tokens``, ``kv`` is not ``[2, L, len(tokens) - start,
                D]``, its dtype is not float32/float16/bfloat16, or its
                layout differs from the store's.
            TypeError: If ``kv`` is not an array, ``tokens`` not ints or
                ``cache_salt`` not a str.
            ValueError: If a token id is negative.
            KVCapacityError: If the new chunks do not fit (naming the stream
                when called for one).
            KVStoreError: If the store is closed or a chunk cannot be written.
        """
        wrote, _ = self._write(
            kv, tokens, cache_salt, overwrite, publish=True, start=start
        )
        return wrote

    def stage(self, kv: Any, tokens: Tokens, cache_salt: str = "") -> StagedChunks:
        """Write every full chunk of ``kv`` aside, to replace the cached ones
        only when the returned handle is committed.

        How a batch makes a same-token edit transactional: the worker stages
        it, and the parent commits it with the stream's new state, or
        discards it when the stream failed. The staged files are leased to
        the batch's process (to the calling process outside a batch), not
        to the writer: a worker may be gone before the parent commits. They
        are removed once that process is gone, the next time the store is
        opened or swept.

        Args:
            kv: As :meth:`store`.
            tokens: The token ids the KV belongs to.
            cache_salt: Isolation salt.

        Returns:
            The staged chunks; they pickle by the store's location.

        Raises:
            KVConfigError: As :meth:`store`.
            KVStoreError: If the store is closed or a chunk cannot be written.
        """
        _, moves = self._write(kv, tokens, cache_salt, True, publish=False)
        return StagedChunks(self, tuple(moves))

    def _publish(self, moves: Sequence[tuple[str, str]], keep: bool) -> None:
        """See :func:`publish_staged`."""
        publish_staged(self._dir_fd(), self._path, moves, keep)

    def _write(
        self,
        kv: Any,
        tokens: Tokens,
        cache_salt: str,
        overwrite: bool,
        *,
        publish: bool,
        start: int = 0,
    ) -> tuple[bool, list[tuple[str, str]]]:
        """Write the chunks of ``kv`` (from token ``start`` on); return
        whether any was written and the (staged, chunk) names of those left
        unpublished."""
        size = self._chunk_size
        arr, toks, wanted = kv_layout(kv, tokens, self._kind, size, start)
        fd = self._dir_fd()
        layout = self._check_layout(fd, wanted)
        # Indices count from ``start``: they index ``arr``'s chunks.
        keys, names, missing, present = touch_chunks(
            fd, chunk_keys(toks, size, cache_salt, start)
        )
        rewrite = present if overwrite else []
        if not missing and not rewrite:
            return False, []
        scope = current_scope()
        if scope is not None and scope.owner is not None:
            # Pinned before written: no other write may evict them meanwhile.
            write_pin(fd, scope.owner, scope.stream_id, names, add=True)
        file_size = chunk_file_size(layout, size)
        room = self._usage.make_room(fd, len(missing), file_size, frozenset(names))
        self._counts.add(evictions=room.evicted, evicted_bytes=room.evicted_bytes)
        if room.fits < len(missing):
            raise capacity_error(
                self._url,
                scope,
                len(missing) * file_size,
                room.pinned,
                room.used,
                self._usage.capacity,
                "Raise it with connect(url, capacity_bytes=...)",
            )
        chunks = [(i, names[i], keys[i]) for i in missing + rewrite]
        stage_for = None if publish else _publisher(scope)
        try:
            try:
                moves = write_chunks(
                    fd, self._path, self._counts, arr, layout, size, chunks, stage_for
                )
            except KVStoreError as exc:
                # The filesystem is full below the capacity (other stores or
                # programs share it): make the room from this store's least
                # recently used unpinned chunks, as the capacity would, and
                # write once more.
                if not (
                    isinstance(exc.__cause__, OSError)
                    and exc.__cause__.errno == errno.ENOSPC
                    and self._evict_for(fd, len(chunks) * file_size, frozenset(names))
                ):
                    raise
                moves = write_chunks(
                    fd, self._path, self._counts, arr, layout, size, chunks, stage_for
                )
        finally:
            self._usage.written(len(missing) * file_size)
        return True, moves

    def _evict_for(self, fd: int, need: int, keep: frozenset[str]) -> bool:
        """Evict least recently used unpinned chunks (free files first)
        until ``need`` more bytes fit in what the store uses now; return
        whether anything went."""
        used = sum(e.size for e in list_chunks(fd)) + sum(e.size for e in list_free(fd))
        evicted, freed, left, _ = evict_lru(fd, need, used, keep)
        self._counts.add(evictions=evicted, evicted_bytes=freed)
        return left < used

    def sweep(self, owner: PinOwner | None = None) -> int:
        """Remove the temp files of writers that died mid-write and the
        staged chunks whose publisher is gone; opening a store does this too.

        Args:
            owner: A batch whose phase is over: its staged chunks that were
                not committed (their stream failed or was run again) go too.

        Returns:
            How many files were removed.

        Raises:
            KVStoreError: If the store is closed.
        """
        tag = None if owner is None else owner.tag()
        return remove_stale_temps(self._dir_fd(), tag)

    def stats(self) -> StoreStats:
        """Return the store's size and this handle's counters.

        Raises:
            KVStoreError: If the store is closed.
        """
        return store_stats(self._dir_fd(), self._counts, self._usage.capacity)

    def close(self) -> None:
        """Release the directory; remove it if this handle owns it.

        Idempotent. A closed store raises :class:`KVStoreError` when used.
        """
        with self._lock:
            self._closed = True
        self._finalizer()

    def destroy(self) -> None:
        """Close this handle and remove the store directory with every chunk.

        Idempotent, and safe when the directory is already gone. Other
        processes using the store then fail to open it.

        Raises:
            KVStoreSecurityError: If the path has been replaced by a symlink.
            KVStoreError: If the directory cannot be removed.
        """
        self.close()
        remove_store_dir(self._path)

    def _names(self, tokens: Tokens, cache_salt: str) -> list[str]:
        """The chunk file names of every full chunk of ``tokens``."""
        keys = chunk_keys(token_array(tokens), self._chunk_size, cache_salt)
        return [key.hex() + CHUNK_SUFFIX for key in keys]

    def pin(
        self, owner: PinOwner, stream_id: str, tokens: Tokens, cache_salt: str = ""
    ) -> None:
        """Pin the chunks of ``tokens`` for one stream of a batch, replacing
        what was pinned for it; eviction never removes pinned chunks.

        A batch calls this for its member streams; the pin lasts
        until :meth:`unpin`, or until the process holding the batch is gone.

        Args:
            owner: The batch.
            stream_id: The stream.
            tokens: Its tokens (chunks not stored yet are pinned for when
                they are).
            cache_salt: Its salt.

        Raises:
            KVStoreError: If the store is closed or the pin cannot be written.
        """
        fd = self._dir_fd()
        names = self._names(tokens, cache_salt)
        try:
            try:
                write_pin(fd, owner, stream_id, names, False)
            except OSError as exc:
                # A full filesystem: give pages back from what no batch
                # holds, as a chunk write does, and pin once more.
                if exc.errno != errno.ENOSPC or not self._give_pages_back(
                    fd, frozenset(names)
                ):
                    raise
                write_pin(fd, owner, stream_id, names, False)
        except OSError as exc:
            raise KVStoreError(f"{self._url}: cannot pin KV: {exc}") from exc

    def _give_pages_back(self, fd: int, keep: frozenset[str]) -> bool:
        """Return pages to the filesystem: the free files kept for reuse,
        else the least recently used unpinned chunk's; whether any went."""
        if not list_free(fd):
            self._evict_for(fd, 1, keep)
        free = list_free(fd)
        for entry in free:
            remove_free(fd, entry.name)
        return bool(free)

    def unpin(self, owner: PinOwner, stream_id: str | None = None) -> None:
        """Release the pins of one stream of a batch, or all of the batch's.

        Raises:
            KVStoreError: If the store is closed.
        """
        remove_pins(self._dir_fd(), owner, stream_id)

    def was_evicted(self, tokens: Tokens, cache_salt: str = "", start: int = 0) -> bool:
        """Whether the chunk of ``tokens`` that begins at token ``start`` was
        evicted and not stored since: the KV was there and will not come
        back by waiting.

        Args:
            tokens: The token ids.
            cache_salt: Isolation salt.
            start: A multiple of ``chunk_size``.

        Raises:
            KVStoreError: If the store is closed.
        """
        names = self._names(tokens, cache_salt)
        index = start // self._chunk_size
        return index < len(names) and is_evicted(self._dir_fd(), names[index])


def _publisher(scope: PinScope | None) -> str:
    """The tag of the process that will publish a staged write: the batch
    the stream runs for, or (outside a batch) the calling process."""
    owner = scope.owner if scope is not None else None
    return (owner or PinOwner.new()).tag()
