"""KV contexts: the protocol and the embedded shared-memory store."""

from lmcache_mp.kv._connect import connect
from lmcache_mp.kv._protocol import KVContext
from lmcache_mp.kv._stats import StoreStats
from lmcache_mp.kv._store import (
    DEFAULT_CHUNK_SIZE,
    SharedMemoryKVStore,
    StagedChunks,
)

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "KVContext",
    "SharedMemoryKVStore",
    "StagedChunks",
    "StoreStats",
    "connect",
]
