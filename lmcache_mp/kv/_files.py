"""The store directory: its files and what they mean.

Every operation goes through a descriptor of the directory (``dir_fd``),
opened once after the ownership and mode checks, so that renaming or
replacing the path afterwards cannot redirect reads and writes elsewhere.
The directory holds:

- chunk files, ``<key hex>.kv`` (their format: :mod:`~lmcache_mp.kv._chunk`),
  written through temp files ``.tmp-<pid>-<random>`` and renamed into place;
  staged files ``.tmp-<pid>-<started>-<batch>-<random>`` are leased to the
  batch that will publish them;
- free files, ``.free-<random>``: chunk files that left the store (an
  eviction, a replaced chunk, a discarded staging), kept for the next write
  to claim (rename to its own temp name: only one writer can), check and
  overwrite in place, as overwriting a tmpfs file's pages is several times
  faster than allocating new ones (docs/design.md). Free files count as
  used bytes and are the first to go when room is needed;
- pin files, ``.pin-<pid>-<started>-<batch>-<stream digest>``: the chunks
  one stream of one open batch depends on, a line each, replaced
  atomically; a pin whose process is gone (or whose pid now belongs to a
  process started at another time) is removed by the next scan;
- eviction marks, ``.gone-<chunk name>``: how a retrieve tells KV that was
  evicted (fail at once) from KV not stored yet (worth waiting for).

Capacity is enforced by least-recently-used eviction that never touches a
pinned chunk. Recency is a chunk file's mtime, refreshed on every hit and
every store of an existing chunk, so all processes share one order. Byte
accounting is approximate across processes: a handle trusts its own count
for a second before listing the directory again."""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import shutil
import stat
import threading
import time
from collections.abc import Iterable, Iterator
from typing import NamedTuple

import psutil

from lmcache_mp._util import tracker
from lmcache_mp._util.proc import same_process
from lmcache_mp.cache_kind import LMCacheSDKCacheKind
from lmcache_mp.errors import KVStoreError, KVStoreSecurityError
from lmcache_mp.kv._pins import PinOwner
from lmcache_mp.kv._stats import Room, lru_victims

__all__ = [
    "CHUNK_SUFFIX",
    "FREE_PREFIX",
    "KIND_PREFIX",
    "TEMP_PREFIX",
    "ChunkEntry",
    "DirHandle",
    "DirUsage",
    "Usage",
    "claim",
    "clear_evicted",
    "default_capacity",
    "dir_usage",
    "is_evicted",
    "kind_location",
    "list_chunks",
    "list_free",
    "live_pins",
    "mark_evicted",
    "open_store_dir",
    "open_temp",
    "punch",
    "pwrite_all",
    "remove_free",
    "remove_pins",
    "remove_stale_temps",
    "remove_store_dir",
    "retire",
    "retire_replaced",
    "scan_dir",
    "staged_name",
    "temp_name",
    "write_pin",
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

    Another process may keep the file mapped (:mod:`~lmcache_mp.kv._arena`),
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
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
        fd = os.open(name, flags, dir_fd=dir_fd)
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
    and a store past the capacity would be let in.
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


def remove_store_dir(path: str) -> None:
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
KIND_PREFIX = "kind-"


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
    return os.path.join(path, f"{KIND_PREFIX}{wanted.value}"), f"{url}#{wanted.value}"


class DirHandle:
    """A store directory's descriptor and removal: what a store's finalizer
    may touch without keeping the store alive."""

    def __init__(self, path: str, owner: bool) -> None:
        self.path = path
        # Only the creating process removes a temporary store: a forked child
        # inherits the finalizer but must not delete its parent's store.
        self.owner_pid = os.getpid() if owner else None
        self.fd: int | None = None
        if owner:
            # Registered before the directory exists, so that no death of
            # the owner, even during the creation, leaves it behind.
            tracker.register(path)

    def release(self) -> None:
        """Close the descriptor; safe to call twice."""
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)

    def cleanup(self) -> None:
        """Release, and remove the directory if this process owns it."""
        self.release()
        if self.owner_pid == os.getpid():
            remove_store_dir(self.path)
            tracker.unregister(self.path)


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
        flags = os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
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


