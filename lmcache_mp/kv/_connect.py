"""``connect``: open a KV store by URL (or a fresh temporary one)."""

from __future__ import annotations

import getpass
import os
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeAlias, overload
from urllib.parse import SplitResult, urlsplit

from lmcache_mp._util.paths import shm_root
from lmcache_mp.cache_kind import LMCacheSDKCacheKind
from lmcache_mp.errors import KVConfigError
from lmcache_mp.kv._files import default_capacity
from lmcache_mp.kv._layout import Layout, resolve_dtype
from lmcache_mp.kv._redis import RedisKVStore
from lmcache_mp.kv._shm import DEFAULT_CHUNK_SIZE, SharedMemoryKVStore

__all__ = ["KVStore", "connect"]

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
        name = f"tmp-{secrets.token_hex(8)}"
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
