"""A stream's contexts by cache kind, and the tensors a by-kind fn is handed.

Upstream 0.5.6 keys a stream's contexts and a modify fn's tensors by
``LMCacheSDKCacheKind``. Kinds are compared by value here, so upstream's
own enum members (``lmcache.sdk.cache_kind``, as a real LMCache context's
``.kind`` is) and lmcache_mp's are the same kind.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from lmcache_mp.cache_kind import LMCacheSDKCacheKind, as_kind
from lmcache_mp.errors import CacheKindError
from lmcache_mp.kv import KVContext

__all__ = ["KindTensors", "by_kind", "edited_kv"]

KV = LMCacheSDKCacheKind.KV


def by_kind(
    contexts: Iterable[KVContext], sid: str
) -> dict[LMCacheSDKCacheKind, KVContext]:
    """Key a stream's contexts by their ``.kind`` (``KV`` when they have none,
    as the seed's contexts).

    Args:
        contexts: The stream's contexts.
        sid: The stream, named in errors.

    Returns:
        ``{kind: context}``; it may lack KV, or be empty: upstream 0.5.6
        accepts a stream that only generates, and only a
        retrieve or modify of a missing kind fails.

    Raises:
        CacheKindError: If a context's kind is unknown, or two contexts have
            one kind (upstream kept the last silently).
    """
    found: dict[LMCacheSDKCacheKind, KVContext] = {}
    for ctx in contexts:
        kind = as_kind(getattr(ctx, "kind", KV), sid)
        if kind in found:
            raise CacheKindError(f"stream {sid}: two contexts of kind {kind.name}", sid)
        found[kind] = ctx
    return found


class KindTensors(Mapping[LMCacheSDKCacheKind, Any]):
    """What a by-kind modify fn is handed: one tensor per context kind.

    Looked up by lmcache_mp's or upstream's kind (or its value).

    Args:
        tensors: ``{kind: tensor}``.
    """

    def __init__(self, tensors: Mapping[LMCacheSDKCacheKind, Any]) -> None:
        self._tensors = dict(tensors)

    def __getitem__(self, kind: Any) -> Any:
        try:
            return self._tensors[as_kind(kind)]
        except (KeyError, CacheKindError):
            have = ", ".join(k.name for k in self._tensors)
            raise KeyError(f"no {kind!r} tensor (this stream has: {have})") from None

    def __contains__(self, kind: object) -> bool:
        try:
            return as_kind(kind) in self._tensors
        except CacheKindError:
            return False

    def __iter__(self) -> Iterator[LMCacheSDKCacheKind]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def __repr__(self) -> str:
        shapes = ", ".join(
            f"{k.name}: {tuple(getattr(v, 'shape', ()))}"
            for k, v in self._tensors.items()
        )
        return f"KindTensors({{{shapes}}})"


def edited_kv(value: Any, sid: str) -> Any:
    """The KV of a modify fn's result: the tensor itself, or the ``KV``
    entry of a mapping that holds only KV (a modify updates KV only, as
    upstream's ``modify_kv``).

    Raises:
        CacheKindError: For a mapping with another kind or without KV.
    """
    if not isinstance(value, Mapping):
        return value
    kinds = [as_kind(k, sid) for k in value]
    if kinds != [KV]:
        names = ", ".join(k.name for k in kinds) or "nothing"
        raise CacheKindError(
            f"stream {sid}: modify fn returned {names}; a modify stores the "
            "KV only: return (new_kv, new_tokens)",
            sid,
        )
    return next(iter(value.values()))
