"""Expected attention: keep the keys that future queries are expected to attend to."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from lmcache_mp.edits._base import EditResult, check_int
from lmcache_mp.edits._queries import QueryDrop
from lmcache_mp.edits._scored import EndsDrop
from lmcache_mp.hints import releases_gil

__all__ = ["ExpectedAttention"]

F64 = npt.NDArray[np.float64]


def _rotate_half(x: F64) -> F64:
    """``concat(-x[d/2:], x[:d/2])`` over the last axis, as transformers'
    RoPE pairs channel ``i`` with ``i + d/2``."""
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


@releases_gil
@dataclass(frozen=True)
class ExpectedAttention(QueryDrop, EndsDrop):
    """Keep the tokens that the next queries are expected to attend to most.

    The rule of Expected Attention (Devoto et al., 2025, kvpress's
    ``ExpectedAttentionPress``): future queries are unknown, so each
    layer's queries are modelled as a Gaussian, fitted to the recorded
    ones before RoPE (their mean and covariance, the first ``keep_first``
    positions left out as attention sinks), and carried to the next
    ``future`` positions by the RoPE rotation averaged over them. A key's
    expected attention logit under that Gaussian is ``k·μ / sqrt(d) +
    kᵀΣk / (2d)``; a softmax over the keys (the protected first ones left
    out), averaged over the query heads of each KV head, weighted by the
    norm of the key's value, scores each token. kvpress keeps a separate
    subset per KV head; here the scores are averaged over heads and layers,
    so that the stream keeps one subset, the form a vLLM + LMCache KV
    stores. The first ``keep_first`` tokens (kvpress's ``n_sink``) and
    the last ``keep_last`` are always kept, and the highest-scored tokens
    between, so that the budget is met exactly. Kept tokens stay in their
    order; ``rerotate`` moves their keys' RoPE.

    A modify fn of a stream with a KV and a QUERY context (see
    :class:`~lmcache_mp.edits._queries.QueryDrop`); the queries are taken
    to be of the KV's last positions, after RoPE.

    Args:
        keep: Fraction of all tokens to keep, in ``(0, 1]`` (default 0.5).
        budget: Tokens to keep, instead of ``keep``.
        rerotate: Move the kept keys' RoPE: ``"compact"`` (or ``True``)
            to positions ``0 .. kept - 1``, ``"shift"`` each by
            ``-(T - kept)``.
        attention: The model's attention shape and RoPE (required: the
            queries' RoPE is undone, and averaged over the future).
        keep_first: Leading tokens always kept, and left out of the query
            statistics and of the softmax (attention sinks).
        keep_last: Trailing tokens always kept.
        future: Positions after the KV over which the RoPE rotation of
            the expected query is averaged (kvpress's
            ``n_future_positions``).
        covariance: Use the queries' covariance, not their mean alone.
        value_norm: Weight each token's score by the norm of its value.

    Raises:
        ValueError: If a parameter is out of range, or ``attention`` is
            not given; the message names it.
    """

    name: ClassVar[str] = "expected_attention"

    keep_first: int = 4
    keep_last: int = 0
    future: int = 512
    covariance: bool = True
    value_norm: bool = True

    def __post_init__(self) -> None:
        """Check the parameters (see the class docstring).

        Raises:
            ValueError: If one is out of range or ``attention`` is missing.
        """
        super().__post_init__()
        owner = type(self).__name__
        if self.attention is None:
            raise ValueError(
                f"{owner} needs attention=AttentionConfig(...): it undoes the "
                "queries' RoPE and averages it over the future positions (e.g. "
                "engine.attention)"
            )
        check_int(owner, "future", self.future, 1)

    def _select(
        self, kv: npt.NDArray[Any], queries: npt.NDArray[Any], tokens: list[int]
    ) -> EditResult:
        return self.keep_ends_and_top(
            kv, tokens, lambda lo, hi: self._scores(kv, queries)[lo:hi]
        )

    def _scores(self, kv: npt.NDArray[Any], queries: npt.NDArray[Any]) -> F64:
        """Each of the ``T`` tokens' expected attention, averaged over heads
        and layers (the protected first tokens score 0)."""
        assert self.attention is not None
        layers, total = kv.shape[1], kv.shape[2]
        _, _, dim = self.layout(kv.shape[3])
        inv_freq = self.attention.inverse_frequencies()
        start = total - queries.shape[2]
        # The queries before RoPE: rotated back by their positions; the
        # sinks' (the first keep_first positions) left out of the fit.
        positions = np.arange(start, total)
        fitted = positions >= min(self.keep_first, total - 1)
        back = -positions[fitted, None] * inv_freq[None, :]
        cos_back = np.tile(np.cos(back), 2)
        sin_back = np.tile(np.sin(back), 2)
        # The RoPE rotation averaged over the next `future` positions:
        # R = diag(c) + diag(s) P, with P the rotate_half matrix.
        ahead = np.arange(total, total + self.future)[:, None] * inv_freq[None, :]
        c = np.tile(np.cos(ahead).mean(axis=0), 2)
        s = np.tile(np.sin(ahead).mean(axis=0), 2)
        rotation = np.diag(c) + s[:, None] * _rotate_half(np.eye(dim)).T
        sinks = min(self.keep_first, total - 1)
        scores = np.zeros(total, dtype=np.float64)
        for layer in range(layers):
            k, q = self.split_heads(kv[0, layer], queries[0, layer, fitted])
            pre = q * cos_back + _rotate_half(q) * sin_back
            mean = pre.mean(axis=2) @ rotation.T
            logits = np.einsum("htd,hgd->hgt", k[:, sinks:], mean) / math.sqrt(dim)
            if self.covariance:
                centred = pre - pre.mean(axis=2, keepdims=True)
                cov = np.einsum("hgwd,hgwe->hgde", centred, centred) / pre.shape[2]
                cov = rotation @ cov @ rotation.T
                spread = np.einsum("hgde,hte->hgtd", cov, k[:, sinks:])
                logits += np.einsum("hgtd,htd->hgt", spread, k[:, sinks:]) / (2 * dim)
            logits -= logits.max(axis=-1, keepdims=True)
            probs = np.exp(logits)
            probs /= probs.sum(axis=-1, keepdims=True)
            expected = probs.mean(axis=1)
            if self.value_norm:
                values = kv[1, layer, sinks:].astype(np.float64)
                per_head = values.reshape(len(values), len(k), dim)
                expected = expected * np.linalg.norm(per_head, axis=-1).T
            scores[sinks:] += expected.mean(axis=0)
        scores /= layers
        return scores
