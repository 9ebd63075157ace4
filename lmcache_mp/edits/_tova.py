"""TOVA: keep the tokens the last query attends to most."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from lmcache_mp.edits._base import EditResult
from lmcache_mp.edits._queries import QueryDrop, attention_probs
from lmcache_mp.edits._scored import EndsDrop
from lmcache_mp.hints import releases_gil

__all__ = ["TOVA"]


@releases_gil
@dataclass(frozen=True)
class TOVA(QueryDrop, EndsDrop):
    """Keep the tokens with the highest attention from the last query.

    The rule of TOVA (Oren et al., 2024, "Transformers are Multi-State
    RNNs"): the attention the current token pays to each cached token, as
    the model computes it (scaled dot products, softmax over the ``T``
    keys), decides what stays. The last prompt position's query is scored
    against every key in each layer and query head (grouped onto its KV
    head with ``attention``); TOVA averages the weights over the heads of a
    layer, and the averages are also averaged over layers here, so that the
    stream keeps one token subset. The first ``keep_first`` (none by
    default) and the last ``keep_last`` tokens (by default the last one:
    the query's own) are always kept, and the highest-scored tokens
    between, so that the budget is met exactly; of equal scores the later
    token is kept. Kept tokens stay in their order; ``rerotate`` moves
    their keys' RoPE.

    A modify fn of a stream with a KV and a QUERY context (see
    :class:`~lmcache_mp.edits._queries.QueryDrop`).

    Args:
        keep: Fraction of all tokens to keep, in ``(0, 1]`` (default 0.5).
        budget: Tokens to keep, instead of ``keep``.
        rerotate: Move the kept keys' RoPE: ``"compact"`` (or ``True``)
            to positions ``0 .. kept - 1``, ``"shift"`` each by
            ``-(T - kept)``.
        attention: The model's attention shape and RoPE (GQA; rerotate).
        keep_first: Leading tokens always kept.
        keep_last: Trailing tokens always kept.

    Raises:
        ValueError: If a parameter is out of range; the message names it.
    """

    name: ClassVar[str] = "tova"

    keep_first: int = 0
    keep_last: int = 1

    def _select(
        self, kv: npt.NDArray[Any], queries: npt.NDArray[Any], tokens: list[int]
    ) -> EditResult:
        return self.keep_ends_and_top(
            kv, tokens, lambda lo, hi: self._scores(kv, queries)[lo:hi]
        )

    def _scores(
        self, kv: npt.NDArray[Any], queries: npt.NDArray[Any]
    ) -> npt.NDArray[np.float64]:
        """The last query's attention to each of the ``T`` keys, averaged
        over query heads and layers."""
        total = kv.shape[2]
        scores = np.zeros(total, dtype=np.float64)
        for layer in range(kv.shape[1]):
            k, q = self.split_heads(kv[0, layer], queries[0, layer, -1:])
            probs = attention_probs(q, k, np.array([total - 1]))
            scores += probs.mean(axis=(0, 1, 2))
        scores /= kv.shape[1]
        return scores
