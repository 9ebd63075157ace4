"""The tensor families a KV context caches (upstream ``lmcache.sdk.cache_kind``)."""

from __future__ import annotations

import enum

__all__ = ["LMCacheSDKCacheKind"]


class LMCacheSDKCacheKind(enum.Enum):
    """A cacheable tensor family, as upstream ``lmcache==0.5.6`` names them.

    ``KV`` is the keys and values, ``[2, L, T, D]``; ``QUERY`` the queries
    of the same tokens, ``[1, L, T, Dq]`` (what query-aware compression
    such as SnapKV scores keys with). A store keeps each kind in its own
    namespace, with the same chunk semantics (issue #11).
    """

    KV = "kv"
    QUERY = "query"

    @property
    def planes(self) -> int:
        """Size of the tensor's first axis: 2 (K and V) or 1 (Q)."""
        return 2 if self is LMCacheSDKCacheKind.KV else 1
