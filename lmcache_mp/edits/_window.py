"""Attention sinks plus a recent window: one rule, under two names. ``window``
(:class:`RecentWindow`) sizes the window in tokens and keeps positions;
``streamingllm`` (:class:`StreamingLLM`, the paper's name) sizes it by
``keep`` and rerotates by default."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from lmcache_mp.edits._base import EditResult, check_int
from lmcache_mp.edits._budget import Rerotate, TokenDrop
from lmcache_mp.hints import releases_gil

__all__ = ["RecentWindow", "SinkWindow", "StreamingLLM"]


@dataclass(frozen=True)
class SinkWindow(TokenDrop):
    """Keep ``sinks`` leading tokens and as many trailing ones as
    :meth:`_kept` says.

    Args:
        keep: Fraction of all tokens to keep.
        budget: Tokens to keep, instead of ``keep``.
        rerotate: Move the kept keys' RoPE: ``"compact"`` (or ``True``)
            to positions ``0 .. kept - 1``, ``"shift"`` each by
            ``-(T - kept)``.
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
        rerotate: Move the kept keys' RoPE: ``"compact"`` (or ``True``)
            to positions ``0 .. kept - 1``, ``"shift"`` each by
            ``-(T - kept)``.
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


@releases_gil
@dataclass(frozen=True)
class StreamingLLM(SinkWindow):
    """Keep ``sinks`` attention sinks and the most recent tokens.

    The rule of StreamingLLM (Xiao et al., 2023, "Efficient Streaming
    Language Models with Attention Sinks"): the first tokens draw attention
    whatever their content, so a cache of those ``sinks`` plus a window of
    the latest tokens keeps the model fluent. Of ``T`` tokens it keeps the
    first ``sinks`` and the last ``budget - sinks`` (the budget from
    ``keep``, default 0.5, or ``budget``; at least the sinks; all ``T``
    when that is ``T`` or more). KV only; the same subset for every layer
    and head (the rule has no scores to aggregate).

    The paper assigns positions *within the cache*: the kept tokens sit at
    ``0 .. kept - 1``, so ``rerotate`` is on by default and needs the
    model's ``attention`` (e.g. ``engine.attention``); ``rerotate=False``
    keeps their original positions, as upstream's ``window``-style fns do.

    Args:
        keep: Fraction of all tokens to keep, in ``(0, 1]`` (default 0.5).
        budget: Tokens to keep, instead of ``keep``.
        rerotate: Move the kept keys' RoPE: ``"compact"`` (or ``True``,
            the default) to positions ``0 .. kept - 1``, ``"shift"`` each by
            ``-(T - kept)``.
        attention: The model's attention shape and RoPE; required while
            ``rerotate`` is set.
        sinks: Leading tokens kept.

    Raises:
        ValueError: If a parameter is out of range, or ``rerotate`` is set
            without ``attention``; the message names it.
    """

    name: ClassVar[str] = "streamingllm"
    default_keep: ClassVar[float | None] = 0.5

    rerotate: Rerotate = True
