"""The arena: chunk-file pages allocated and touched before a store needs them.

Writing a new tmpfs file pays for every page the kernel allocates: on the
project's 2-core VM a new file took 2.1 GB/s against 5.5 GB/s for writing
over a file's pages already there (``scripts/copy_ceiling.py``, issue
#20). A store opened with ``arena_bytes`` writes that many bytes of free
files (:mod:`~lmcache_mp.kv._files`), each the size of one chunk file,
as soon as its layout is fixed, so that its writes claim pages that are
already there: LMCache's local CPU backend allocates its buffer at
start-up the same way, and Ray's plasma store its memory. The pages are
written (zeros), not only reserved with ``posix_fallocate``: a VM's host
backs a page only when it is first written, and writes over pages only
reserved ran at 0.7-1.2 GB/s when the memory had not been used lately,
against 4.7-5.1 GB/s over written pages (``scripts/arena_fill.py``); in
the bench the stride edit's stores took 0.7-1.4 s a stream into a
reserved arena and ~0.1 s into a written one. The arena's files count as
used bytes, and are the first to go when room is needed.
"""

from __future__ import annotations

import contextlib
import os

from lmcache_mp.errors import KVCapacityError, KVConfigError, KVStoreError
from lmcache_mp.kv._chunk import pwrite_all
from lmcache_mp.kv._files import Usage, list_free, open_temp, retire

__all__ = ["check_arena", "fill_arena"]

# Zeros written at a time: the arena's pages are touched, not just reserved.
_ZEROS = memoryview(bytes(1 << 20))


def check_arena(arena_bytes: object, capacity: int) -> None:
    """Refuse an arena that is not an int in ``[0, capacity]``.

    Raises:
        KVConfigError: Naming the value and the capacity.
    """
    if isinstance(arena_bytes, bool) or not isinstance(arena_bytes, int):
        raise KVConfigError(f"arena_bytes must be an int >= 0, got {arena_bytes!r}")
    if not 0 <= arena_bytes <= capacity:
        raise KVConfigError(
            f"arena_bytes must be in [0, capacity_bytes = {capacity}], "
            f"got {arena_bytes}"
        )


def fill_arena(
    dir_fd: int, usage: Usage, arena_bytes: int, file_size: int, where: str
) -> int:
    """Allocate free files up to ``arena_bytes`` (those there count).

    Args:
        dir_fd: The store directory.
        usage: The handle's count of the bytes in use.
        arena_bytes: Bytes of free files wanted.
        file_size: Bytes of one chunk file of the store's layout.
        where: The store's URL, for errors.

    Returns:
        How many free files were added.

    Raises:
        KVCapacityError: If they do not fit besides the chunks stored
            (nothing is allocated, nothing evicted).
        KVStoreError: If the filesystem runs out of room meanwhile (what
            was allocated stays, as free files).
    """
    count = arena_bytes // file_size - len(list_free(dir_fd))
    if count <= 0:
        return 0
    # Only room that is free: an arena never evicts cached KV.
    room = usage.make_room(dir_fd, count, file_size, frozenset(), evict=False)
    if room.fits < count:
        raise KVCapacityError(
            f"store {where}: an arena of {count * file_size} more bytes does not "
            f"fit: its capacity is {usage.capacity} bytes, {room.used} are in use "
            "(an arena evicts no KV); nothing was allocated",
            asked=count * file_size,
            allowed=usage.capacity,
        )
    try:
        for _ in range(count):
            _allocate(dir_fd, file_size)
    except OSError as exc:
        raise KVStoreError(f"store {where}: cannot allocate its arena: {exc}") from exc
    finally:
        usage.written(count * file_size)
    return count


def _allocate(dir_fd: int, size: int) -> None:
    """One free file of ``size`` bytes, every page written."""
    tmp, fd = open_temp(dir_fd)
    try:
        for start in range(0, size, len(_ZEROS)):
            pwrite_all(fd, _ZEROS[: size - start], start)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise
    os.close(fd)
    retire(dir_fd, tmp)  # published as a free file
