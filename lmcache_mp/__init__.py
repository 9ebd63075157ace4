"""lmcache_mp: LMCache's Batched Stream SDK on a persistent process pool."""

from lmcache_mp.errors import (
    LMCacheBatchedStreamError,
    LMCacheError,
    LMCacheStreamError,
)
from lmcache_mp.kv import KVContext
from lmcache_mp.stream import (
    LMCacheStream,
    StreamPerfMetrics,
    StreamState,
    TokenEvent,
    create_request,
)

__all__ = [
    "KVContext",
    "LMCacheBatchedStreamError",
    "LMCacheError",
    "LMCacheStream",
    "LMCacheStreamError",
    "StreamPerfMetrics",
    "StreamState",
    "TokenEvent",
    "create_request",
]

__version__ = "0.1.0"
