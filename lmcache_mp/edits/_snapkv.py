"""SnapKV: keep the keys the prompt's last window of queries attends to."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import numpy as np
import numpy.typing as npt

from lmcache_mp._util.arrays import as_numpy
from lmcache_mp.cache_kind import LMCacheSDKCacheKind
from lmcache_mp.edits._base import (
    Edit,
    EditResult,
    _check_input,
    check_fraction,
    check_int,
)
from lmcache_mp.edits._select import keep_count, keep_indices
from lmcache_mp.errors import CacheKindError
from lmcache_mp.hints import releases_gil

__all__ = ["SnapKV"]

KV, QUERY = LMCacheSDKCacheKind.KV, LMCacheSDKCacheKind.QUERY

_NEEDS_QUERY = (
    "snapkv needs the prompt's queries next to its KV: give the stream a "
    "QUERY context too (create it with "
    "lmcache_mp.request.create_request([kv_ctx, query_ctx], ...), the query "
    "context being kv_ctx.for_kind(LMCacheSDKCacheKind.QUERY) of an engine "
    "that records queries), so that the modify fn is called with "
    "{KV: kv, QUERY: queries}"
)


@releases_gil
@dataclass(frozen=True)
class SnapKV(Edit):
    """Keep the prefix tokens the last window's queries attend to most.

    The selection of SnapKV (Li et al., 2024, "SnapKV: LLM Knows What You
    are Looking for Before Generation"). For each layer and head:

    1. the last ``window`` prompt positions (the observation window) are
       the queries; each attends to every key, as in the model: scaled dot
       products (``1 / sqrt(head_dim)``), causal within the window (window
       query ``i`` does not see the window keys after it), softmax over
       the keys;
    2. a prefix position's vote is its attention summed over the window's
       queries;
    3. the votes are pooled along the tokens, ``kernel`` wide, centred, same
       length: ``"avg"`` as ``torch.nn.functional.avg_pool1d(votes, kernel,
       stride=1, padding=kernel // 2)`` (zero padded, divided by
       ``kernel``), ``"max"`` as ``max_pool1d`` likewise. A position next
       to a strongly attended one thus scores too, so the clusters of
       information that attention picks out are kept whole;
    4. the head picks its top ``budget - window`` prefix positions by
       pooled vote (equal votes: the later position).

    Upstream SnapKV then keeps a different set of tokens per head. This KV
    has one token axis shared by every layer and head, so the per-head
    choices are combined into one selection of the same size: the prefix
    positions chosen by the most (layer, head) pairs are kept; equal counts
    are ordered by the pooled vote summed over layers and heads, then by
    position (later first). Ranking by count is a majority vote of the
    heads: a position every head wants is never lost to one that a single
    head wants strongly, and with one head in one layer it is exactly
    SnapKV's top-k. The summed vote only orders equal counts, preferring
    the position that attention favours overall. The window itself is
    always kept.

    The budget is the one the ``random`` edit gets for the same ``keep``
    (:func:`~lmcache_mp.edits._select.keep_count`): ``round(keep * T)``
    tokens in all, window included, halves up, at least 1; the whole
    window when it alone is more; every token when that is ``T`` or more.
    For the ``window`` edit at that budget, give it
    ``window=budget - sinks``. Kept tokens stay in their order.

    It is a modify fn of a stream with a KV and a QUERY context, called as
    ``edit({KV: kv, QUERY: queries}, tokens)``: ``kv`` ``[2, L, T, D]``,
    ``queries`` ``[1, L, Tq, D]`` with ``Tq >= T`` (rows ``T..`` are not
    used; queries are of the same positions as the KV, e.g. as the
    embedded engine records them), numpy arrays or torch tensors. Only K
    and the window's queries are scored; V rows follow their tokens.

    Args:
        keep: Fraction of all tokens to keep, in ``(0, 1]``.
        window: Observation window: the last prompt positions whose queries
            vote, always kept; at least 1.
        kernel: Width of the pooling along tokens: an odd int >= 1 (so
            that it is centred; 1 disables pooling).
        pooling: ``"avg"`` or ``"max"``.
        heads: Attention heads ``D`` splits into (``D = heads * head_dim``,
            heads side by side, as the embedded engine lays out K and Q;
            e.g. ``EngineConfig.kv_heads``), or ``None`` to score the whole
            width as one head. Queries and keys must have the same heads
            (no grouped-query sharing).

    Raises:
        ValueError: If a parameter is out of range; the message names it.
    """

    name: ClassVar[str] = "snapkv"

    keep: float = 0.5
    window: int = 32
    kernel: int = 5
    pooling: Literal["avg", "max"] = "avg"
    heads: int | None = None

    def __post_init__(self) -> None:
        """Check the parameters.

        Raises:
            ValueError: If a parameter is out of range; the message names it.
        """
        owner = type(self).__name__
        check_fraction(owner, "keep", self.keep)
        check_int(owner, "window", self.window, 1)
        check_int(owner, "kernel", self.kernel, 1)
        if self.kernel % 2 == 0:
            raise ValueError(
                f"{owner}: parameter 'kernel' must be odd (a centred pool of the "
                f"same length), got {self.kernel!r}"
            )
        if self.pooling not in ("avg", "max"):
            raise ValueError(
                f"{owner}: parameter 'pooling' must be 'avg' or 'max', "
                f"got {self.pooling!r}"
            )
        if self.heads is not None:
            check_int(owner, "heads", self.heads, 1)

    def __call__(self, tensors: Any, tokens: Sequence[int]) -> EditResult:
        """Keep the window and the prefix tokens the window attends to.

        Args:
            tensors: A mapping with ``LMCacheSDKCacheKind.KV``, the
                ``[2, L, T, D]`` KV, and ``LMCacheSDKCacheKind.QUERY``, the
                ``[1, L, Tq, D]`` queries of the same positions (``Tq >=
                T``); numpy arrays or torch tensors.
            tokens: The ``T`` token ids of the KV.

        Returns:
            ``(new_kv, new_tokens, info)``: the kept ``[2, L, T', D]`` KV
            (numpy, the KV's dtype), its ``T'`` token ids, and ``info`` with
            ``kept``, ``dropped`` and ``window`` (the window tokens kept).

        Raises:
            CacheKindError: If ``tensors`` is not a mapping of kinds (a
                single-kind stream's bare KV), or has no QUERY or no KV.
            ValueError: If the KV is not ``[2, L, T, D]`` with ``T ==
                len(tokens)``, the queries are not ``[1, L, Tq, D]`` of the
                KV's layers and width with ``Tq >= T``, or ``heads`` does
                not divide ``D``.
        """
        kv, queries, toks = self._check(tensors, tokens)
        return self._select(kv, queries, toks)

    def _apply(self, kv: npt.NDArray[Any], tokens: list[int]) -> EditResult:
        # Only reached through Edit's single-kind path, which __call__
        # replaces: a bare KV has no queries to score with.
        raise CacheKindError(f"{_NEEDS_QUERY}; got a bare KV array")

    def _check(
        self, tensors: Any, tokens: Sequence[int]
    ) -> tuple[npt.NDArray[Any], npt.NDArray[Any], list[int]]:
        """Return the KV, the queries of its ``T`` positions, and the ids."""
        owner = type(self).__name__
        if not isinstance(tensors, Mapping):
            raise CacheKindError(
                f"{_NEEDS_QUERY}; got a bare {type(tensors).__name__} (the "
                "modify fn of a single-kind stream gets the KV alone)"
            )
        missing = [kind.name for kind in (KV, QUERY) if kind not in tensors]
        if missing:
            given = ", ".join(getattr(k, "name", repr(k)) for k in tensors) or "none"
            raise CacheKindError(
                f"{_NEEDS_QUERY}; the tensors have no {' or '.join(missing)} "
                f"(kinds given: {given})"
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
        if queries.shape[1] != layers or queries.shape[3] != width:
            raise ValueError(
                f"{owner}: the queries have {queries.shape[1]} layers of width "
                f"{queries.shape[3]}, but the KV has {layers} of width {width}"
            )
        if queries.shape[2] < total:
            raise ValueError(
                f"{owner}: the queries cover {queries.shape[2]} tokens but the "
                f"KV {total}: the observation window's queries are missing "
                "(were they recorded for the whole prompt?)"
            )
        if self.heads is not None and width % self.heads:
            raise ValueError(
                f"{owner}: parameter 'heads' is {self.heads}, which does not "
                f"divide the KV width {width}"
            )
        return kv, queries[:, :, :total], toks

    def _select(
        self, kv: npt.NDArray[Any], queries: npt.NDArray[Any], tokens: list[int]
    ) -> EditResult:
        """Keep the window and the chosen prefix of checked inputs."""
        total = len(tokens)
        window = min(self.window, total)
        kept = keep_count(self.keep, total, window)
        info: dict[str, Any] = {"kept": kept, "dropped": total - kept}
        info["window"] = window
        if kept == total:
            return kv, tokens, info
        prefix = total - window
        slots = kept - window
        chosen = (
            self._choose(kv, queries, prefix, slots)
            if slots
            else np.empty(0, dtype=np.intp)
        )
        idx = np.concatenate([chosen, np.arange(prefix, total)])
        new_kv, new_tokens = keep_indices(kv, tokens, idx)
        return new_kv, new_tokens, info

    def _choose(
        self,
        kv: npt.NDArray[Any],
        queries: npt.NDArray[Any],
        prefix: int,
        slots: int,
    ) -> npt.NDArray[np.intp]:
        """Return the ``slots`` prefix positions kept, in increasing order."""
        picked = np.zeros(prefix, dtype=np.int64)
        summed = np.zeros(prefix, dtype=np.float64)
        # One layer at a time: the scores of every layer at once would be
        # [L, H, window, T] floats.
        for layer in range(kv.shape[1]):
            pooled = self._pooled_votes(kv[0, layer], queries[0, layer], prefix)
            picked += np.bincount(
                _top_positions(pooled, slots).ravel(), minlength=prefix
            )
            summed += pooled.sum(axis=0)
        # lexsort's last key is the primary one: count, then summed vote,
        # then position, so the tail of the order holds the positions kept.
        order = np.lexsort((np.arange(prefix), summed, picked))
        return np.sort(order[prefix - slots :]).astype(np.intp)

    def _pooled_votes(
        self, keys: npt.NDArray[Any], queries: npt.NDArray[Any], prefix: int
    ) -> npt.NDArray[np.float64]:
        """Return one layer's ``[H, prefix]`` pooled votes.

        Args:
            keys: The layer's ``[T, D]`` keys.
            queries: The layer's ``[T, D]`` queries.
            prefix: Positions before the window.
        """
        total, width = keys.shape
        heads = self.heads or 1
        dim = width // heads
        # [H, T, hd] and [H, w, hd]; float64, as the votes are summed over
        # heads and layers and their order decides the selection.
        k = keys.astype(np.float64).reshape(total, heads, dim).transpose(1, 0, 2)
        q = queries[prefix:].astype(np.float64)
        q = q.reshape(total - prefix, heads, dim).transpose(1, 0, 2)
        scores = q @ k.transpose(0, 2, 1) / math.sqrt(dim)
        # Window query i sits at position prefix + i: later keys are masked.
        future = (
            np.arange(total)[None, :] > (prefix + np.arange(total - prefix))[:, None]
        )
        scores[:, future] = -np.inf
        scores -= scores.max(axis=-1, keepdims=True)
        probs = np.exp(scores)
        probs /= probs.sum(axis=-1, keepdims=True)
        votes = probs[:, :, :prefix].sum(axis=1)
        return _pool(votes, self.kernel, self.pooling)


def _pool(
    votes: npt.NDArray[np.float64], kernel: int, pooling: str
) -> npt.NDArray[np.float64]:
    """Pool ``[H, P]`` votes along P, centred, same length (as torch's
    ``avg_pool1d``/``max_pool1d`` with stride 1 and padding ``kernel // 2``)."""
    if kernel == 1:
        return votes
    half = kernel // 2
    # avg_pool1d counts the zero padding in its mean; max_pool1d pads with
    # -inf (votes are >= 0, so a window never holds only padding).
    fill = 0.0 if pooling == "avg" else -np.inf
    padded = np.pad(votes, ((0, 0), (half, half)), constant_values=fill)
    spans = np.lib.stride_tricks.sliding_window_view(padded, kernel, axis=-1)
    pooled: npt.NDArray[np.float64] = (
        spans.sum(axis=-1) / kernel if pooling == "avg" else spans.max(axis=-1)
    )
    return pooled


def _top_positions(pooled: npt.NDArray[np.float64], count: int) -> npt.NDArray[Any]:
    """Each head's ``count`` best positions of ``[H, P]`` pooled votes.

    Equal votes favour the later position, as in the other scored edits:
    a stable sort of the reversed row puts the later of equals first.
    """
    last = pooled.shape[1] - 1
    order = np.argsort(-pooled[:, ::-1], axis=1, kind="stable")[:, :count]
    positions: npt.NDArray[Any] = last - order
    return positions
