"""Many streams run together, phase by phase, as upstream ``lmcache.sdk.batch``.

Each phase (prefill, modify, decode) snapshots the selected streams' state,
runs it on the batch's executor, and commits each stream's new state only
if that stream succeeded. A phase in which some streams failed still
commits the others, then raises one :class:`LMCacheBatchedStreamError`
naming every failed stream (upstream aborted on the first failure, leaving
partial metrics).
"""

from lmcache_mp.batch._batched import LMCacheBatchedStream
from lmcache_mp.errors import LMCacheBatchedStreamError

__all__ = ["LMCacheBatchedStream", "LMCacheBatchedStreamError"]
