"""Scored dropping: protected ends, and the top-priority tokens between."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from lmcache_mp.edits._base import EditResult, check_int
from lmcache_mp.edits._budget import TokenDrop
from lmcache_mp.edits._select import choose_top

__all__ = ["EndsDrop", "ScoredDrop"]


@dataclass(frozen=True)
class EndsDrop(TokenDrop):
    """Keep the first/last tokens, and the top-priority ones in between.

    ``keep_first`` and ``keep_last`` tokens are always kept (attention sinks
    and the recent context matter most to decoding). Of the middle tokens,
    the ones of highest priority are kept so that the budget is met
    exactly: ``round(keep * T)`` tokens (or ``budget``) in all — more when
    the protected tokens alone exceed that, and all of them when
    ``T <= keep_first + keep_last``. Equal priorities favour the later
    token. Kept tokens stay in their original order; ``rerotate`` moves
    their keys' RoPE.

    Args:
        keep: Fraction of all tokens to keep, in ``(0, 1]`` (default 0.5).
        budget: Tokens to keep, instead of ``keep``.
        rerotate: Move the kept keys' RoPE: ``"compact"`` (or ``True``)
            to positions ``0 .. kept - 1``, ``"shift"`` each by
            ``-(T - kept)``.
        attention: The model's attention shape and RoPE (for ``rerotate``).
        keep_first: Leading tokens always kept.
        keep_last: Trailing tokens always kept.
    """

    keep_first: int = 256
    keep_last: int = 256

    def __post_init__(self) -> None:
        """Check the parameters.

        Raises:
            ValueError: If a parameter is out of range; the message names it.
        """
        super().__post_init__()
        owner = type(self).__name__
        check_int(owner, "keep_first", self.keep_first, 0)
        check_int(owner, "keep_last", self.keep_last, 0)

    def keep_ends_and_top(
        self,
        kv: npt.NDArray[Any],
        tokens: list[int],
        priority: Callable[[int, int], npt.NDArray[Any]],
    ) -> EditResult:
        """Keep the protected ends and the best middle tokens.

        Args:
            kv: The ``[2, L, T, D]`` KV.
            tokens: Its ``T`` token ids.
            priority: ``priority(lo, hi)``, the keep-priority of tokens
                ``lo..hi-1`` (higher is kept); only called when some
                token is dropped.

        Returns:
            ``(new_kv, new_tokens, info)``.
        """
        total = len(tokens)
        protected = self.keep_first + self.keep_last
        kept = self.kept_count(total, protected)
        if kept == total:
            return kv, tokens, {"kept": total, "dropped": 0}
        lo, hi = self.keep_first, total - self.keep_last
        chosen = choose_top(np.asarray(priority(lo, hi)), kept - protected) + lo
        idx = np.concatenate([np.arange(lo), chosen, np.arange(hi, total)])
        new_kv, new_tokens = self.gather(kv, tokens, idx)
        return new_kv, new_tokens, {"kept": kept, "dropped": total - kept}


@dataclass(frozen=True)
class ScoredDrop(EndsDrop):
    """An :class:`EndsDrop` of the KV alone, ranked by :meth:`_priority`."""

    def _apply(self, kv: npt.NDArray[Any], tokens: list[int]) -> EditResult:
        return self.keep_ends_and_top(
            kv, tokens, lambda lo, hi: self._priority(kv, tokens, lo, hi)
        )

    @abstractmethod
    def _priority(
        self, kv: npt.NDArray[Any], tokens: list[int], lo: int, hi: int
    ) -> npt.NDArray[Any]:
        """Return the keep-priority of tokens ``lo..hi-1`` (higher is kept)."""
