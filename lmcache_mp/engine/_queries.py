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
from lmcache_mp.kv import KVContext, KVStore

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
) -> int | None:
    """Fill the reused positions' queries from the store, store the rest.

    Positions whose KV was reused were not computed by this call: their
    queries come from ``query_ctx``. Where it has fewer of them than were
    reused (the KV is an edit's, whose queries no one computed), the stored
    ones and the computed ones have a hole between them, and a query tensor
    with a hole in it would misplace every later row: the known prefix
    from position 0 is stored as it is, and the computed rows from the
    first chunk boundary at or after ``reused`` go in as a range (a
    :class:`~lmcache_mp.kv.KVStore` takes one, as LMCache's store mask
    skips a prefix; a context of the protocol alone stores whole prefixes
    only, so it gets none). Those are the queries of the tokens generated
    since the edit, which query-aware edits score with across decode.

    Args:
        query_ctx: The QUERY context.
        queries: ``[1, L, len(prompt), D]``, computed from ``reused`` on;
            rows before ``reused`` are filled in place where known.
        prompt: The prompt.
        reused: Leading positions whose KV came from the cache.
        salt: The call's cache salt.

    Returns:
        The first position from which every query row of ``queries`` is
        either stored or computed (0 without a hole), so that later rows
        may be stored after it; ``None`` where no later row may be stored
        (a hole, and a context that takes no range).

    Raises:
        KVConfigError: If the stored queries' layout is not ``queries``'.
    """
    got = reused
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
    if got >= reused:
        query_ctx.store(queries, prompt, salt)
        return 0
    # Positions got..reused-1 were neither computed nor cached.
    if not isinstance(query_ctx, KVStore):
        return None
    size = query_ctx.chunk_size
    first = -(-reused // size) * size
    if first + size <= len(prompt):
        query_ctx.store(queries[:, :, first:], prompt, salt, start=first)
    return first
