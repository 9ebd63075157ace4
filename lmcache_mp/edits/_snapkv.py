"""SnapKV: keep the keys the prompt's last window of queries attends to."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import numpy as np
import numpy.typing as npt

from lmcache_mp.edits._base import EditResult, check_int, check_kernel
from lmcache_mp.edits._queries import QueryDrop, attention_probs
from lmcache_mp.hints import releases_gil

__all__ = ["SnapKV"]


@releases_gil
@dataclass(frozen=True)
class SnapKV(QueryDrop):
    """Keep the prefix tokens the last window's queries attend to most.

    The selection of SnapKV (Li et al., 2024, "SnapKV: LLM Knows What You
    are Looking for Before Generation"). For each layer and query head
    (grouped onto its KV head with ``attention``, as upstream's SnapKV
    notebook does):

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
    positions chosen by the most (layer, query head) pairs are kept; equal counts
    are ordered by the pooled vote summed over layers and heads, then by
    position (later first). Ranking by count is a majority vote of the
    heads: a position every head wants is never lost to one that a single
    head wants strongly, and with one head in one layer it is exactly
    SnapKV's top-k. The summed vote only orders equal counts, preferring
    the position that attention favours overall. The window itself is
    always kept.

    The budget is the one the ``random`` edit gets for the same ``keep``
    (:func:`~lmcache_mp.edits._select.keep_count`): ``round(keep * T)``
    tokens (or ``budget``) in all, window included, halves up, at least 1;
    the whole window when it alone is more; every token when that is ``T``
    or more. For the ``window`` edit at that budget, give it
    ``window=budget - sinks``. Kept tokens stay in their order;
    ``rerotate`` moves their keys' RoPE.

    It is a modify fn of a stream with a KV and a QUERY context, called as
    ``edit({KV: kv, QUERY: queries}, tokens)`` (see
    :class:`~lmcache_mp.edits._queries.QueryDrop`). Only K and the window's
    queries are scored; V rows follow their tokens.

    Args:
        keep: Fraction of all tokens to keep, in ``(0, 1]`` (default 0.5).
        budget: Tokens to keep, instead of ``keep``.
        rerotate: Move the kept keys' RoPE: ``"compact"`` (or ``True``)
            to positions ``0 .. kept - 1``, ``"shift"`` each by
            ``-(T - kept)``.
        attention: The model's attention shape and RoPE: query heads are
            grouped onto their KV head (GQA); needed by ``rerotate``.
        window: Observation window: the last prompt positions whose queries
            vote, always kept; at least 1.
        kernel: Width of the pooling along tokens: an odd int >= 1 (so
            that it is centred; 1 disables pooling).
        pooling: ``"avg"`` or ``"max"``.
        heads: Without ``attention``: attention heads ``D`` splits into
            (``D = heads * head_dim``, heads side by side, queries and keys
            with the same heads, e.g. ``EngineConfig.kv_heads``), or
            ``None`` to score the whole width as one head.

    Raises:
        ValueError: If a parameter is out of range, or both ``heads`` and
            ``attention`` are given; the message names it.
    """

    name: ClassVar[str] = "snapkv"

    window: int = 32
    kernel: int = 5
    pooling: Literal["avg", "max"] = "avg"
    heads: int | None = None

    def __post_init__(self) -> None:
        """Check the parameters.

        Raises:
            ValueError: If a parameter is out of range; the message names it.
        """
        super().__post_init__()
        owner = type(self).__name__
        check_int(owner, "window", self.window, 1)
        check_kernel(owner, self.kernel)
        if self.pooling not in ("avg", "max"):
            raise ValueError(
                f"{owner}: parameter 'pooling' must be 'avg' or 'max', "
                f"got {self.pooling!r}"
            )
        if self.heads is not None:
            check_int(owner, "heads", self.heads, 1)
            if self.attention is not None:
                raise ValueError(
                    f"{owner}: give 'heads' or 'attention' (which has the heads), "
                    "not both"
                )

    def layout(self, width: int) -> tuple[int, int, int]:
        """Return ``(kv_heads, group, head_dim)``: ``heads`` of one query each
        when given, else as :class:`~lmcache_mp.edits._queries.QueryDrop`.

        Raises:
            ValueError: If ``heads`` does not divide ``width``.
        """
        if self.heads is None:
            return super().layout(width)
        if width % self.heads:
            raise ValueError(
                f"{type(self).__name__}: parameter 'heads' is {self.heads}, which "
                f"does not divide the KV width {width}"
            )
        return self.heads, 1, width // self.heads

    def _select(
        self, kv: npt.NDArray[Any], queries: npt.NDArray[Any], tokens: list[int]
    ) -> EditResult:
        """Keep the window and the chosen prefix of checked inputs."""
        total = len(tokens)
        window = min(self.window, total, queries.shape[2])
        kept = self.kept_count(total, window)
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
        new_kv, new_tokens = self.gather(kv, tokens, idx)
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
        """Return one layer's ``[q_heads, prefix]`` pooled votes.

        Args:
            keys: The layer's ``[T, D]`` keys.
            queries: The layer's ``[Tq, Dq]`` queries, of its last ``Tq``
                positions.
            prefix: Positions before the window.
        """
        total = len(keys)
        # float64, as the votes are summed over heads and layers and their
        # order decides the selection.
        k, q = self.split_heads(keys, queries[len(queries) - (total - prefix) :])
        # Window query i sits at position prefix + i: later keys are masked.
        probs = attention_probs(q, k, np.arange(prefix, total))
        # [H, G, w, T] -> [H * G, prefix]: one voter per query head.
        votes = probs[..., :prefix].sum(axis=2).reshape(-1, prefix)
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
