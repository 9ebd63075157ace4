"""KV contexts: the protocol, the embedded shared-memory store, the Redis
store (``redis`` itself is imported only when one is first used), and a
real LMCache server's context (``lmcache`` likewise)."""

from lmcache_mp.kv._chunk import chunk_file_size
from lmcache_mp.kv._connect import (
    KVStore,
    StoreInfo,
    connect,
    list_stores,
    reap_stores,
    remove_store,
)
from lmcache_mp.kv._files import default_capacity
from lmcache_mp.kv._layout import Layout, resolve_dtype
from lmcache_mp.kv._lmcache import lmcache_context
from lmcache_mp.kv._pins import DEFAULT_LEASE_S, PinOwner, pinning
from lmcache_mp.kv._protocol import KVContext
from lmcache_mp.kv._redis import RedisKVStore
from lmcache_mp.kv._shm import (
    DEFAULT_CHUNK_SIZE,
    SharedMemoryKVStore,
    StagedChunks,
)
from lmcache_mp.kv._stats import StoreStats

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "DEFAULT_LEASE_S",
    "KVContext",
    "KVStore",
    "Layout",
    "PinOwner",
    "RedisKVStore",
    "SharedMemoryKVStore",
    "StagedChunks",
    "StoreInfo",
    "StoreStats",
    "chunk_file_size",
    "connect",
    "default_capacity",
    "list_stores",
    "lmcache_context",
    "pinning",
    "reap_stores",
    "remove_store",
    "resolve_dtype",
]
