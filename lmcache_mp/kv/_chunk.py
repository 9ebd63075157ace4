"""The chunk format: a fixed header, a digest, then the raw payload.

Both backends hold chunks in this one format: a chunk file of the
shared-memory store and a value of the Redis store are the same bytes.
The header is built and checked by pure functions (:func:`encode_header`,
:func:`check_chunk`); :func:`write_chunk`/:func:`read_chunk` move chunks
through files, :func:`encode_chunk`/:func:`decode_chunk` through bytes.

Layout of a chunk (little-endian)::

    magic    8s   b"LMCMPKV\\0"
    version  u16  FORMAT_VERSION
    dtype    u16  code from _layout
    layers   u32
    tokens   u32  the store's chunk size
    width    u32
    payload  u64  payload length in bytes
    digest   16s  keyed BLAKE2b-128 of the 32 bytes above + the payload's
                  block sums (u64 each)
    payload       the [planes, layers, tokens, width] elements, C order
                  (planes: 2 for KV, 1 for queries)

The digest is keyed with the chunk's key, so a chunk file renamed to
another key fails as well. It detects corruption, truncation and torn or
misplaced files; it is not a secret, so it does not stop a user who can
write the directory from forging a chunk: the 0700 directory does that.
The payload pass is a sum of the 64-bit words of each 4 KiB block, the
blocks' sums in order (format version 3): numpy adds them several times
faster than CRC-32 (version 2) or BLAKE2b (version 1) hash the payload,
either of which would be the slowest step of a retrieve (see
docs/design.md). A changed, zeroed, truncated or torn block changes its
sum (two changes in one block that cancel exactly are the accident it
misses); BLAKE2b binds the sums, in block order, to the header and the
key.
Payloads are raw elements: reading a chunk never unpickles anything.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import mmap
import os
import stat
import struct
import time
from collections.abc import Iterable, Sequence

import numpy as np
import numpy.typing as npt

from lmcache_mp.kv._arena import kept
from lmcache_mp.kv._files import claim, open_temp, pwrite_all, retire_replaced
from lmcache_mp.kv._layout import Layout, dtype_code

__all__ = [
    "DIGEST_BYTES",
    "FORMAT_VERSION",
    "HEADER_SIZE",
    "BlockSums",
    "CorruptChunk",
    "check_chunk",
    "chunk_digest",
    "chunk_file_size",
    "chunk_payload_size",
    "chunk_views",
    "decode_chunk",
    "encode_chunk",
    "encode_header",
    "read_chunk",
    "write_chunk",
]

MAGIC = b"LMCMPKV\0"
FORMAT_VERSION = 3
_FIELDS = struct.Struct("<8sHHIIIQ")
#: Bytes of the digest, the last part of the header.
DIGEST_BYTES = 16
#: Bytes before the payload: the fields and the digest.
HEADER_SIZE = _FIELDS.size + DIGEST_BYTES
_PERSON = b"lmcache-mp/kvchk"
# The checksum sums the payload's 64-bit little-endian words per block.
_BLOCK = 4096
_WORD = np.dtype("<u8")


class CorruptChunk(Exception):
    """A chunk (file or value) failed a check; the message says which."""


def chunk_file_size(layout: Layout, chunk_size: int) -> int:
    """Bytes of a chunk file of ``layout``: header plus payload."""
    return HEADER_SIZE + chunk_payload_size(layout, chunk_size)


def chunk_payload_size(layout: Layout, chunk_size: int) -> int:
    """Bytes of a chunk's KV (``[planes, L, chunk_size, D]``) of ``layout``."""
    return (
        layout.planes
        * layout.layers
        * chunk_size
        * layout.width
        * layout.dtype.itemsize
    )


def chunk_views(raw: npt.NDArray[np.uint8], start: int, stop: int) -> list[memoryview]:
    """The contiguous pieces of tokens ``[start, stop)`` of a KV, in file order.

    Args:
        raw: A C-contiguous KV viewed as bytes: ``[P, L, T, D * itemsize]``.
        start: First token of the chunk.
        stop: One past its last token.

    Returns:
        ``P * L`` flat byte views, one per (plane, layer), sharing ``raw``'s
        memory, so chunks are written from and read into it without copies.
    """
    return [
        raw[kind, layer, start:stop].data.cast("B")
        for kind in range(raw.shape[0])
        for layer in range(raw.shape[1])
    ]


def _fields(layout: Layout, chunk_size: int) -> bytes:
    return _FIELDS.pack(
        MAGIC,
        FORMAT_VERSION,
        dtype_code(layout.dtype),
        layout.layers,
        chunk_size,
        layout.width,
        chunk_payload_size(layout, chunk_size),
    )


