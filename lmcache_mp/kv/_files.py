"""The store directory: secure opening, temp files, listing, removal.

Every operation goes through a descriptor of the directory (``dir_fd``),
opened once after the ownership and mode checks, so that renaming or
replacing the path afterwards cannot redirect reads and writes elsewhere.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import shutil
import stat
import time
from collections.abc import Iterator
from typing import NamedTuple

import psutil

from lmcache_mp.cache_kind import LMCacheSDKCacheKind
from lmcache_mp.errors import KVStoreError, KVStoreSecurityError
from lmcache_mp.kv._pins import same_process

__all__ = [
    "CHUNK_SUFFIX",
    "TEMP_PREFIX",
    "ChunkEntry",
    "DirHandle",
    "kind_location",
    "list_chunks",
    "open_store_dir",
    "open_temp",
    "punch",
    "remove_stale_temps",
    "remove_tree",
    "scan_dir",
    "staged_name",
    "temp_name",
]

#: Files being written start with this; they are never read as chunks.
TEMP_PREFIX = ".tmp-"
#: Chunk files are ``<key hex><CHUNK_SUFFIX>``.
CHUNK_SUFFIX = ".kv"

# Frees a shared file's pages under every mapping of them (Linux).
_MADV_REMOVE: int | None = getattr(mmap, "MADV_REMOVE", None)

# A writer whose pid is still alive (or reused) gets this long to finish a
# temp file before an opener treats it as abandoned.
_STALE_TEMP_S = 600.0


class ChunkEntry(NamedTuple):
    """One chunk file as seen by a directory scan."""

    name: str
    size: int
    mtime_ns: int


def temp_name() -> str:
    """A fresh temp file name: ``.tmp-<pid>-<random>``.

    The pid lets an opener tell a dead writer's leftovers from a live one's.
    """
    return f"{TEMP_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"


def staged_name(owner: str) -> str:
    """A name for a staged chunk file: ``.tmp-<owner>-<random>``.

    A staged file outlives its writer (a pool worker may exit before the
    parent publishes it), so it is leased to the process that will publish
    it: ``owner`` is that batch's :meth:`~lmcache_mp.kv._pins.PinOwner.tag`,
    ``<pid>-<started>-<batch>``, and the file is stale only once that
    process is gone.
    """
    return f"{TEMP_PREFIX}{owner}-{secrets.token_hex(6)}"


def open_temp(dir_fd: int) -> tuple[str, int]:
    """Create a new temp file (0600, never through a symlink) in a store
    directory.

    Returns:
        ``(its name, a descriptor open for writing)``.
    """
    tmp = temp_name()
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    return tmp, os.open(tmp, flags, 0o600, dir_fd=dir_fd)


def _check_dir(st: os.stat_result, path: str) -> None:
    if stat.S_ISLNK(st.st_mode):
        raise KVStoreSecurityError(f"{path}: is a symlink; refusing it as a KV store")
    if not stat.S_ISDIR(st.st_mode):
        raise KVStoreError(f"{path}: exists and is not a directory")
    uid = os.geteuid()
    if st.st_uid != uid:
        raise KVStoreSecurityError(
            f"{path}: owned by uid {st.st_uid}, not by the current user (uid {uid})"
        )
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        raise KVStoreSecurityError(
            f"{path}: mode {mode:04o} gives other users access; expected 0700"
        )


def open_store_dir(path: str, create: bool) -> int:
    """Open (and optionally create) a store directory after checking it.

    Args:
        path: The directory.
        create: Create it (mode 0700) when missing.

    Returns:
        A descriptor of the directory; the caller closes it.

    Raises:
        KVStoreSecurityError: If the directory is a symlink, is not owned by
            the current user, or its mode lets group or others in.
        KVStoreError: If it is missing (and ``create`` is false), is not a
            directory, or cannot be opened.
    """
    if create:
        try:
            os.mkdir(path, 0o700)
            # The umask may have removed bits the owner needs.
            os.chmod(path, 0o700)
        except FileExistsError:
            pass
        except OSError as exc:
            raise KVStoreError(f"{path}: cannot create the store: {exc}") from exc
    try:
        before = os.lstat(path)
    except FileNotFoundError as exc:
        raise KVStoreError(f"{path}: the store does not exist") from exc
    _check_dir(before, path)
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        raise KVStoreError(f"{path}: cannot open the store: {exc}") from exc
    after = os.fstat(fd)
    if (after.st_dev, after.st_ino) != (before.st_dev, before.st_ino):
        os.close(fd)
        raise KVStoreSecurityError(f"{path}: was replaced while being opened")
    return fd


def punch(dir_fd: int, name: str) -> None:
    """Free the pages of a store file about to be removed; best effort.

    Another process may keep the file mapped (:mod:`~lmcache_mp.kv._maps`),
    and a removed file's pages live as long as a mapping of them; emptied
    first, it holds none. A reader still copying from it sees zeros, which
    its chunk's digest rejects. Only a file's last name is emptied: a temp
    name left by a writer killed between publishing a file by ``os.link``
    and unlinking the temp (the layout, a replaced chunk) shares the pages
    of a live file, and emptying it zeroed the store's layout (a CI run of
    test_writer_killed_at_random_leaves_only_whole_chunks).
    """
    if _MADV_REMOVE is None:
        return
    with contextlib.suppress(OSError, ValueError):
        fd = os.open(name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        try:
            st = os.fstat(fd)
            if stat.S_ISREG(st.st_mode) and st.st_size and st.st_nlink == 1:
                with mmap.mmap(fd, st.st_size, mmap.MAP_SHARED) as mapped:
                    mapped.madvise(_MADV_REMOVE)
        finally:
            os.close(fd)


def remove_stale_temps(dir_fd: int, owner: str | None = None) -> int:
    """Remove temp files left by writers that died mid-write, and staged
    files whose publisher is gone.

    A temp file is stale when its writer's pid is gone, or when it is older
    than ten minutes (its pid may have been reused or live in another pid
    namespace). A staged file (:func:`staged_name`) is stale when the
    process it is leased to is gone, whatever its age, or when it is leased
    to ``owner``, whose phase is over.

    Args:
        dir_fd: The store directory.
        owner: The tag of a batch whose unpublished staged files go too.

    Returns:
        How many files were removed.
    """
    removed = 0
    now = time.time()
    with scan_dir(dir_fd) as entries:
        for entry in entries:
            if not entry.name.startswith(TEMP_PREFIX):
                continue
            try:
                if not _stale(entry, owner, now):
                    continue
                punch(dir_fd, entry.name)  # it may be an arena file
                os.unlink(entry.name, dir_fd=dir_fd)
                removed += 1
            except FileNotFoundError:
                continue
    return removed


def _stale(entry: os.DirEntry[str], owner: str | None, now: float) -> bool:
    """Whether the temp file ``entry`` is abandoned (see
    :func:`remove_stale_temps`)."""
    rest = entry.name[len(TEMP_PREFIX) :]
    fields = rest.split("-")
    if len(fields) == 4:  # staged: <pid>-<started>-<batch>-<random>
        pid, started = fields[0], fields[1]
        if owner is not None and rest.startswith(owner + "-"):
            return True
        return not (
            pid.isdigit() and started.isdigit() and same_process(int(pid), int(started))
        )
    if not fields[0].isdigit() or not psutil.pid_exists(int(fields[0])):
        return True
    return now - entry.stat(follow_symlinks=False).st_mtime > _STALE_TEMP_S


@contextlib.contextmanager
def scan_dir(dir_fd: int) -> Iterator[Iterator[os.DirEntry[str]]]:
    """The entries of a store directory, read through a descriptor of their
    own; stat them inside the ``with`` block (the descriptor closes after).

    ``os.scandir(dir_fd)`` reads through a dup of ``dir_fd``, and dups share
    one directory offset: two threads of a handle listing the store at once
    each skipped the entries the other had read, so a chunk went uncounted
    and a store past the capacity was let in (issue #20's capacity test
    failed 1 run in 20).
    """
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
    fd = os.open(".", flags, dir_fd=dir_fd)
    try:
        with os.scandir(fd) as entries:
            yield entries
    finally:
        os.close(fd)


def list_chunks(dir_fd: int) -> list[ChunkEntry]:
    """List the chunk files of a store, skipping any that vanish meanwhile.

    Dot files (temp files, pins, eviction marks) are never chunks.
    """
    found = []
    with scan_dir(dir_fd) as entries:
        for entry in entries:
            if entry.name.startswith(".") or not entry.name.endswith(CHUNK_SUFFIX):
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if stat.S_ISREG(st.st_mode):
                found.append(ChunkEntry(entry.name, st.st_size, st.st_mtime_ns))
    return found


def remove_tree(path: str) -> None:
    """Remove a store directory; a missing directory is not an error.

    Raises:
        KVStoreSecurityError: If ``path`` is a symlink (never followed).
        KVStoreError: If it cannot be removed.
    """
    last: OSError | None = None
    for _ in range(3):
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        if stat.S_ISLNK(st.st_mode):
            raise KVStoreSecurityError(f"{path}: is a symlink; not removing it")
        try:
            for _, _, files, root_fd in os.fwalk(path):
                for name in files:
                    punch(root_fd, name)
            shutil.rmtree(path)
        except OSError as exc:
            # Another process may add or remove a file between rmtree's
            # listing and its unlink/rmdir; a retry sees the new state.
            last = exc
            continue
        return
    raise KVStoreError(f"{path}: cannot remove the store: {last}") from last


#: Prefix of the subdirectory of a store that holds another kind's chunks.
_KIND_DIR = "kind-"


def kind_location(
    path: str, url: str, kind: LMCacheSDKCacheKind, wanted: LMCacheSDKCacheKind
) -> tuple[str, str]:
    """Where the ``wanted`` kind of a store lives, from one of its kinds.

    KV is the store's directory; another kind a subdirectory of it (so that
    removing the store removes every kind), named by ``URL#kind``.

    Args:
        path: The directory of the ``kind`` handle.
        url: Its URL.
        kind: Its kind.
        wanted: The kind to locate.

    Returns:
        ``(path, url)`` of the wanted kind.
    """
    if kind is not LMCacheSDKCacheKind.KV:
        path, url = os.path.dirname(path), url.rsplit("#", 1)[0]
    if wanted is LMCacheSDKCacheKind.KV:
        return path, url
    return os.path.join(path, f"{_KIND_DIR}{wanted.value}"), f"{url}#{wanted.value}"


class DirHandle:
    """A store directory's descriptor and removal: what a store's finalizer
    may touch without keeping the store alive."""

    def __init__(self, path: str, owner: bool) -> None:
        self.path = path
        # Only the creating process removes a temporary store: a forked child
        # inherits the finalizer but must not delete its parent's store.
        self.owner_pid = os.getpid() if owner else None
        self.fd: int | None = None

    def release(self) -> None:
        """Close the descriptor; safe to call twice."""
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)

    def cleanup(self) -> None:
        """Release, and remove the directory if this process owns it."""
        self.release()
        if self.owner_pid == os.getpid():
            remove_tree(self.path)
