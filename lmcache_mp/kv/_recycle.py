"""Chunk files reused instead of freed: the shared-memory store's arena.

Writing a new tmpfs file pays for every page it allocates: new-file writes
ran at ~2.5 GB/s on ``/dev/shm`` against ~5 GB/s for overwriting pages a
file already has (issue #20). So a chunk file that leaves the store (an
eviction, a chunk replaced by a committed edit, a discarded staging) is
renamed ``.free-<random>`` instead of being removed, and the next write
claims it: renames it to its own temp name (only one writer can), checks
it (a regular file of the current user, of the right size, with no other
link), overwrites it in place and publishes it by rename as before.
Free files count as used bytes and are the first to go when room is
needed, so they never take the store past its capacity.

A reader that opened a chunk just before it was recycled may see it
change under it: the checksum catches that, and the reader retries on the
chunk's current file (:func:`~lmcache_mp.kv._chunk.read_chunk`).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat

from lmcache_mp.kv._files import ChunkEntry, punch, scan_dir, temp_name

__all__ = [
    "FREE_PREFIX",
    "claim",
    "list_free",
    "remove_free",
    "retire",
    "retire_replaced",
]

#: Files whose pages wait for reuse start with this.
FREE_PREFIX = ".free-"


def _free_name() -> str:
    return FREE_PREFIX + secrets.token_hex(8)


def retire(dir_fd: int, name: str) -> None:
    """Take ``name`` out of the store, keeping its pages for reuse."""
    with contextlib.suppress(FileNotFoundError):
        os.rename(name, _free_name(), src_dir_fd=dir_fd, dst_dir_fd=dir_fd)


def retire_replaced(dir_fd: int, tmp: str, name: str) -> None:
    """Rename ``tmp`` onto ``name`` atomically, keeping the replaced file's
    pages for reuse (it is linked under a free name first)."""
    with contextlib.suppress(OSError):
        os.link(name, _free_name(), src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)


def remove_free(dir_fd: int, name: str) -> None:
    """Remove a free file for good, its pages freed even where another
    process keeps it mapped; claimed first, so that a writer claiming it
    at the same time gets it whole or not at all."""
    tmp = temp_name()
    try:
        os.rename(name, tmp, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except FileNotFoundError:
        return  # claimed by a writer, or removed, meanwhile
    punch(dir_fd, tmp)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp, dir_fd=dir_fd)


def list_free(dir_fd: int) -> list[ChunkEntry]:
    """The free files of a store directory."""
    found = []
    with scan_dir(dir_fd) as entries:
        for entry in entries:
            if not entry.name.startswith(FREE_PREFIX):
                continue
            with contextlib.suppress(FileNotFoundError):
                st = entry.stat(follow_symlinks=False)
                found.append(ChunkEntry(entry.name, st.st_size, 0))
    return found


def claim(dir_fd: int, free: list[str], size: int) -> tuple[str, int] | None:
    """Claim a free file of ``size`` bytes to overwrite.

    Args:
        dir_fd: The store directory.
        free: Free file names to try; the ones tried are removed from it.
        size: The size wanted.

    Returns:
        ``(temp name, descriptor open for writing)``, or ``None`` when no
        free file could be claimed. A claimed file unfit for reuse is
        removed.
    """
    while free:
        tmp = temp_name()
        try:
            os.rename(free.pop(), tmp, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except FileNotFoundError:
            continue  # another writer claimed it
        flags = os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(tmp, flags, dir_fd=dir_fd)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dir_fd)
            continue
        st = os.fstat(fd)
        fit = (
            stat.S_ISREG(st.st_mode)
            and st.st_uid == os.geteuid()
            and st.st_nlink == 1
            and st.st_size == size
        )
        if fit:
            return tmp, fd
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
    return None