class BlockSums:
    """The 4 KiB block sums of a chunk's payload, fed one piece at a time.

    Blocks run over the concatenation of the pieces, the last one
    zero-padded. A piece whose length is whole blocks (every real layout:
    a chunk's layer is 256 tokens x width x itemsize), after only such
    pieces, is summed as it comes, while it is still in the CPU's cache
    from the copy that just moved it (a second pass over the chunk from
    memory is a measurable share of a store); from the first piece that is
    not, the rest is joined and summed at the end.
    """

    def __init__(self) -> None:
        self._sums: list[bytes] = []
        self._rest: bytearray | None = None

    @classmethod
    def of(cls, payload: Iterable[memoryview]) -> BlockSums:
        """The sums of a whole payload, given as its pieces in order."""
        sums = cls()
        for view in payload:
            sums.add(view)
        return sums

    def add(self, view: memoryview) -> None:
        """Count the next piece of the payload (not kept unless joined)."""
        if self._rest is None and len(view) % _BLOCK == 0:
            self._sums.append(_sum_blocks(view))
        elif self._rest is None:
            self._rest = bytearray(view)
        else:
            self._rest += view

    def digest(self, key: bytes, fields: bytes) -> bytes:
        """The digest a chunk's header holds: keyed BLAKE2b-128 of
        ``fields`` and the block sums, in order."""
        digest = hashlib.blake2b(digest_size=DIGEST_BYTES, key=key, person=_PERSON)
        digest.update(fields)
        for sums in self._sums:
            digest.update(sums)
        if self._rest:
            padded = self._rest + bytes(-len(self._rest) % _BLOCK)
            digest.update(_sum_blocks(memoryview(padded)))
        return digest.digest()


