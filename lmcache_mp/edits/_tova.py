"""TOVA: keep the tokens the last query attends to most."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import numpy as np
import numpy.typing as npt

from lmcache_mp.edits._base import EditResult
from lmcache_mp.edits._queries import QueryDrop, attention_probs
from lmcache_mp.edits._scored import EndsDrop
from lmcache_mp.hints import releases_gil

__all__ = ["ACROSS_LAYERS", "TOVA"]

#: The values of :attr:`TOVA.across_layers`.
ACROSS_LAYERS = ("union", "mean")


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
    layer and keeps one subset per layer (as kvpress's ``TOVAPress`` does);
    a stream keeps one token subset for all layers, merged from the layers'
    scores by ``across_layers``: ``"union"`` (the default) ranks the tokens
    within each layer and gives each token its best rank in any layer
    (equal ranks by the mean over layers), so that the kept tokens are the
    union of every layer's own top tokens, as far as the budget goes;
    ``"mean"`` averages the layers' scores, which ranks low a token that
    one layer needs and the others ignore. The first ``keep_first`` (none by
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
        across_layers: How the layers' scores make one subset: ``"union"``
            (default) or ``"mean"``.

    Raises:
        ValueError: If a parameter is out of range; the message names it.
    """

    name: ClassVar[str] = "tova"

    keep_first: int = 0
    keep_last: int = 1
    across_layers: Literal["mean", "union"] = "union"

    def __post_init__(self) -> None:
        """Check the parameters.

        Raises:
            ValueError: If a parameter is out of range; the message names it.
        """
        super().__post_init__()
        if self.across_layers not in ACROSS_LAYERS:
            raise ValueError(
                f"{type(self).__name__}: parameter 'across_layers' must be one "
                f"of {', '.join(map(repr, ACROSS_LAYERS))}, got "
                f"{self.across_layers!r}"
            )

    def _select(
        self, kv: npt.NDArray[Any], queries: npt.NDArray[Any], tokens: list[int]
    ) -> EditResult:
        return self.keep_ends_and_top(
            kv, tokens, lambda lo, hi: self._priority(kv, queries, lo, hi)
        )

    def _priority(
        self, kv: npt.NDArray[Any], queries: npt.NDArray[Any], lo: int, hi: int
    ) -> npt.NDArray[np.float64]:
        """The keep-priority of tokens ``lo..hi-1``, from each layer's scores."""
        layers = self._layer_scores(kv, queries)[:, lo:hi]
        mean: npt.NDArray[np.float64] = layers.mean(axis=0)
        if self.across_layers == "mean":
            return mean
        # Rank 0 is a layer's best token; a token's priority is its best
        # rank in any layer, and of equal ranks the higher mean goes first
        # (the mean, scaled into [0, 1), only orders tokens within a rank).
        ranks = np.argsort(np.argsort(-layers, axis=1, kind="stable"), axis=1)
        tiebreak = mean / (2.0 * mean.max()) if mean.max() > 0 else mean
        priority: npt.NDArray[np.float64] = tiebreak - ranks.min(axis=0)
        return priority

    def _layer_scores(
        self, kv: npt.NDArray[Any], queries: npt.NDArray[Any]
    ) -> npt.NDArray[np.float64]:
        """The last query's attention to each of the ``T`` keys, averaged
        over a layer's query heads: ``[L, T]``."""
        total = kv.shape[2]
        scores = np.empty((kv.shape[1], total), dtype=np.float64)
        for layer in range(kv.shape[1]):
            k, q = self.split_heads(kv[0, layer], queries[0, layer, -1:])
            probs = attention_probs(q, k, np.array([total - 1]))
            scores[layer] = probs.mean(axis=(0, 1, 2))
        return scores
