"""The arena: chunk-file pages written before a store needs them, and kept
mapped in each process that uses them.

Writing a new tmpfs file pays for every page the kernel allocates; writing
over a file's pages already there is several times faster
(docs/benchmarks/2026-12-06-store-pages.md). A store opened with
``arena_bytes`` writes that many bytes of free files
(:mod:`~lmcache_mp.kv._files`), each the size of one chunk file, as soon as
its layout is fixed, so that its writes claim pages that are already
there: LMCache's local CPU backend allocates its buffer at start-up the
same way, and Ray's plasma store its memory. The pages are written
(zeros), not only reserved with ``posix_fallocate``: a VM's host backs a
page only when it is first written. The arena's files count as used
bytes, and are the first to go when room is needed.

Copying a chunk through a mapping made for that one copy pays for building
the mapping's page tables page by page; a store with an arena reuses the
same files for its whole life, so each process maps its chunk and free
files once, on its first read or write of the store, and copies through
those mappings from then on, as Ray's plasma store maps its one arena once
per client. A mapping is found by its file's ``(device, inode)``, so it
follows the file through renames (a free file claimed, a chunk retired);
what it holds is checked by the chunk's digest as on every read. The
mappings of a removed store are dropped at the next first call of a handle
in this process, and the library empties a file
(:func:`~lmcache_mp.kv._files.punch`) before it removes it, so that a
mapping outliving its file in an idle process holds no memory; a store
removed by other means (``rm -r``) is held until then. Files created later
(no free file was left) are read and written without a kept mapping."""

from __future__ import annotations

import contextlib
import mmap
import os
import stat
import threading

from lmcache_mp.errors import KVCapacityError, KVConfigError, KVStoreError
from lmcache_mp.kv._files import (
    CHUNK_SUFFIX,
    FREE_PREFIX,
    Usage,
    list_free,
    open_temp,
    pwrite_all,
    retire,
    scan_dir,
)

__all__ = ["check_arena", "fill_arena", "keep_arena", "kept"]


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


_FileId = tuple[int, int]

# Mappings kept per process, across stores: each is one of the process's
# memory areas (vm.max_map_count, 65,530 by default), which other
# allocations need too. Llama-3-8B's 32 MiB chunk files make it 128 GiB.
_MAX_FILES = 4096

# Linux builds the page tables at once: one call instead of a fault per
# 64 KiB later.
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


class _Registry:
    """This process's kept mappings, by store directory and by file."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        # A store directory -> a descriptor of it (its link count drops to 0
        # once it is removed) and the files of it that are mapped.
        self.dirs: dict[_FileId, tuple[int, list[_FileId]]] = {}
        self.files: dict[_FileId, mmap.mmap] = {}

    def drop_removed(self) -> None:
        """Forget the mappings of store directories removed since."""
        for key, (fd, files) in list(self.dirs.items()):
            with contextlib.suppress(OSError):
                if os.fstat(fd).st_nlink:
                    continue
            del self.dirs[key]
            os.close(fd)
            for file in files:
                # Closed by the garbage collector once no copy uses it
                # (closing it under a copy in another thread would fail).
                self.files.pop(file, None)


_registry = _Registry()


def _reset_after_fork() -> None:
    # The mappings stay valid in a forked child; only the lock may have
    # been held by a thread that does not exist there.
    _registry.lock = threading.Lock()


os.register_at_fork(after_in_child=_reset_after_fork)


def keep_arena(dir_fd: int, file_size: int) -> int:
    """Map the chunk and free files of a store with an arena, once per
    process and store; a store without free files, or with more files than
    this process may still map, is left unmapped (a handle asks once:
    :class:`~lmcache_mp.kv.SharedMemoryKVStore`).

    Args:
        dir_fd: The store directory.
        file_size: Bytes of one chunk file of its layout.

    Returns:
        How many of its files this process keeps mapped.
    """
    st = os.fstat(dir_fd)
    key = (st.st_dev, st.st_ino)
    reg = _registry
    with reg.lock:
        reg.drop_removed()
        if key in reg.dirs:
            return len(reg.dirs[key][1])
        names = _arena_names(dir_fd)
        if names is None or len(names) + len(reg.files) > _MAX_FILES:
            return 0
        files = _map_all(dir_fd, names, file_size)
        reg.dirs[key] = (os.dup(dir_fd), list(files))
        reg.files.update(files)
        return len(files)


def kept(st: os.stat_result) -> mmap.mmap | None:
    """The kept mapping of the file ``st`` describes, if it is of its size."""
    mapped = _registry.files.get((st.st_dev, st.st_ino))
    if mapped is None or len(mapped) != st.st_size:
        return None
    return mapped


def _arena_names(dir_fd: int) -> list[str] | None:
    """The chunk and free files of a directory, or ``None`` when it has no
    free file (no arena: nothing worth mapping for good)."""
    names: list[str] = []
    free = False
    with scan_dir(dir_fd) as entries:
        for entry in entries:
            if entry.name.startswith(FREE_PREFIX):
                free = True
                names.append(entry.name)
            elif entry.name.endswith(CHUNK_SUFFIX):
                names.append(entry.name)
    return names if free else None


def _map_all(dir_fd: int, names: list[str], size: int) -> dict[_FileId, mmap.mmap]:
    """Map each of ``names`` that is a regular file of ``size`` bytes of
    this user, its page tables built now (``MAP_POPULATE``)."""
    maps: dict[_FileId, mmap.mmap] = {}
    # Non-blocking: a FIFO at a chunk's name must not hang the mapping.
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    for name in names:
        try:
            fd = os.open(name, flags, dir_fd=dir_fd)
        except OSError:
            continue  # renamed or removed meanwhile: it is read as before
        try:
            st = os.fstat(fd)
            fit = (
                stat.S_ISREG(st.st_mode)
                and st.st_uid == os.geteuid()
                and st.st_size == size
            )
            if fit:
                with contextlib.suppress(OSError):
                    maps[(st.st_dev, st.st_ino)] = mmap.mmap(
                        fd,
                        size,
                        mmap.MAP_SHARED | _POPULATE,
                        mmap.PROT_READ | mmap.PROT_WRITE,
                    )
        finally:
            os.close(fd)
    return maps