def _sum_blocks(view: memoryview) -> bytes:
    """The little-endian u64 sums of the 4 KiB blocks of ``view`` (whole
    blocks), each the sum of the block's 64-bit words."""
    words = np.frombuffer(view, _WORD).reshape(-1, _BLOCK // 8)
    sums: bytes = words.sum(axis=1, dtype=_WORD).tobytes()
    return sums


def chunk_digest(key: bytes, fields: bytes, payload: Sequence[memoryview]) -> bytes:
    """The digest a chunk's header holds.

    Args:
        key: The chunk's key.
        fields: The packed header fields (the 32 bytes before the digest).
        payload: The payload's bytes, in file order.

    Returns:
        16 bytes: keyed BLAKE2b of ``fields`` and the payload's block sums.
    """
    return BlockSums.of(payload).digest(key, fields)


def encode_header(
    key: bytes, payload: Sequence[memoryview], layout: Layout, chunk_size: int
) -> bytes:
    """The header of a chunk: its fields and their digest.

    A chunk (a file of the shared-memory store, a value of the Redis store)
    is exactly these :data:`HEADER_SIZE` bytes followed by the payload.

    Args:
        key: The chunk's key (keys the digest).
        payload: The chunk's bytes in order, as :func:`chunk_views` returns
            them (or one view of the whole payload).
        layout: The store's layout.
        chunk_size: The store's chunk size.

    Returns:
        :data:`HEADER_SIZE` bytes.
    """
    fields = _fields(layout, chunk_size)
    return fields + chunk_digest(key, fields, payload)


def check_chunk(
    header: bytes | bytearray | memoryview,
    key: bytes,
    sums: BlockSums,
    layout: Layout,
    chunk_size: int,
) -> None:
    """Check a chunk's header against its key, payload and store.

    Args:
        header: The chunk's first :data:`HEADER_SIZE` bytes.
        key: The key it was found under.
        sums: The block sums of the rest of the chunk, its payload.
        layout: The store's layout.
        chunk_size: The store's chunk size.

    Raises:
        CorruptChunk: If the header is short or not this format, describes
            another layout, or its digest does not match the key and payload.
    """
    header = bytes(header)
    if len(header) != HEADER_SIZE:
        raise CorruptChunk(f"header of {len(header)} bytes, expected {HEADER_SIZE}")
    fields = header[: _FIELDS.size]
    magic, version, code, layers, tokens, width, length = _FIELDS.unpack(fields)
    if magic != MAGIC:
        raise CorruptChunk(f"bad magic {magic!r}")
    if version != FORMAT_VERSION:
        raise CorruptChunk(f"format version {version}, expected {FORMAT_VERSION}")
    if fields != _fields(layout, chunk_size):
        raise CorruptChunk(
            f"header (dtype code {code}, layers {layers}, tokens {tokens}, width "
            f"{width}, payload {length}) does not match the store {layout.describe()}"
        )
    digest = sums.digest(key, fields)
    if not hmac.compare_digest(header[_FIELDS.size :], digest):
        raise CorruptChunk("checksum mismatch")


def encode_chunk(
    key: bytes, payload: Sequence[memoryview], layout: Layout, chunk_size: int
) -> bytes:
    """A whole chunk as one bytes object: header, then payload.

    Args:
        key: The chunk's key.
        payload: Its bytes, as :func:`chunk_views` returns them.
        layout: The store's layout.
        chunk_size: The store's chunk size.

    Returns:
        :func:`chunk_file_size` bytes, the same as a chunk file holds.
    """
    return b"".join([encode_header(key, payload, layout, chunk_size), *payload])


def decode_chunk(
    value: bytes, key: bytes, layout: Layout, chunk_size: int
) -> memoryview:
    """Check a whole chunk held in memory and return its payload.

    Args:
        value: The chunk's bytes, e.g. as a Redis GET returned them.
        key: The key it was found under.
        layout: The store's layout.
        chunk_size: The store's chunk size.

    Returns:
        A view of the payload inside ``value`` (``[planes, layers, tokens,
        width]`` elements, C order); never unpickled.

    Raises:
        CorruptChunk: If ``value`` has the wrong size or fails
            :func:`check_chunk`.
    """
    size = chunk_file_size(layout, chunk_size)
    if len(value) != size:
        raise CorruptChunk(f"{len(value)} bytes, expected {size}")
    view = memoryview(value)
    payload = view[HEADER_SIZE:]
    check_chunk(view[:HEADER_SIZE], key, BlockSums.of([payload]), layout, chunk_size)
    return payload


def _put(
    fd: int, mapped: npt.NDArray[np.uint8] | None, view: memoryview, offset: int
) -> None:
    """Write ``view`` at ``offset`` of the file ``fd``, through its kept
    mapping (viewed as bytes) when it has one (:mod:`~lmcache_mp.kv._arena`).

    numpy's copy releases the GIL, as ``pwrite`` does; a slice assignment
    to the ``mmap`` would hold it, and threads writing at once would take
    turns.
    """
    if mapped is None:
        pwrite_all(fd, view, offset)
    else:
        np.copyto(mapped[offset : offset + len(view)], np.frombuffer(view, np.uint8))


def write_chunk(
    dir_fd: int,
    name: str,
    key: bytes,
    payload: Iterable[memoryview],
    layout: Layout,
    chunk_size: int,
    *,
    publish: bool = True,
    free: list[str] | None = None,
) -> str:
    """Write a chunk atomically: a temp file, then a rename onto ``name``.

    A reader sees either no file, a previous complete file, or this one
    complete. The temp file is a free file claimed for reuse when there is
    one (:mod:`~lmcache_mp.kv._files`), written through this process's
    kept mapping of it when it has one (:mod:`~lmcache_mp.kv._arena`), and
    a chunk it replaces is kept for reuse. The file's mtime is set from
    the fine-grained clock so that least-recently-used ordering does not
    tie at the kernel's coarse tick.

    Args:
        dir_fd: The store directory.
        name: The chunk's file name.
        key: The chunk's key (keys the digest).
        payload: The chunk's bytes, as :func:`chunk_views` returns them, or
            an iterator of them, each piece used up before the next is
            asked for (so one staging buffer can hold each in turn).
        layout: The store's layout.
        chunk_size: The store's chunk size.
        publish: Rename the temp file onto ``name`` now; otherwise leave it
            for the caller to rename (a staged write).
        free: Names of free files to try to claim; those tried are removed.

    Returns:
        The temp file's name (already renamed when ``publish``).

    Raises:
        OSError: If the file cannot be written (e.g. the filesystem is full).
    """
    claimed = claim(dir_fd, free, chunk_file_size(layout, chunk_size)) if free else None
    tmp, fd = open_temp(dir_fd) if claimed is None else claimed
    try:
        # Each piece is summed and written while the copy that made it is
        # still in cache; the header, which holds the digest, goes last.
        kept_map = None if claimed is None else kept(os.fstat(fd))
        mapped = None if kept_map is None else np.frombuffer(kept_map, np.uint8)
        sums = BlockSums()
        offset = HEADER_SIZE
        for view in payload:
            sums.add(view)
            _put(fd, mapped, view, offset)
            offset += len(view)
        fields = _fields(layout, chunk_size)
        _put(fd, mapped, memoryview(fields + sums.digest(key, fields)), 0)
        now = time.time_ns()
        os.utime(fd, ns=(now, now))
    except BaseException:
        os.close(fd)
        os.unlink(tmp, dir_fd=dir_fd)
        raise
    os.close(fd)
    if publish:
        retire_replaced(dir_fd, tmp, name)
    return tmp


def _discard(dir_fd: int, name: str, fd: int) -> bool:
    """Remove ``name`` if it is still the file open as ``fd``; return
    whether it was.

    A concurrent writer may have renamed a good chunk onto ``name`` since it
    was opened (or recycled the file that was opened); that one is kept.
    """
    try:
        mine = os.fstat(fd)
        current = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return False
    if (current.st_dev, current.st_ino) != (mine.st_dev, mine.st_ino):
        return False
    with contextlib.suppress(OSError):
        os.unlink(name, dir_fd=dir_fd)
    return True


# Reads of a chunk that keeps changing under the reader, before giving up.
_READ_TRIES = 3


def read_chunk(
    dir_fd: int,
    name: str,
    key: bytes,
    out: list[memoryview],
    layout: Layout,
    chunk_size: int,
) -> None:
    """Read and verify a chunk straight into ``out``, through this
    process's kept mapping of its file when it has one
    (:mod:`~lmcache_mp.kv._arena`); refresh its mtime.

    A chunk that fails a check is removed (so it can be stored again) and
    reported as :class:`CorruptChunk`; ``out`` then holds garbage. A chunk
    that fails because it was replaced or recycled while it was read (the
    name holds another file now) is read again.

    Args:
        dir_fd: The store directory.
        name: The chunk's file name.
        key: The chunk's key.
        out: Where its payload goes, as :func:`chunk_views` returns them.
        layout: The store's layout.
        chunk_size: The store's chunk size.

    Raises:
        FileNotFoundError: If there is no such chunk (a miss).
        CorruptChunk: If the file is not a valid chunk of this key.
    """
    size = chunk_file_size(layout, chunk_size)
    for attempt in range(_READ_TRIES):
        fd = _open_chunk(dir_fd, name)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size != size:
                raise CorruptChunk(f"{st.st_size} bytes, expected {size}")
            mapped = kept(st)
            if mapped is None:
                header, sums = _read_mapped(fd, size, out)
            else:
                header, sums = _copy_out(mapped, out)
            check_chunk(header, key, sums, layout, chunk_size)
            # The mtime is the recency that eviction orders by; best effort.
            now = time.time_ns()
            with contextlib.suppress(OSError):
                os.utime(fd, ns=(now, now))
            return
        except CorruptChunk:
            if _discard(dir_fd, name, fd) or attempt == _READ_TRIES - 1:
                raise
        finally:
            os.close(fd)


def _read_mapped(fd: int, size: int, out: list[memoryview]) -> tuple[bytes, BlockSums]:
    """Copy a chunk file of ``size`` bytes (its size checked) through a
    mapping of it: the payload into ``out``, each piece summed while it is
    still in cache; return the header and the sums.

    A copy out of a mapping is faster than ``readv`` on tmpfs, most on its
    huge pages, where it reaches memcpy (``scripts/copy_ceiling.py``
    measures it). Chunk files are never
    truncated in place (a recycled one is overwritten at its size), so the
    mapping never reaches past the file's end.
    """
    with mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ) as mapped:
        return _copy_out(mapped, out)


def _copy_out(mapped: mmap.mmap, out: list[memoryview]) -> tuple[bytes, BlockSums]:
    """Copy a mapped chunk file's payload into ``out``, each piece summed
    while still in cache; return its header and the sums."""
    src = np.frombuffer(mapped, np.uint8)
    header = src[:HEADER_SIZE].tobytes()
    sums = BlockSums()
    start = HEADER_SIZE
    for view in out:
        stop = start + len(view)
        np.copyto(np.frombuffer(view, np.uint8), src[start:stop])
        sums.add(view)
        start = stop
    return header, sums


def _open_chunk(dir_fd: int, name: str) -> int:
    """Open a chunk file for reading, never through a symlink, and never
    blocking: a FIFO or device planted at a chunk's name opens at once
    (``O_NONBLOCK``) and is then refused as not a regular file.

    Raises:
        FileNotFoundError: If there is no such chunk.
        CorruptChunk: If a symlink stands there (it is removed).
    """
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        return os.open(name, flags, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        # A symlink planted where a chunk belongs: never followed.
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=dir_fd)
        raise CorruptChunk("is a symlink") from exc
