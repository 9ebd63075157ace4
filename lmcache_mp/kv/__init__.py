"""KV contexts: the protocol and the embedded shared-memory store."""

from lmcache_mp.kv._protocol import KVContext

__all__ = ["KVContext"]