_PIN = ".pin-"
_GONE = ".gone-"
# Eviction marks kept at most; the oldest go first (inodes cost memory).
_MAX_MARKS = 65536


def write_pin(
    dir_fd: int, owner: PinOwner, stream_id: str, names: Iterable[str], add: bool
) -> None:
    """Pin ``names`` (chunk file names) for one stream of ``owner``.

    Args:
        dir_fd: The store directory.
        owner: The batch.
        stream_id: The stream.
        names: Its chunks.
        add: Keep the chunks already pinned for it too; else replace them.
    """
    pin = _PIN + owner.tag(stream_id)
    wanted = set(names)
    if add:
        wanted |= _read(dir_fd, pin)
    if not wanted:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(pin, dir_fd=dir_fd)
        return
    tmp, fd = open_temp(dir_fd)
    try:
        try:
            with os.fdopen(fd, "w", closefd=False) as fh:
                fh.write("\n".join(sorted(wanted)))
        finally:
            os.close(fd)
        os.replace(tmp, pin, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        # A full filesystem fails the write: the half-written pin goes.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise


def remove_pins(dir_fd: int, owner: PinOwner, stream_id: str | None = None) -> None:
    """Release the pins of one stream of ``owner``, or all of its pins."""
    if stream_id is not None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(_PIN + owner.tag(stream_id), dir_fd=dir_fd)
        return
    prefix = f"{_PIN}{owner.tag()}-"
    with scan_dir(dir_fd) as entries:
        names = [e.name for e in entries if e.name.startswith(prefix)]
    for name in names:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=dir_fd)


def live_pins(dir_fd: int) -> set[str]:
    """The chunk names pinned by live batches; remove dead batches' pins."""
    pinned: set[str] = set()
    alive: dict[tuple[int, int], bool] = {}
    with scan_dir(dir_fd) as entries:
        pins = [e.name for e in entries if e.name.startswith(_PIN)]
    for pin in pins:
        owner = _owner_of(pin)
        if owner is not None and owner not in alive:
            alive[owner] = same_process(*owner)
        if owner is None or not alive[owner]:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(pin, dir_fd=dir_fd)
            continue
        pinned |= _read(dir_fd, pin)
    return pinned


def _owner_of(pin: str) -> tuple[int, int] | None:
    """``(pid, started)`` from a pin's name, or ``None`` if malformed."""
    parts = pin[len(_PIN) :].split("-")
    if len(parts) != 4 or not (parts[0].isdigit() and parts[1].isdigit()):
        return None
    return int(parts[0]), int(parts[1])


def _read(dir_fd: int, pin: str) -> set[str]:
    try:
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
        fd = os.open(pin, flags, dir_fd=dir_fd)
    except FileNotFoundError:
        return set()
    with os.fdopen(fd, "r") as fh:
        return set(fh.read().split())


class DirUsage(NamedTuple):
    """What a store directory holds, every kind counted."""

    chunks: int
    bytes: int
    pinned_bytes: int
    #: The live batches that pin chunks (``pid-started-batch``).
    pinned_by: tuple[str, ...]
    #: Pins of batches whose process is gone.
    stale_pins: int


