"""KV contexts: the protocol and the embedded shared-memory store."""

from lmcache_mp.kv._connect import connect
from lmcache_mp.kv._protocol import KVContext
from lmcache_mp.kv._shm import (
    DEFAULT_CHUNK_SIZE,
    SharedMemoryKVStore,
    StagedChunks,
)
from lmcache_mp.kv._stats import StoreStats

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "KVContext",
    "SharedMemoryKVStore",
    "StagedChunks",
    "StoreStats",
    "connect",
]
