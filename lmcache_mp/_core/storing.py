"""How a stream's edit reaches its context: the checks of an edited
tensor, and writing it over cached chunks where the context allows."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from typing import Any

import numpy.typing as npt

from lmcache_mp._core.kinds import edited_kv
from lmcache_mp._core.validate import check_tokens
from lmcache_mp._util.arrays import as_numpy
from lmcache_mp.cache_kind import LMCacheSDKCacheKind
from lmcache_mp.errors import StreamInputError
from lmcache_mp.kv import KVContext

__all__ = ["check_edit", "store_edit"]

KV = LMCacheSDKCacheKind.KV


def check_edit(
    kv: Any, tokens: Sequence[int], kind: LMCacheSDKCacheKind, sid: str
) -> tuple[npt.NDArray[Any], list[int]]:
    """Return an edited tensor of ``kind`` as numpy and its tokens as ints.

    Args:
        kv: The tensor (for KV, also a mapping holding only KV).
        tokens: The token ids it belongs to.
        kind: Its cache kind: fixes the first axis (2 for KV, 1 for QUERY).
        sid: The stream, named in errors.

    Returns:
        ``(array, tokens)``.

    Raises:
        StreamInputError: If it is not a 4-D ``[planes, L, T, D]`` array with
            ``T == len(tokens)``, the tokens are not token ids, or there are
            none.
        CacheKindError: If a mapping holds another kind.
    """
    try:
        arr = as_numpy(edited_kv(kv, sid) if kind is KV else kv)
    except TypeError as exc:
        raise StreamInputError(
            f"stream {sid}: the new {kind.name}: {exc}", sid
        ) from exc
    toks = check_tokens(tokens, sid, "new_tokens")
    if not toks:
        # A stream with no tokens has no chunk to cache: every later modify
        # would wait for KV that can never be stored.
        raise StreamInputError(
            f"stream {sid}: the edit returned no tokens; keep at least one", sid
        )
    if arr.ndim != 4 or arr.shape[0] != kind.planes:
        raise StreamInputError(
            f"stream {sid}: the new {kind.name} has shape {arr.shape}, "
            f"expected 4-D [{kind.planes}, layers, tokens, width]",
            sid,
        )
    if arr.shape[2] != len(toks):
        raise StreamInputError(
            f"stream {sid}: the new {kind.name} has {arr.shape[2]} tokens "
            "on axis 2 "
            f"but {len(toks)} token ids were given",
            sid,
        )
    return arr, toks


@functools.lru_cache(maxsize=64)
def _can_overwrite(ctx_type: type[Any]) -> bool:
    """Whether a context type's ``store`` takes ``overwrite=``."""
    try:
        return "overwrite" in inspect.signature(ctx_type.store).parameters
    except (AttributeError, TypeError, ValueError):
        return False


def store_edit(
    ctx: KVContext, kv: Any, tokens: list[int], salt: str, *, replace: bool
) -> bool:
    """Store an edited KV; with ``replace``, over the chunks already cached.

    Upstream's store skips chunks already cached, so an edit that keeps the
    tokens (quantization, smoothing) would never land and only log "already
    cached". Such an edit (``replace``) overwrites them where the context's
    ``store`` takes ``overwrite=`` (the embedded store). An edit that changes
    the tokens never overwrites: chunks the stream's previous state still
    uses stay intact until its new state is committed.
    """
    if replace and _can_overwrite(type(ctx)):
        return bool(ctx.store(kv, tokens, salt, overwrite=True))  # type: ignore[call-arg]
    return ctx.store(kv, tokens, salt)
