"""Attention sinks plus a recent window."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from lmcache_mp.edits._base import EditResult, check_int
from lmcache_mp.edits._budget import TokenDrop
from lmcache_mp.hints import releases_gil

__all__ = ["RecentWindow", "SinkWindow"]


@dataclass(frozen=True)
class SinkWindow(TokenDrop):
    """Keep ``sinks`` leading tokens and as many trailing ones as
    :meth:`_kept` says.

    Args:
        keep: Fraction of all tokens to keep.
        budget: Tokens to keep, instead of ``keep``.
        rerotate: Move the kept keys' RoPE to positions ``0 .. kept - 1``.
        attention: The model's attention shape and RoPE (for ``rerotate``).
        sinks: Leading tokens kept.
    """

    sinks: int = 4

    def __post_init__(self) -> None:
        """Check the parameters.

        Raises:
            ValueError: If a parameter is out of range; the message names it.
        """
        super().__post_init__()
        check_int(type(self).__name__, "sinks", self.sinks, 0)

    def _kept(self, total: int) -> int:
        """Tokens kept of ``total``, sinks included, at most ``total``."""
        return self.kept_count(total, self.sinks)

    def _apply(self, kv: npt.NDArray[Any], tokens: list[int]) -> EditResult:
        total = len(tokens)
        kept = self._kept(total)
        if kept == total:
            return kv, tokens, {"kept": total, "dropped": 0}
        idx = np.concatenate(
            [np.arange(self.sinks), np.arange(total - (kept - self.sinks), total)]
        )
        new_kv, new_tokens = self.gather(kv, tokens, idx)
        return new_kv, new_tokens, {"kept": kept, "dropped": total - kept}


@releases_gil
@dataclass(frozen=True)
class RecentWindow(SinkWindow):
    """Keep the first ``sinks`` tokens and the last ``window`` tokens.

    The StreamingLLM recipe: the first few tokens act as attention sinks
    that the model attends to whatever the content, so keeping them with a
    sliding window of recent tokens preserves decoding quality at a fixed
    KV size. A sequence of at most ``sinks + window`` tokens is kept whole.
    Given ``keep`` or ``budget``, the window is the budget less the sinks
    instead (``streamingllm`` is the same rule, sized by ``keep`` and
    rerotating by default). The kept keys keep their original positions unless
    ``rerotate`` is set.

    Args:
        keep: Fraction of all tokens to keep, instead of ``window``.
        budget: Tokens to keep, instead of ``window``.
        rerotate: Move the kept keys' RoPE to positions ``0 .. kept - 1``.
        attention: The model's attention shape and RoPE (for ``rerotate``).
        window: Trailing tokens kept, at least 1 (without keep/budget).
        sinks: Leading tokens kept.

    Raises:
        ValueError: If a parameter is out of range; the message names it.
    """

    name: ClassVar[str] = "window"
    default_keep: ClassVar[float | None] = None

    window: int = 1024

    def __post_init__(self) -> None:
        """Check the parameters.

        Raises:
            ValueError: If a parameter is out of range; the message names it.
        """
        super().__post_init__()
        check_int(type(self).__name__, "window", self.window, 1)

    def _kept(self, total: int) -> int:
        if self.sized():
            return self.kept_count(total, self.sinks)
        return min(total, self.sinks + self.window)
