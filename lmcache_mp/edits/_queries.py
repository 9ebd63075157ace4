"""The base of the edits that score the KV with the prompt's queries."""

from __future__ import annotations

import math
from abc import abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from lmcache_mp._util.arrays import as_numpy
from lmcache_mp.cache_kind import LMCacheSDKCacheKind
from lmcache_mp.edits._base import EditResult, _check_input
from lmcache_mp.edits._budget import TokenDrop
from lmcache_mp.errors import CacheKindError

__all__ = ["QueryDrop", "attention_probs"]

KV, QUERY = LMCacheSDKCacheKind.KV, LMCacheSDKCacheKind.QUERY

F64 = npt.NDArray[np.float64]


def _needs_query(name: str) -> str:
    return (
        f"{name} needs the prompt's queries next to its KV: give the stream a "
        "QUERY context too (create it with "
        "lmcache_mp.request.create_request([kv_ctx, query_ctx], ...), the query "
        "context being kv_ctx.for_kind(LMCacheSDKCacheKind.QUERY) of an engine "
        "that records queries), so that the modify fn is called with "
        "{KV: kv, QUERY: queries}"
    )


def attention_probs(q: F64, k: F64, positions: npt.NDArray[Any]) -> F64:
    """Causal attention of queries over keys, per head, as the model computes it.

    Args:
        q: ``[H, G, w, d]`` queries: ``G`` query heads share each of the
            ``H`` KV heads (grouped-query attention).
        k: ``[H, T, d]`` keys.
        positions: The ``w`` queries' positions: query ``i`` sees the keys
            at positions ``<= positions[i]``.

    Returns:
        ``[H, G, w, T]``: softmax over the keys of the scaled dot products
        (``1 / sqrt(d)``), zero on the keys a query does not see.
    """
    scores: F64 = np.einsum("hgwd,htd->hgwt", q, k) / math.sqrt(q.shape[-1])
    future = np.arange(k.shape[1])[None, :] > np.asarray(positions)[:, None]
    scores[:, :, future] = -np.inf
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    return scores


