"""Saving the KV (and queries) of generated tokens, a chunk at a time.

vLLM with LMCache stores the KV of decoded tokens when its
``save_decode_cache`` setting is on: each time the generated tokens fill a
chunk, that chunk is offloaded, keyed by the whole token prefix (prompt and
generated tokens) and the salt, as a prompt's chunks are. A later request
for the prompt plus its generation then reuses that KV, and a modify sees
it. The embedded engines do the same: the KV of a generated token exists
once the next step has run it through the model, so the tokens counted
here are those whose KV the engine holds, never the last one sampled.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lmcache_mp.kv import KVContext, KVStore

__all__ = ["DecodeCache", "Rows", "rows_of"]

#: ``(start, end) -> [.., end - start, ..]``: positions' rows of a tensor.
Rows = Callable[[int, int], Any]


def rows_of(tensor: Any) -> Rows:
    """Positions ``start .. end-1`` of a ``[*, L, T, D]`` tensor, as a view."""
    return lambda start, end: tensor[:, :, start:end]


def _store_range(
    ctx: KVContext, rows: Rows, tokens: list[int], salt: str, start: int
) -> None:
    """Store the chunk of ``tokens`` that begins at ``start``."""
    end = len(tokens)
    if isinstance(ctx, KVStore):
        # Both backends take a range, as LMCache's store mask skips a
        # stored prefix: only the new chunk is copied.
        ctx.store(rows(start, end), tokens, salt, start=start)
    else:
        # A context of the protocol alone stores whole prefixes, skipping
        # the chunks it holds.
        ctx.store(rows(0, end), tokens, salt)


class DecodeCache:
    """One generation's saving of decode KV, chunk by chunk.

    Args:
        ctx: The KV context the prompt's chunks went to.
        query_ctx: The QUERY context the prompt's queries went to, or
            ``None``.
        prompt: The prompt (its full chunks are stored already).
        salt: The call's cache salt.
        queries_from: The first position from which every query row is
            stored or computed (what :func:`record_queries
            <lmcache_mp.engine._queries.record_queries>` returns), or
            ``None``: generated tokens' queries are stored only in chunks
            that begin there or later (a query tensor with a hole in it
            would misplace every later row).
    """

    def __init__(
        self,
        ctx: KVContext,
        query_ctx: KVContext | None,
        prompt: list[int],
        salt: str,
        queries_from: int | None,
    ) -> None:
        self._ctx = ctx
        self._query_ctx = query_ctx
        self._chunk = ctx.chunk_size
        self._tokens = list(prompt)
        self._salt = salt
        self._stored = len(prompt) // self._chunk * self._chunk
        self._queries_from = queries_from

    def computed(self, token: int, kv: Rows, queries: Rows | None = None) -> None:
        """Note that the model has run ``token`` (its KV exists now); store
        the chunk it completes, if it completes one.

        Args:
            token: The generated token the model has just run.
            kv: The sequence's KV rows: ``kv(start, end)`` is ``[2, L,
                end - start, D]``.
            queries: Its query rows, ``[1, L, end - start, Dq]``, when
                queries are recorded.
        """
        self._tokens.append(token)
        begin = self._stored
        if len(self._tokens) < begin + self._chunk:
            return
        tokens = self._tokens[: begin + self._chunk]
        # Queries first, as for a prompt: whoever finds this KV finds its
        # queries too.
        if (
            self._query_ctx is not None
            and queries is not None
            and self._queries_from is not None
            and begin >= self._queries_from
        ):
            _store_range(self._query_ctx, queries, tokens, self._salt, begin)
        _store_range(self._ctx, kv, tokens, self._salt, begin)
        self._stored = begin + self._chunk