def dir_usage(dir_fd: int, reap_pins: bool = False) -> DirUsage:
    """Count a store's chunks and pins, its kinds' subdirectories included.

    Args:
        dir_fd: The store directory (its KV kind).
        reap_pins: Also remove the pins of dead batches.
    """
    chunks = nbytes = pinned_bytes = stale = 0
    batches: set[str] = set()
    fds = [dir_fd]
    with scan_dir(dir_fd) as entries:
        kinds = [
            e.name for e in entries if e.name.startswith(KIND_PREFIX) and e.is_dir()
        ]
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    for kind in kinds:
        with contextlib.suppress(OSError):
            fds.append(os.open(kind, flags, dir_fd=dir_fd))
    try:
        for fd in fds:
            found = list_chunks(fd)
            chunks += len(found)
            nbytes += sum(c.size for c in found)
            with scan_dir(fd) as entries:
                pins = [e.name for e in entries if e.name.startswith(_PIN)]
            pinned: set[str] = set()
            for pin in pins:
                owner = _owner_of(pin)
                if owner is None or not same_process(*owner):
                    stale += 1
                    if reap_pins:
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(pin, dir_fd=fd)
                    continue
                batches.add("-".join(pin[len(_PIN) :].split("-")[:3]))
                pinned |= _read(fd, pin)
            pinned_bytes += sum(c.size for c in found if c.name in pinned)
    finally:
        for fd in fds[1:]:
            os.close(fd)
    return DirUsage(chunks, nbytes, pinned_bytes, tuple(sorted(batches)), stale)


def mark_evicted(dir_fd: int, names: Iterable[str]) -> None:
    """Record that chunks were evicted; prune the oldest marks past the cap."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    for name in names:
        os.close(os.open(_GONE + name, flags, 0o600, dir_fd=dir_fd))
    with scan_dir(dir_fd) as entries:
        marks = [e for e in entries if e.name.startswith(_GONE)]
        if len(marks) <= _MAX_MARKS:
            return
        oldest = sorted(marks, key=_mtime)[: len(marks) - _MAX_MARKS // 2]
    for entry in oldest:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(entry.name, dir_fd=dir_fd)


def _mtime(entry: os.DirEntry[str]) -> int:
    try:
        return entry.stat(follow_symlinks=False).st_mtime_ns
    except FileNotFoundError:
        return 0


def clear_evicted(dir_fd: int, name: str) -> None:
    """Forget that chunk ``name`` was evicted (it is being stored again)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(_GONE + name, dir_fd=dir_fd)


