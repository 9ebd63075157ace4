"""``connect``: open a KV store by URL (or a fresh temporary one)."""

from __future__ import annotations

import getpass
import os
import re
import secrets
import stat
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeAlias, overload
from urllib.parse import SplitResult, urlsplit

from lmcache_mp._util.paths import remove_tree, shm_root
from lmcache_mp._util.proc import process_started, same_process
from lmcache_mp.cache_kind import LMCacheSDKCacheKind
from lmcache_mp.errors import KVConfigError, KVStoreError
from lmcache_mp.kv._files import (
    CHUNK_SUFFIX,
    KIND_PREFIX,
    default_capacity,
    dir_usage,
    open_store_dir,
    remove_store_dir,
)
from lmcache_mp.kv._layout import LAYOUT_FILE, Layout, resolve_dtype
from lmcache_mp.kv._redis import RedisKVStore
from lmcache_mp.kv._shm import DEFAULT_CHUNK_SIZE, SharedMemoryKVStore

__all__ = [
    "KVStore",
    "StoreInfo",
    "connect",
    "list_stores",
    "reap_stores",
    "remove_store",
]

#: What ``connect`` opens: a store of one of the backends. Both have the
#: same surface (retrieve, store, stage, for_kind, stats, close, destroy...).
KVStore: TypeAlias = SharedMemoryKVStore | RedisKVStore

# Store directories are named "lmcache-mp-<user>-<name>": per user, and
# easy to find for leak checks.
_DIR_PREFIX = "lmcache-mp"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def _user() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = str(os.geteuid())
    return re.sub(r"[^A-Za-z0-9_.-]", "_", user)


def _shm_dir(name: str) -> str:
    return os.path.join(shm_root(), f"{_DIR_PREFIX}-{_user()}-{name}")


@dataclass(frozen=True)
class _Options:
    """What ``connect`` was asked for, beyond the URL."""

    chunk_size: int
    layout: Layout | None
    capacity_bytes: int | None
    arena_bytes: int


def _open_dir(
    path: str, url: str, options: _Options, owner: bool = False
) -> SharedMemoryKVStore:
    capacity = options.capacity_bytes
    if capacity is None:
        capacity = default_capacity(os.path.dirname(path))
    store = SharedMemoryKVStore(
        path,
        url=url,
        chunk_size=options.chunk_size,
        capacity_bytes=capacity,
        owner=owner,
        arena_bytes=options.arena_bytes,
    )
    try:
        store._attach(create=True, layout=options.layout)
    except BaseException:
        store.close()
        raise
    return store


def _open_shm(parts: SplitResult, url: str, options: _Options) -> SharedMemoryKVStore:
    # "shm:///name" is canonical; "shm://name" is accepted as the same store.
    name = (parts.netloc + parts.path).lstrip("/")
    if not _NAME.fullmatch(name) or parts.query or parts.fragment:
        raise KVConfigError(
            f"bad store URL {url!r}: expected shm:///NAME with NAME of letters, "
            "digits, '.', '_' or '-' (at most 128, not starting with '.' or '-')"
        )
    return _open_dir(_shm_dir(name), f"shm:///{name}", options)


def _open_file(parts: SplitResult, url: str, options: _Options) -> SharedMemoryKVStore:
    if parts.netloc or not parts.path.startswith("/") or parts.query or parts.fragment:
        raise KVConfigError(f"bad store URL {url!r}: expected file:///ABSOLUTE/PATH")
    path = os.path.normpath(parts.path)
    return _open_dir(path, f"file://{path}", options)


def _open_redis(parts: SplitResult, url: str, options: _Options) -> RedisKVStore:
    if options.capacity_bytes is not None:
        raise KVConfigError(
            "a Redis store's capacity is its server's maxmemory; set it there "
            "(CONFIG SET maxmemory BYTES), not with capacity_bytes"
        )
    if options.arena_bytes:
        raise KVConfigError(
            "arena_bytes is the shared-memory store's (files whose pages are "
            "allocated ahead); a Redis server allocates its own memory"
        )
    store = RedisKVStore(url, chunk_size=options.chunk_size)
    store._attach(options.layout)
    return store


