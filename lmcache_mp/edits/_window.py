"""Attention sinks plus a recent window (StreamingLLM-style)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from lmcache_mp.edits._base import Edit, EditResult, check_int
from lmcache_mp.edits._select import keep_indices
from lmcache_mp.hints import releases_gil

__all__ = ["RecentWindow"]


@releases_gil
@dataclass(frozen=True)
class RecentWindow(Edit):
    """Keep the first ``sinks`` tokens and the last ``window`` tokens.

    The StreamingLLM recipe: the first few tokens act as attention sinks
    that the model attends to whatever the content, so keeping them with a
    sliding window of recent tokens preserves decoding quality at a fixed
    KV size. A sequence of at most ``sinks + window`` tokens is kept whole.

    Args:
        window: Trailing tokens kept, at least 1.
        sinks: Leading tokens kept.

    Raises:
        ValueError: If a parameter is out of range; the message names it.
    """

    name: ClassVar[str] = "window"

    window: int = 1024
    sinks: int = 4

    def __post_init__(self) -> None:
        """Check the parameters.

        Raises:
            ValueError: If a parameter is out of range; the message names it.
        """
        owner = type(self).__name__
        check_int(owner, "window", self.window, 1)
        check_int(owner, "sinks", self.sinks, 0)

    def _apply(self, kv: npt.NDArray[Any], tokens: list[int]) -> EditResult:
        total = len(tokens)
        if total <= self.sinks + self.window:
            return kv, tokens, {"kept": total, "dropped": 0}
        idx = np.concatenate(
            [np.arange(self.sinks), np.arange(total - self.window, total)]
        )
        new_kv, new_tokens = keep_indices(kv, tokens, idx)
        kept = self.sinks + self.window
        return new_kv, new_tokens, {"kept": kept, "dropped": total - kept}