def is_evicted(dir_fd: int, name: str) -> bool:
    """Whether chunk ``name`` was evicted and not stored since."""
    try:
        os.stat(_GONE + name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


# Memory the default capacity leaves to processes: this share of the RAM,
# and at least _RESERVE_MIN bytes.
_RESERVE_SHARE = 8
_RESERVE_MIN = 1 << 30
# How long a handle trusts its own count of the bytes in use before listing
# the directory again: other processes' writes are unseen for at most this.
_USAGE_TTL_S = 1.0


def default_capacity(directory: str) -> int:
    """What the store can really hold: the free space of ``directory``'s
    filesystem (for ``/dev/shm``, its size less what is in it), and no more
    than the available RAM less a reserve for the processes (an eighth of
    the RAM, at least 1 GiB, at most half of what is available). A
    smaller share of the free RAM would evict KV that a batch needs long
    before memory is short.

    Raises:
        KVStoreError: If ``directory``'s free space cannot be read.
    """
    memory = psutil.virtual_memory()
    # Never more than half of what is available: a small or busy machine
    # still gets a store.
    reserve = min(
        max(_RESERVE_MIN, memory.total // _RESERVE_SHARE), memory.available // 2
    )
    try:
        free_disk = shutil.disk_usage(directory).free
    except OSError as exc:
        raise KVStoreError(f"{directory}: cannot read its free space: {exc}") from exc
    return max(1, min(free_disk, memory.available - reserve))


def evict_lru(
    dir_fd: int, need: int, capacity: int, keep: frozenset[str], evict: bool = True
) -> tuple[int, int, int, int]:
    """Remove least recently used unpinned chunks until ``need`` more bytes fit.

    Nothing is removed when they would not fit even then. Free files
    (:mod:`~lmcache_mp.kv._files`) count as used and go first. Recency is
    the file's mtime, which a hit refreshes. An evicted chunk is retired
    for reuse and leaves an eviction mark.

    Args:
        dir_fd: The store directory.
        need: Bytes about to be written.
        capacity: The store's capacity in bytes.
        keep: Chunk names never to evict (the chunks being stored).
        evict: ``False``: only count the bytes used (an arena evicts no KV).

    Returns:
        ``(evicted, evicted bytes, used, pinned)``: chunks removed here,
        their bytes, the bytes still used, and the bytes pinned (-1 when
        nothing had to be evicted).
    """
    entries = list_chunks(dir_fd)
    free = list_free(dir_fd)
    used = sum(e.size for e in entries) + sum(e.size for e in free)
    if used + need <= capacity or not evict:
        return 0, 0, used, -1
    pinned_names = live_pins(dir_fd)
    pinned = sum(e.size for e in entries if e.name in pinned_names)
    # Free files go first (removed); then chunks, retired for reuse by the
    # write that needs the room (the bytes stay, as that write's).
    # The recency's first item is 0 for a free file, 1 for a chunk.
    candidates = [((0, 0), entry.name, entry.size) for entry in free]
    candidates += [
        ((1, entry.mtime_ns), entry.name, entry.size)
        for entry in entries
        if entry.name not in keep and entry.name not in pinned_names
    ]
    victims = lru_victims(candidates, used, need, capacity)
    if victims is None:
        return 0, 0, used, pinned  # cannot fit: evict nothing for nothing
    gone: list[str] = []
    freed = 0
    for (is_chunk, _), name, size in victims:
        used -= size
        if not is_chunk:
            remove_free(dir_fd, name)
            continue
        retire(dir_fd, name)
        gone.append(name)
        freed += size
    mark_evicted(dir_fd, gone)
    return len(gone), freed, used, pinned


class Usage:
    """One handle's estimate of the bytes a store uses. Thread-safe.

    Args:
        capacity: The store's capacity in bytes.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._lock = threading.Lock()
        self._used: int | None = None
        self._listed_at = 0.0
        # Bytes this handle made room for that are not written yet: a
        # listing of the directory cannot see them.
        self._inflight = 0

    def make_room(
        self,
        dir_fd: int,
        count: int,
        file_size: int,
        keep: frozenset[str],
        evict: bool = True,
    ) -> Room:
        """Evict as needed for ``count`` new chunk files of ``file_size`` bytes.

        Args:
            dir_fd: The store directory.
            count: Chunk files about to be written.
            file_size: Bytes of each.
            keep: Chunk names never to evict.
            evict: ``False``: evict nothing; only what is free fits.

        Returns:
            What fits and what was evicted. When all fit, they are counted
            as used from now on, and as under way until :meth:`written`.
        """
        need = count * file_size
        # One count per handle, read and updated under one lock, with the
        # bytes of writes under way added to every listing: threads of one
        # process storing at once (a thread batch's prefill) each added
        # their chunks to a count another overwrote, or a listing misses
        # the chunks still being written, and stores past the capacity
        # would be let in.
        with self._lock:
            used = self._used
            fresh = time.monotonic() - self._listed_at < _USAGE_TTL_S
            evicted = freed = 0
            pinned = -1
            if used is None or not fresh or used + need > self.capacity:
                evicted, freed, listed, pinned = evict_lru(
                    dir_fd, need + self._inflight, self.capacity, keep, evict
                )
                used = listed + self._inflight
                self._listed_at = time.monotonic()
            fits = min(count, max(0, self.capacity - used) // file_size)
            # A store that does not fit whole writes nothing.
            if fits == count:
                used += need
                self._inflight += need
            self._used = used
        return Room(fits, evicted, freed, used, pinned)

    def written(self, nbytes: int) -> None:
        """The writes that :meth:`make_room` made room for (``nbytes``) are
        over, done or failed: a listing sees what they left from now on."""
        with self._lock:
            self._inflight = max(0, self._inflight - nbytes)


def pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    """Write all of ``view`` at ``offset``, resuming short writes.

    Raises:
        OSError: If a write moves nothing (e.g. the filesystem is full).
    """
    done = 0
    while done < len(view):
        moved = os.pwrite(fd, view[done:], offset + done)
        if moved == 0:
            raise OSError(f"short write: {done} of {len(view)} bytes at {offset}")
        done += moved
