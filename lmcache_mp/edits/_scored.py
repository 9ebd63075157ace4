"""Scored dropping: protected ends, and the top-priority tokens between."""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from lmcache_mp.edits._base import Edit, EditResult, check_fraction, check_int
from lmcache_mp.edits._select import keep_count, keep_indices

__all__ = ["ScoredDrop"]


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