#: Scheme -> opener of a store for a parsed URL. Another backend is one more
#: entry here, returning its own KVContext.
_OPENERS: dict[str, Callable[[SplitResult, str, _Options], KVStore]] = {
    "file": _open_file,
    "redis": _open_redis,
    "shm": _open_shm,
}


def _layout_arg(
    layers: int | None, width: int | None, dtype: Any, planes: int
) -> Layout | None:
    if layers is None and width is None and dtype is None:
        return None
    if layers is None or width is None or dtype is None:
        given = {"layers": layers, "width": width, "dtype": dtype}
        missing = ", ".join(name for name, value in given.items() if value is None)
        raise KVConfigError(
            f"give layers, width and dtype together or not at all; missing: {missing}"
        )
    for name, value in (("layers", layers), ("width", width)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise KVConfigError(f"{name} must be a positive int, got {value!r}")
    return Layout(layers, width, resolve_dtype(dtype), planes)


@overload
def connect(
    url: None = None,
    *,
    chunk_size: int = ...,
    layers: int | None = ...,
    width: int | None = ...,
    dtype: Any = ...,
    capacity_bytes: int | None = ...,
    kind: LMCacheSDKCacheKind = ...,
    arena_bytes: int = ...,
) -> SharedMemoryKVStore: ...


@overload
def connect(
    url: str,
    *,
    chunk_size: int = ...,
    layers: int | None = ...,
    width: int | None = ...,
    dtype: Any = ...,
    capacity_bytes: int | None = ...,
    kind: LMCacheSDKCacheKind = ...,
    arena_bytes: int = ...,
) -> KVStore: ...


def connect(
    url: str | None = None,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    layers: int | None = None,
    width: int | None = None,
    dtype: Any = None,
    capacity_bytes: int | None = None,
    kind: LMCacheSDKCacheKind = LMCacheSDKCacheKind.KV,
    arena_bytes: int = 0,
) -> KVStore:
    """Open a KV store: the embedded shared-memory one, or one on Redis.

    With no URL, a fresh temporary store is created, owned by the returned
    context: closing it (or leaving its ``with`` block), garbage collecting
    it, or leaving the interpreter removes it. ``shm:///NAME`` opens or
    creates the named store under ``/dev/shm`` (the temp directory where
    there is none), which any process of the same user can open by name;
    it lasts until ``destroy()``. ``file:///PATH`` does the same in a
    directory of your choice. ``redis://`` opens a
    :class:`~lmcache_mp.kv.RedisKVStore` with the same semantics, shared by
    every host that reaches the server (needs ``lmcache-mp[redis]``).

    Args:
        url: ``None``, ``"shm:///NAME"``, ``"file:///PATH"`` or
            ``"redis://[[USER]:PASSWORD@]HOST[:PORT][/DB][?prefix=NAME&
            timeout=SECONDS]"`` (prefix default ``lmcache-mp``: the store's
            namespace on the server; timeout default 5 s, for every call).
        chunk_size: Tokens per chunk.
        layers: Layers ``L`` of the KV; with ``width`` and ``dtype`` fixes
            the store's layout now (otherwise the first store does).
        width: ``D``, heads x head dim.
        dtype: ``float32``, ``float16`` or ``bfloat16`` (needs ml_dtypes).
        capacity_bytes: Chunk bytes kept before least recently used chunks
            are evicted; default what the store can really hold: the free
            space of its filesystem, and no more than the available RAM
            less a reserve for the processes. Not for Redis, whose
            ``maxmemory`` is the capacity.
        kind: The tensor family of the returned context: ``KV`` or
            ``QUERY`` (the named store's query namespace, as
            :meth:`SharedMemoryKVStore.for_kind`; the layout arguments
            then fix that namespace's layout).
        arena_bytes: Shared-memory KV only: bytes of chunk files whose
            pages are written as soon as the layout is fixed (at once
            when ``layers``, ``width`` and ``dtype`` are given), for stores
            to fill instead of allocating pages as they write (writing
            into pages already allocated is several times faster on
            tmpfs; see docs/design.md). Counted as used; at most the
            capacity; default 0.

    Returns:
        The store's context.

    Raises:
        KVConfigError: For an unsupported scheme or malformed URL, a bad
            chunk size, capacity, arena or layout, a layout that differs from the
            one the named store already has, a kind other than KV for a
            temporary store (it has no name for other handles to share), a
            Redis server whose ``maxmemory-policy`` does not evict by use,
            or ``redis://`` without the redis package.
        KVStoreAuthError: If the Redis server refuses the credentials.
        KVStoreConnectionError: If the Redis server is down or does not
            answer within the timeout.
        KVStoreSecurityError: If the directory is a symlink, not owned by
            the current user, or open to other users.
        KVStoreError: If the directory cannot be created or opened.
    """
    layout = _layout_arg(layers, width, dtype, kind.planes)
    if kind is not LMCacheSDKCacheKind.KV:
        if arena_bytes:
            raise KVConfigError(
                f"arena_bytes is for the KV namespace; open {kind.name} with "
                "for_kind() on a store connected with it"
            )
        if url is None:
            raise KVConfigError(
                f"a temporary store has only KV; open a named store for "
                f"{kind.name}, or call for_kind() on the temporary one"
            )
        with connect(url, chunk_size=chunk_size, capacity_bytes=capacity_bytes) as kv:
            return kv._open_kind(kind, layout)
    options = _Options(chunk_size, layout, capacity_bytes, arena_bytes)
    if url is None:
        name = temporary_name()
        return _open_dir(_shm_dir(name), f"shm:///{name}", options, owner=True)
    parts = urlsplit(url)
    opener = _OPENERS.get(parts.scheme.lower())
    if opener is None:
        supported = ", ".join(f"{scheme}://" for scheme in sorted(_OPENERS))
        scheme = f"scheme {parts.scheme!r}" if parts.scheme else "no scheme"
        raise KVConfigError(
            f"unsupported KV store URL {url!r} ({scheme}); supported: {supported}"
        )
    return opener(parts, url, options)


def is_store_dir(path: str) -> bool:
    """Whether a directory holds only what a store does: its layout, chunk
    files, dot files (temp files, pins, marks) and kinds' subdirectories."""
    try:
        with os.scandir(path) as entries:
            for entry in entries:
                name = entry.name
                if name == LAYOUT_FILE or name.startswith("."):
                    continue
                if name.startswith(KIND_PREFIX) and entry.is_dir(follow_symlinks=False):
                    continue
                if name.endswith(CHUNK_SUFFIX) and entry.is_file(follow_symlinks=False):
                    continue
                return False
    except OSError:
        return False
    return True


# The stores on this machine: what ``lmcache-mp stores`` lists, reaps and
# removes. A temporary store's name and a pool's private directories carry
# their owner (pid and start time), so that a reaper can tell a dead
# owner's from a live one's without opening anything.

#: Private directories of process pools (``lmcache_mp._util.paths``).
_POOL_PREFIXES = ("lmcache-mp-pool-", "lmcache-mp-claims-")


@dataclass(frozen=True)
class StoreInfo:
    """One shared-memory store, as ``lmcache-mp stores`` lists it.

    Args:
        name: Its name (``shm:///NAME``), or its directory's name under a
            ``--root``.
        path: Its directory.
        temporary: Whether it is a temporary store (``connect()`` with no
            URL), removed with its owner.
        bytes: The size of its chunk files.
        chunks: How many chunks it holds (every kind).
        owner_pid: A temporary store's owner (``None`` for a named one).
        owner_alive: Whether that owner still runs (``None`` for a named
            one).
        pinned_bytes: Of ``bytes``, those pinned by live batches.
        pinned_by: The live batches that pin them (``pid-started-batch``).
        stale_pins: Pins left by batches whose process is gone.
    """

    name: str
    path: str
    temporary: bool
    bytes: int
    chunks: int
    owner_pid: int | None
    owner_alive: bool | None
    pinned_bytes: int
    pinned_by: tuple[str, ...]
    stale_pins: int


def temporary_name() -> str:
    """A fresh temporary store's name, ``tmp-<pid>-<started>-<random>``."""
    pid = os.getpid()
    return f"tmp-{pid}-{process_started(pid) or 0}-{secrets.token_hex(8)}"


def _owner(name: str, prefix: str) -> tuple[int, int] | None:
    """``(pid, started)`` from ``<prefix><pid>-<started>-...``."""
    parts = name[len(prefix) :].split("-")
    if len(parts) < 3 or not (parts[0].isdigit() and parts[1].isdigit()):
        return None
    return int(parts[0]), int(parts[1])


def _store_dirs(root: str | None) -> list[tuple[str, str]]:
    """``(name, path)`` of this user's store directories under ``root``
    (default: the shared-memory root)."""
    found = []
    if root is None:
        prefix = f"{_DIR_PREFIX}-{_user()}-"
        base = shm_root()
    else:
        prefix, base = "", root
    with os.scandir(base) as entries:
        for entry in entries:
            if not entry.name.startswith(prefix) or entry.name.startswith(
                _POOL_PREFIXES
            ):
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            mine = stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()
            if mine and is_store_dir(entry.path):
                found.append((entry.name[len(prefix) :], entry.path))
    return sorted(found)


def _info(name: str, path: str, reap_pins: bool) -> StoreInfo | None:
    try:
        fd = open_store_dir(path, create=False)
    except KVStoreError:
        return None
    try:
        usage = dir_usage(fd, reap_pins)
    finally:
        os.close(fd)
    owner = _owner(name, "tmp-") if name.startswith("tmp-") else None
    temporary = name.startswith("tmp-")
    return StoreInfo(
        name=name,
        path=path,
        temporary=temporary,
        bytes=usage.bytes,
        chunks=usage.chunks,
        owner_pid=owner[0] if owner else None,
        owner_alive=same_process(*owner) if owner else None,
        pinned_bytes=usage.pinned_bytes,
        pinned_by=usage.pinned_by,
        stale_pins=usage.stale_pins,
    )


def list_stores(root: str | None = None) -> list[StoreInfo]:
    """This user's shared-memory stores, by name.

    Args:
        root: A directory whose subdirectories are ``file://`` stores
            (default: the shared-memory root and its ``shm:///`` stores).

    Returns:
        One :class:`StoreInfo` per store; nothing is changed.
    """
    infos = (_info(name, path, reap_pins=False) for name, path in _store_dirs(root))
    return [info for info in infos if info is not None]


def reap_stores(root: str | None = None, act: bool = False) -> list[str]:
    """Find, and with ``act`` remove, what dead processes left: temporary
    stores and pools' private directories whose owner is gone, and the
    pins of batches whose process is gone (in every store). A live owner's
    store, and every named store, stays.

    Args:
        root: As for :func:`list_stores`.
        act: Remove what is found (else a dry run).

    Returns:
        What was (or would be) removed: directory paths, and
        ``"<path>: N stale pins"`` lines.
    """
    found: list[str] = []
    for name, path in _store_dirs(root):
        owner = _owner(name, "tmp-") if name.startswith("tmp-") else None
        if owner is not None and not same_process(*owner):
            found.append(path)
            if act:
                remove_store_dir(path)
            continue
        info = _info(name, path, reap_pins=act)
        if info is not None and info.stale_pins:
            found.append(f"{path}: {info.stale_pins} stale pins")
    if root is None:
        with os.scandir(shm_root()) as entries:
            pools = [e for e in entries if e.name.startswith(_POOL_PREFIXES)]
        for entry in sorted(pools, key=lambda e: e.name):
            prefix = next(p for p in _POOL_PREFIXES if entry.name.startswith(p))
            owner = _owner(entry.name, prefix)
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            mine = stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()
            if mine and owner is not None and not same_process(*owner):
                found.append(entry.path)
                if act:
                    remove_tree(entry.path)
    return found


def remove_store(name: str, root: str | None = None) -> str:
    """Destroy the store ``name`` (``shm:///NAME``, or a directory under
    ``root``), as :meth:`SharedMemoryKVStore.destroy` does.

    Returns:
        The removed directory.

    Raises:
        KVConfigError: If ``name`` is not a store name.
        KVStoreSecurityError: If the directory is not the current user's, is
            a symlink or lets others in; nothing is removed.
        KVStoreError: If there is no such store, or the directory holds
            files a store does not; nothing is removed.
    """
    if not _NAME.fullmatch(name):
        raise KVConfigError(f"bad store name {name!r}")
    path = _shm_dir(name) if root is None else os.path.join(root, name)
    os.close(open_store_dir(path, create=False))
    if not is_store_dir(path):
        raise KVStoreError(f"{path}: not a KV store (it holds other files)")
    remove_store_dir(path)
    return path
