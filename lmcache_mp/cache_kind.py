"""The tensor families a KV context caches (upstream ``lmcache.sdk.cache_kind``)."""

from __future__ import annotations

import enum
from typing import Any

from lmcache_mp.errors import CacheKindError

__all__ = ["LMCacheSDKCacheKind", "as_kind"]


class LMCacheSDKCacheKind(enum.Enum):
    """A cacheable tensor family, as upstream ``lmcache==0.5.6`` names them.

    ``KV`` is the keys and values, ``[2, L, T, D]``; ``QUERY`` the queries
    of the same tokens, ``[1, L, T, Dq]`` (what query-aware compression
    such as SnapKV scores keys with). A store keeps each kind in its own
    namespace, with the same chunk semantics.
    """

    KV = "kv"
    QUERY = "query"

    @property
    def planes(self) -> int:
        """Size of the tensor's first axis: 2 (K and V) or 1 (Q)."""
        return 2 if self is LMCacheSDKCacheKind.KV else 1


def as_kind(value: Any, sid: str | None = None) -> LMCacheSDKCacheKind:
    """Return the lmcache_mp kind ``value`` names.

    Args:
        value: An ``LMCacheSDKCacheKind`` of lmcache_mp or of upstream, or
            its value (``"kv"``, ``"query"``).
        sid: The stream to name in the error.

    Returns:
        The kind.

    Raises:
        CacheKindError: If ``value`` is no known kind.
    """
    if isinstance(value, LMCacheSDKCacheKind):
        return value
    try:
        return LMCacheSDKCacheKind(getattr(value, "value", value))
    except (ValueError, TypeError):
        where = f"stream {sid}: " if sid else ""
        known = ", ".join(k.name for k in LMCacheSDKCacheKind)
        raise CacheKindError(
            f"{where}{value!r} is not a cache kind (known: {known})", sid
        ) from None
