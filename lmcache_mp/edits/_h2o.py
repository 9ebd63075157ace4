"""H2O: keep the heavy hitters of cumulative attention, and the recent tokens."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from lmcache_mp.edits._base import EditResult, check_fraction, check_int
from lmcache_mp.edits._queries import QueryDrop
from lmcache_mp.edits._select import choose_top
from lmcache_mp.hints import releases_gil

__all__ = ["H2O"]


@releases_gil
@dataclass(frozen=True)
class H2O(QueryDrop):
    """Keep the tokens that received the most attention, and the recent ones.

    The rule of H2O (Zhang et al., 2023, "H2O: Heavy-Hitter Oracle for
    Efficient Generative Inference of Large Language Models"): a key's
    importance is the attention it accumulates. Every prompt query attends
    causally to the keys up to its own position, as in the model (scaled
    dot products, softmax); a key's score is the sum of the attention it
    receives from every query at or after it, per layer and query head
    (grouped onto its KV head with ``attention``), summed over heads and
    layers so that the stream keeps one token subset. That is ``O(T^2 *
    head_dim)`` per layer and head: the queries are taken ``block`` at a
    time (each block only against the keys it can see), so memory stays
    ``O(heads * block * T)``.

    Of the budget (``keep`` or ``budget``), ``round(recent * budget)`` go
    to the most recent tokens (H2O's recent window; the paper splits the
    budget evenly), the rest to the heavy hitters: the highest-scored
    tokens before the window (of equal scores the later). Kept tokens stay
    in their order; ``rerotate`` moves their keys' RoPE.

    A modify fn of a stream with a KV and a QUERY context (see
    :class:`~lmcache_mp.edits._queries.QueryDrop`); it needs the queries of
    every prompt position.

    Args:
        keep: Fraction of all tokens to keep, in ``(0, 1]`` (default 0.5).
        budget: Tokens to keep, instead of ``keep``.
        rerotate: Move the kept keys' RoPE: ``"compact"`` (or ``True``)
            to positions ``0 .. kept - 1``, ``"shift"`` each by
            ``-(T - kept)``.
        attention: The model's attention shape and RoPE (GQA; rerotate).
        recent: Share of the budget given to the most recent tokens, in
            ``(0, 1]``; at least one token.
        block: Queries scored at once, at least 1.

    Raises:
        ValueError: If a parameter is out of range; the message names it.
    """

    name: ClassVar[str] = "h2o"

    recent: float = 0.5
    block: int = 256

    def __post_init__(self) -> None:
        """Check the parameters.

        Raises:
            ValueError: If a parameter is out of range; the message names it.
        """
        super().__post_init__()
        owner = type(self).__name__
        check_fraction(owner, "recent", self.recent)
        check_int(owner, "block", self.block, 1)

    def _select(
        self, kv: npt.NDArray[Any], queries: npt.NDArray[Any], tokens: list[int]
    ) -> EditResult:
        total = len(tokens)
        kept = self.kept_count(total, 1)
        if kept == total:
            return kv, tokens, {"kept": total, "dropped": 0}
        window = min(kept, max(1, math.floor(self.recent * kept + 0.5)))
        prefix = total - window
        scores = self._scores(kv, queries)
        chosen = choose_top(scores[:prefix], kept - window)
        idx = np.concatenate([chosen, np.arange(prefix, total)])
        new_kv, new_tokens = self.gather(kv, tokens, idx)
        info = {"kept": kept, "dropped": total - kept, "recent": window}
        return new_kv, new_tokens, info

    def _scores(
        self, kv: npt.NDArray[Any], queries: npt.NDArray[Any]
    ) -> npt.NDArray[np.float64]:
        """Each key's attention received from the queries (of the last
        ``Tq`` positions), summed over query heads and layers."""
        total, width = kv.shape[2], kv.shape[3]
        first = total - queries.shape[2]
        heads, group, dim = self.layout(width)
        scale = 1.0 / math.sqrt(dim)
        scores = np.zeros(total, dtype=np.float64)
        # future[i, j]: key start + j lies after query start + i.
        size = min(self.block, total - first)
        future = np.triu(np.ones((size, size), dtype=bool), k=1)
        for layer in range(kv.shape[1]):
            # float32 for the T^2 part (BLAS sgemm, exp); the sums float64.
            k = kv[0, layer].astype(np.float32).reshape(total, heads, dim)
            k = k.transpose(1, 2, 0)[:, None]  # [H, 1, d, T]
            q = queries[0, layer].astype(np.float32) * np.float32(scale)
            q = q.reshape(total - first, heads, group, dim).transpose(1, 2, 0, 3)
            for start in range(first, total, size):
                stop = min(start + size, total)
                # Queries start..stop-1 see keys 0..stop-1 only; of those,
                # only the block's own keys can lie after a query.
                logits = q[:, :, start - first : stop - first] @ k[..., :stop]
                diagonal = logits[..., start:stop]
                diagonal[..., future[: stop - start, : stop - start]] = -np.inf
                logits -= logits.max(axis=-1, keepdims=True)
                np.exp(logits, out=logits)
                logits /= logits.sum(axis=-1, keepdims=True)
                scores[:stop] += logits.sum(axis=(0, 1, 2), dtype=np.float64)
        return scores
