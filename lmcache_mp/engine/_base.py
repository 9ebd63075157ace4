"""What every embedded engine is: a ``post_completion`` over a KV context
(and a QUERY context to record queries in), pickled by its arguments."""

from __future__ import annotations

import abc
import functools
from typing import Any

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

    Raises:
        CacheKindError: If ``query_ctx``'s kind is not QUERY.
    """

    def __init__(self, ctx: KVContext, query_ctx: KVContext | None) -> None:
        super().__init__()
        check_query_ctx(query_ctx)
        self._ctx = ctx
        self._query_ctx = query_ctx

    @abc.abstractmethod
    def _args(self) -> tuple[Any, ...]:
        """The positional arguments that rebuild this engine."""

    def __reduce__(self) -> tuple[Any, ...]:
        if self._query_ctx is None:
            return (type(self), self._args())
        # query_ctx is keyword-only: a partial carries it (and the class).
        rebuild = functools.partial(type(self), query_ctx=self._query_ctx)
        return (rebuild, self._args())

    def __repr__(self) -> str:
        args = ", ".join(repr(a) for a in self._args())
        if self._query_ctx is not None:
            args += f", query_ctx={self._query_ctx!r}"
        return f"{type(self).__name__}({args})"

    @property
    def ctx(self) -> KVContext:
        """The KV context the engine reads and writes."""
        return self._ctx

    @property
    def query_ctx(self) -> KVContext | None:
        """The QUERY context prompts' queries are recorded in, if any."""
        return self._query_ctx
