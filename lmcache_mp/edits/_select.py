"""Keeping a subset of token positions: the gather, and scored dropping."""

from __future__ import annotations

import math
from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from lmcache_mp.edits._base import Edit, EditResult, check_fraction, check_int

__all__ = ["ScoredDrop", "keep_count", "keep_indices"]


def keep_count(keep: float, total: int, protected: int) -> int:
    """Return how many of ``total`` tokens a dropping edit keeps.

    The budget every token-dropping edit shares, so that edits compare at
    the same size: ``round(keep * total)`` (halves round up), at least 1,
    raised to the ``protected`` tokens the edit always keeps, at most
    ``total``.

    Args:
        keep: Fraction of the tokens to keep, in ``(0, 1]``.
        total: Tokens of the sequence.
        protected: Tokens the edit keeps whatever ``keep`` says.

    Returns:
        The number of tokens kept.
    """
    target = max(1, math.floor(keep * total + 0.5))
    return min(total, max(target, protected))


def keep_indices(
    kv: npt.NDArray[Any], tokens: Sequence[int], idx: Any
) -> tuple[npt.NDArray[Any], list[int]]:
    """Keep the token positions ``idx`` of a KV and its token ids.

    The building block of token-dropping edits: one vectorized gather along
    the token axis, so the result is a new array of the input's dtype.

    Args:
        kv: The KV, ``[2, L, T, D]``.
        tokens: Its ``T`` token ids.
        idx: The positions to keep: 1-D ints, strictly increasing (so the
            kept tokens stay in their original order), each in ``[0, T)``.

    Returns:
        ``(new_kv, new_tokens)`` with ``new_kv`` ``[2, L, len(idx), D]``.

    Raises:
        ValueError: If ``kv`` is not 4-D, ``T != len(tokens)``, or ``idx``
            is not strictly increasing positions within ``[0, T)``.
    """
    if kv.ndim != 4 or kv.shape[2] != len(tokens):
        raise ValueError(
            f"keep_indices: kv has shape {kv.shape}, expected [2, L, T, D] with "
            f"T == len(tokens) == {len(tokens)}"
        )
    pos = np.asarray(idx)
    if pos.ndim != 1 or (pos.size and pos.dtype.kind not in "iu"):
        raise ValueError(
            f"keep_indices: idx must be a 1-D array of ints, got shape {pos.shape} "
            f"dtype {pos.dtype}"
        )
    pos = pos.astype(np.intp, copy=False)
    if pos.size and (pos[0] < 0 or pos[-1] >= len(tokens)):
        raise ValueError(
            f"keep_indices: idx spans [{pos[0]}, {pos[-1]}], outside the "
            f"{len(tokens)} token positions"
        )
    if pos.size > 1 and not bool(np.all(pos[1:] > pos[:-1])):
        raise ValueError("keep_indices: idx must be strictly increasing")
    new_tokens = [tokens[i] for i in pos.tolist()]
    return np.take(kv, pos, axis=2), new_tokens


@dataclass(frozen=True)
class ScoredDrop(Edit):
    """Keep the first/last tokens, and the top-priority ones in between.

    ``keep_first`` and ``keep_last`` tokens are always kept (attention sinks
    and the recent context matter most to decoding). Of the middle tokens,
    the ones of highest :meth:`_priority` are kept so that
    ``round(keep * T)`` tokens remain in all — more when the protected
    tokens alone exceed that, and all of them when
    ``T <= keep_first + keep_last``. Equal priorities favour the later
    token. Kept tokens stay in their original order.

    Args:
        keep: Fraction of all tokens to keep, in ``(0, 1]``.
        keep_first: Leading tokens always kept.
        keep_last: Trailing tokens always kept.
    """

    keep: float = 0.5
    keep_first: int = 256
    keep_last: int = 256

    def __post_init__(self) -> None:
        """Check the parameters.

        Raises:
            ValueError: If a parameter is out of range; the message names it.
        """
        owner = type(self).__name__
        check_fraction(owner, "keep", self.keep)
        check_int(owner, "keep_first", self.keep_first, 0)
        check_int(owner, "keep_last", self.keep_last, 0)

    def _apply(self, kv: npt.NDArray[Any], tokens: list[int]) -> EditResult:
        total = len(tokens)
        protected = self.keep_first + self.keep_last
        kept = keep_count(self.keep, total, protected)
        if kept == total:
            return kv, tokens, {"kept": total, "dropped": 0}
        lo, hi = self.keep_first, total - self.keep_last
        priority = self._priority(kv, tokens, lo, hi)
        # lexsort's last key is the primary one: by priority, then position,
        # so the tail of the order holds the best, later tokens first.
        order = np.lexsort((np.arange(hi - lo), priority))
        chosen = np.sort(order[len(order) - (kept - protected) :]) + lo
        idx = np.concatenate([np.arange(lo), chosen, np.arange(hi, total)])
        new_kv, new_tokens = keep_indices(kv, tokens, idx)
        return new_kv, new_tokens, {"kept": kept, "dropped": total - kept}

    @abstractmethod
    def _priority(
        self, kv: npt.NDArray[Any], tokens: list[int], lo: int, hi: int
    ) -> npt.NDArray[Any]:
        """Return the keep-priority of tokens ``lo..hi-1`` (higher is kept)."""
