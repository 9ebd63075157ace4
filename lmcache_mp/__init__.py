"""lmcache_mp: LMCache's Batched Stream SDK on a persistent process pool.

``lmcache_mp.stream`` and ``lmcache_mp.batch`` keep upstream's API
(``lmcache.sdk.stream`` / ``lmcache.sdk.batch``), ``lmcache_mp.request``
upstream 0.5.6's (``lmcache.sdk.request``: contexts by cache kind);
``connect()`` opens the
embedded shared-memory KV store; ``lmcache_mp.engine`` holds the embedded
engine and the OpenAI-compatible client; ``lmcache_mp.edits`` ready-made
KV edits. Importing the package starts nothing.
"""

from lmcache_mp._util.version import __version__ as __version__
from lmcache_mp.batch import LMCacheBatchedStream
from lmcache_mp.cache_kind import LMCacheSDKCacheKind
from lmcache_mp.errors import (
    LMCacheBatchedStreamError,
    LMCacheError,
    LMCacheStreamError,
)
from lmcache_mp.hints import gil_bound, releases_gil
from lmcache_mp.kv import KVContext, connect
from lmcache_mp.metrics import Metrics
from lmcache_mp.request import LMCacheRequestStream
from lmcache_mp.stream import (
    LMCacheStream,
    StreamPerfMetrics,
    StreamState,
    TokenEvent,
    create_request,
)

__all__ = [
    "KVContext",
    "LMCacheBatchedStream",
    "LMCacheBatchedStreamError",
    "LMCacheError",
    "LMCacheRequestStream",
    "LMCacheSDKCacheKind",
    "LMCacheStream",
    "LMCacheStreamError",
    "Metrics",
    "StreamPerfMetrics",
    "StreamState",
    "TokenEvent",
    "connect",
    "create_request",
    "gil_bound",
    "releases_gil",
]
