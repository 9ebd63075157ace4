"""Recording a prompt's queries in a QUERY context, for query-aware edits.

Upstream LMCache's vLLM patch exports the post-RoPE queries beside the KV;
the embedded engines store them the same way: a ``[1, L, T,
q_heads x head_dim]`` tensor over the same chunk-aligned token ranges as
the KV.
"""

from __future__ import annotations

from typing import Any

import numpy.typing as npt

from lmcache_mp._util.arrays import as_numpy
from lmcache_mp.cache_kind import LMCacheSDKCacheKind
from lmcache_mp.errors import CacheKindError, KVConfigError
from lmcache_mp.kv import KVContext

__all__ = ["check_query_ctx", "record_queries"]


def check_query_ctx(query_ctx: KVContext | None) -> None:
    """Check that ``query_ctx`` is ``None`` or a QUERY-kind context.

    Raises:
        CacheKindError: If its ``kind`` is not ``LMCacheSDKCacheKind.QUERY``
            (a KV context there would get queries stored over its KV).
    """
    if query_ctx is None:
        return
    kind = getattr(query_ctx, "kind", None)
    # By value: upstream's own enum members name the same kinds.
    if getattr(kind, "value", kind) != LMCacheSDKCacheKind.QUERY.value:
        raise CacheKindError(
            f"query_ctx must be a QUERY context (e.g. "
            f"ctx.for_kind(LMCacheSDKCacheKind.QUERY)), got "
            f"{query_ctx!r} of kind {kind!r}"
        )


def record_queries(
    query_ctx: KVContext,
    queries: npt.NDArray[Any],
    prompt: list[int],
    reused: int,
    salt: str,
) -> int:
    """Fill the reused positions' queries from the store, store the rest.

    Positions whose KV was reused were not computed by this call: their
    queries come from ``query_ctx``. Where it has fewer of them than were
    reused, only the contiguous known prefix from position 0 is stored (a
    query tensor with a hole in it would misplace every later row); the
    next cold prefill of the prompt fills in the rest.

    Args:
        query_ctx: The QUERY context.
        queries: ``[1, L, len(prompt), D]``, computed from ``reused`` on;
            rows before ``reused`` are filled in place.
        prompt: The prompt.
        reused: Leading positions whose KV came from the cache.
        salt: The call's cache salt.

    Returns:
        How many leading positions' queries are stored now.

    Raises:
        KVConfigError: If the stored queries' layout is not ``queries``'.
    """
    known = len(prompt)
    if reused:
        cached = query_ctx.retrieve(prompt, salt)
        got = 0
        if cached is not None:
            stored = as_numpy(cached)
            _, layers, _, width = queries.shape
            if (
                stored.ndim != 4
                or stored.shape[:2] != (1, layers)
                or stored.shape[3] != width
            ):
                raise KVConfigError(
                    f"the query context returned queries of shape "
                    f"{tuple(stored.shape)}, but the engine's model needs "
                    f"[1, {layers}, T, {width}]"
                )
            got = min(int(stored.shape[2]), reused)
            queries[:, :, :got] = stored[:, :, :got]
        if got < reused:
            # Positions got..reused-1 were neither computed nor cached.
            known = got
    if known:
        query_ctx.store(queries[:, :, :known], prompt[:known], salt)
    return known
