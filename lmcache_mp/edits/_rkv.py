"""R-KV: attention importance minus key redundancy."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from lmcache_mp.edits._base import EditResult, check_int, check_kernel
from lmcache_mp.edits._queries import QueryDrop
from lmcache_mp.edits._select import choose_top
from lmcache_mp.hints import releases_gil

__all__ = ["RKV"]

F64 = npt.NDArray[np.float64]

# Elements of one row block of the similarity matrix: memory O(block * T).
_BLOCK_ELEMENTS = 1 << 22


def _check_unit(owner: str, name: str, value: Any) -> None:
    ok = (
        not isinstance(value, (bool, np.bool_))
        and isinstance(value, (int, float, np.integer, np.floating))
        and math.isfinite(value)
    )
    if not ok:
        raise ValueError(f"{owner}: parameter {name!r} must be a number, got {value!r}")


def _softmax(x: F64) -> F64:
    out: F64 = np.exp(x - x.max(axis=-1, keepdims=True))
    out /= out.sum(axis=-1, keepdims=True)
    return out


@releases_gil
@dataclass(frozen=True)
class RKV(QueryDrop):
    """Keep the prefix tokens that are attended to and not redundant.

    The rule of R-KV (Cai et al., 2025, "R-KV: Redundancy-aware KV Cache
    Compression for Reasoning Models"), as upstream's R-KV notebook
    (``examples/token_dropping/rkv_token_dropping.ipynb``, LMCache 0.5.6)
    computes it. The last ``window`` positions are the observation window,
    always kept; the ``T - window`` positions before it (the past) are
    scored per layer and KV head:

    * **importance**: each window query's logits over the past keys
      (``q . k / sqrt(head_dim)``), the maximum over the query heads of the
      KV head's group (GQA), softmax over the past keys, averaged over the
      window's queries, then max-pooled along the tokens ``kernel`` wide,
      centred, same length (``max_pool1d(x, kernel, stride=1, padding=kernel
      // 2)``);
    * **redundancy**: the cosine similarities of all ``T`` keys
      (``k / (|k| + 1e-8)``), zero on the diagonal; in each row the
      similarity to the *last* token that is more similar than
      ``threshold`` (or to token 0 when none is) is zeroed too (R-KV's
      ``similarity_retain``: the newest near-duplicate is not held
      against the token); each key's column mean over the ``T`` rows,
      softmax over the ``T`` keys.

    A past token's score is ``mix * importance - (1 - mix) * redundancy``,
    averaged over KV heads and summed over layers (the notebook's one token
    subset per stream); the highest-scored ones fill the budget besides the
    window (of equal scores the later). The similarity matrix is computed
    in row blocks, so memory stays ``O(block * T)`` per head. Kept tokens
    stay in their order; ``rerotate`` moves their keys' RoPE
    (the notebook rerotates).

    A modify fn of a stream with a KV and a QUERY context (see
    :class:`~lmcache_mp.edits._queries.QueryDrop`).

    Args:
        keep: Fraction of all tokens to keep, in ``(0, 1]`` (default 0.5).
        budget: Tokens to keep, instead of ``keep``.
        rerotate: Move the kept keys' RoPE: ``"compact"`` (or ``True``)
            to positions ``0 .. kept - 1``, ``"shift"`` each by
            ``-(T - kept)``.
        attention: The model's attention shape and RoPE (GQA; rerotate).
        window: Observation window, always kept; at least 1.
        kernel: Width of the max pooling of the importance: odd, >= 1.
        mix: ``lambda``, the weight of the importance (the notebook's 0.25).
        threshold: Cosine above which two keys count as similar.

    Raises:
        ValueError: If a parameter is out of range; the message names it.
    """

    name: ClassVar[str] = "rkv"

    window: int = 16
    kernel: int = 7
    mix: float = 0.25
    threshold: float = 0.5

    def __post_init__(self) -> None:
        """Check the parameters.

        Raises:
            ValueError: If a parameter is out of range; the message names it.
        """
        super().__post_init__()
        owner = type(self).__name__
        check_int(owner, "window", self.window, 1)
        check_kernel(owner, self.kernel)
        _check_unit(owner, "mix", self.mix)
        _check_unit(owner, "threshold", self.threshold)

    def _select(
        self, kv: npt.NDArray[Any], queries: npt.NDArray[Any], tokens: list[int]
    ) -> EditResult:
        total = len(tokens)
        window = min(self.window, total, queries.shape[2])
        kept = self.kept_count(total, window)
        if kept == total:
            return kv, tokens, {"kept": total, "dropped": 0, "window": window}
        past = total - window
        scores = np.zeros(past, dtype=np.float64)
        for layer in range(kv.shape[1]):
            k, q = self.split_heads(kv[0, layer], queries[0, layer, -window:])
            mixed = self.mix * self._importance(k, q, past)
            mixed -= (1 - self.mix) * self._redundancy(k)[:, :past]
            scores += mixed.mean(axis=0)
        chosen = choose_top(scores, kept - window)
        idx = np.concatenate([chosen, np.arange(past, total)])
        new_kv, new_tokens = self.gather(kv, tokens, idx)
        return (
            new_kv,
            new_tokens,
            {"kept": kept, "dropped": total - kept, "window": window},
        )

    def _importance(self, k: F64, q: F64, past: int) -> F64:
        """``[H, past]`` pooled attention of the window over the past keys."""
        logits = np.einsum("hgwd,htd->hgwt", q, k[:, :past]) / math.sqrt(k.shape[-1])
        probs = _softmax(logits.max(axis=1)).mean(axis=1)
        half = self.kernel // 2
        padded = np.pad(probs, ((0, 0), (half, half)), constant_values=-np.inf)
        spans = np.lib.stride_tricks.sliding_window_view(padded, self.kernel, axis=-1)
        pooled: F64 = spans.max(axis=-1)
        return pooled

    def _redundancy(self, k: F64) -> F64:
        """``[H, T]`` softmaxed mean similarity of each key to the others."""
        heads, total, _ = k.shape
        unit = k / (np.linalg.norm(k, axis=-1, keepdims=True) + 1e-8)
        column = np.zeros((heads, total), dtype=np.float64)
        rows = max(1, _BLOCK_ELEMENTS // (heads * total))
        for start in range(0, total, rows):
            stop = min(start + rows, total)
            sim = unit[:, start:stop] @ unit.transpose(0, 2, 1)  # [H, b, T]
            local = np.arange(stop - start)
            sim[:, local, start + local] = 0.0
            over = sim > self.threshold
            # The last column over the threshold, or column 0 when none is.
            last = (total - 1) - np.argmax(over[..., ::-1], axis=-1)
            retain = np.where(over.any(axis=-1), last, 0)
            np.put_along_axis(sim, retain[..., None], 0.0, axis=-1)
            column += sim.sum(axis=1)
        return _softmax(column / total)
