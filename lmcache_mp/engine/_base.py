"""What every embedded engine is: a ``post_completion`` over a KV context
(and a QUERY context to record queries in), pickled by its arguments."""

from __future__ import annotations

import abc
import functools
from typing import Any

from lmcache_mp.engine._decode_cache import DecodeCache
from lmcache_mp.engine._queries import check_query_ctx
from lmcache_mp.engine._stats import StatsCounter
from lmcache_mp.kv import KVContext

__all__ = ["CachingEngine"]


class CachingEngine(StatsCounter, abc.ABC):
    """The contexts, totals and pickling the embedded engines share.

    A subclass is built as ``cls(*self._args(), query_ctx=...)``; it
    pickles as exactly that, so it travels to a worker for a few hundred
    bytes and rebuilds its model there once per process.

    Args:
        ctx: The KV context to retrieve from and store to.
        query_ctx: A QUERY-kind context to record prompts' queries in, e.g.
            ``ctx.for_kind(LMCacheSDKCacheKind.QUERY)``; ``None`` records
            nothing.
        save_decode_cache: Also store the KV (and queries) of generated
            tokens, each chunk as it completes, as vLLM + LMCache's
            ``save_decode_cache`` does; ``False`` stores the prompt's only.

    Raises:
        CacheKindError: If ``query_ctx``'s kind is not QUERY.
    """

    def __init__(
        self,
        ctx: KVContext,
        query_ctx: KVContext | None,
        save_decode_cache: bool = True,
    ) -> None:
        super().__init__()
        check_query_ctx(query_ctx)
        self._ctx = ctx
        self._query_ctx = query_ctx
        self._save_decode_cache = bool(save_decode_cache)

    @abc.abstractmethod
    def _args(self) -> tuple[Any, ...]:
        """The positional arguments that rebuild this engine."""

    def _kwargs(self) -> dict[str, Any]:
        """The keyword arguments that differ from their defaults."""
        kwargs: dict[str, Any] = {}
        if self._query_ctx is not None:
            kwargs["query_ctx"] = self._query_ctx
        if not self._save_decode_cache:
            kwargs["save_decode_cache"] = False
        return kwargs

    def __reduce__(self) -> tuple[Any, ...]:
        kwargs = self._kwargs()
        if not kwargs:
            return (type(self), self._args())
        # The options are keyword-only: a partial carries them (and the class).
        return (functools.partial(type(self), **kwargs), self._args())

    def __repr__(self) -> str:
        args = [repr(a) for a in self._args()]
        args += [f"{name}={value!r}" for name, value in self._kwargs().items()]
        return f"{type(self).__name__}({', '.join(args)})"

    @property
    def ctx(self) -> KVContext:
        """The KV context the engine reads and writes."""
        return self._ctx

    @property
    def query_ctx(self) -> KVContext | None:
        """The QUERY context prompts' queries are recorded in, if any."""
        return self._query_ctx

    @property
    def save_decode_cache(self) -> bool:
        """Whether generated tokens' KV (and queries) are stored too."""
        return self._save_decode_cache

    def _decode_cache(
        self, prompt: list[int], salt: str, queries_from: int | None
    ) -> DecodeCache | None:
        """What stores this generation's decode chunks, if the engine does."""
        if not self._save_decode_cache:
            return None
        return DecodeCache(self._ctx, self._query_ctx, prompt, salt, queries_from)