@dataclass(frozen=True)
class QueryDrop(TokenDrop):
    """A token-dropping edit that scores the KV with the prompt's queries.

    The modify fn of a stream with a KV and a QUERY context, called as
    ``edit({KV: kv, QUERY: queries}, tokens)``: ``kv`` ``[2, L, T,
    kv_heads * head_dim]``, ``queries`` ``[1, L, Tq, q_heads * head_dim]``,
    numpy arrays or torch tensors, keys and queries after RoPE. With ``Tq
    >= T`` the queries are of positions ``0 .. T-1`` (rows ``T..`` are not
    used); with ``Tq < T`` they are of the last ``Tq`` positions: a stream
    modified again after a decode gets the queries of the tokens computed
    since its last edit (no one computed the kept tokens' queries), and
    the edit scores with those, as kvpress's ``DecodingPress`` scores with
    the latest window; an observation window is then at most ``Tq``.
    With ``attention`` the query heads are grouped onto their KV head
    (query head ``h`` reads KV head ``h // (q_heads // kv_heads)``, as
    upstream's SnapKV notebook does); without it the whole width is one
    head and the queries must be as wide as the KV.
    """

    def __call__(self, tensors: Any, tokens: Sequence[int]) -> EditResult:
        """Score the KV with the queries and keep the chosen tokens.

        Args:
            tensors: A mapping with ``LMCacheSDKCacheKind.KV`` and
                ``LMCacheSDKCacheKind.QUERY`` (see the class docstring).
            tokens: The ``T`` token ids of the KV.

        Returns:
            ``(new_kv, new_tokens, info)``: the kept ``[2, L, T', D]`` KV
            (numpy, the KV's dtype), its ``T'`` token ids, and ``info``
            with ``kept`` and ``dropped``.

        Raises:
            CacheKindError: If ``tensors`` is not a mapping of kinds (a
                single-kind stream's bare KV), or has no QUERY or no KV.
            ValueError: If the KV is not ``[2, L, T, D]`` with ``T ==
                len(tokens)``, or the queries are not ``[1, L, Tq, Dq]`` of
                the KV's layers and the width the heads say, with ``Tq >=
                1``.
        """
        kv, queries, toks = self._check(tensors, tokens)
        return self._select(kv, queries, toks)

    def _apply(self, kv: npt.NDArray[Any], tokens: list[int]) -> EditResult:
        # Only reached through Edit's single-kind path, which __call__
        # replaces: a bare KV has no queries to score with.
        raise CacheKindError(f"{_needs_query(self.name)}; got a bare KV array")

    @abstractmethod
    def _select(
        self, kv: npt.NDArray[Any], queries: npt.NDArray[Any], tokens: list[int]
    ) -> EditResult:
        """Edit checked inputs: ``[2, L, T, D]`` KV, ``[1, L, Tq, Dq]``
        queries of its last ``Tq <= T`` positions."""

    def layout(self, width: int) -> tuple[int, int, int]:
        """Return ``(kv_heads, group, head_dim)`` for a ``width``-wide KV.

        Raises:
            ValueError: If ``attention`` does not fit ``width``.
        """
        if self.attention is None:
            return 1, 1, width
        self.check_width(width)
        return self.attention.kv_heads, self.attention.group, self.attention.head_dim

    def split_heads(
        self, keys: npt.NDArray[Any], queries: npt.NDArray[Any]
    ) -> tuple[F64, F64]:
        """One layer's keys and queries, per head, float64.

        Args:
            keys: ``[T, D]`` keys.
            queries: ``[w, Dq]`` queries.

        Returns:
            ``([H, T, d], [H, G, w, d])``: keys per KV head, queries per KV
            head and query head of its group.
        """
        heads, group, dim = self.layout(keys.shape[1])
        k = keys.astype(np.float64).reshape(len(keys), heads, dim).transpose(1, 0, 2)
        q = queries.astype(np.float64).reshape(len(queries), heads, group, dim)
        return k, q.transpose(1, 2, 0, 3)

    def _check(
        self, tensors: Any, tokens: Sequence[int]
    ) -> tuple[npt.NDArray[Any], npt.NDArray[Any], list[int]]:
        """Return the KV, the queries of its last ``min(Tq, T)`` positions,
        and the ids."""
        owner = type(self).__name__
        if not isinstance(tensors, Mapping):
            raise CacheKindError(
                f"{_needs_query(self.name)}; got a bare {type(tensors).__name__} "
                "(the modify fn of a single-kind stream gets the KV alone)"
            )
        missing = [kind.name for kind in (KV, QUERY) if kind not in tensors]
        if missing:
            given = ", ".join(getattr(k, "name", repr(k)) for k in tensors) or "none"
            raise CacheKindError(
                f"{_needs_query(self.name)}; the tensors have no "
                f"{' or '.join(missing)} (kinds given: {given})"
            )
        kv, toks = _check_input(tensors[KV], tokens, owner)
        try:
            queries = as_numpy(tensors[QUERY])
        except TypeError as exc:
            raise ValueError(f"{owner}: queries: {exc}") from exc
        _, layers, total, width = kv.shape
        if queries.ndim != 4 or queries.shape[0] != 1:
            raise ValueError(
                f"{owner}: the queries have shape {queries.shape}, expected 4-D "
                "[1, layers, tokens, width]"
            )
        heads, group, dim = self.layout(width)
        if queries.shape[1] != layers or queries.shape[3] != heads * group * dim:
            raise ValueError(
                f"{owner}: the queries have {queries.shape[1]} layers of width "
                f"{queries.shape[3]}, but the KV has {layers} of width {width}"
                + (
                    ""
                    if self.attention is None
                    else f" ({self.attention.q_heads} query heads of {dim} expected)"
                )
            )
        if queries.shape[2] < 1:
            raise ValueError(f"{owner}: the queries cover no token")
        return kv, queries[:, :, :total], toks
