"""StreamingLLM: attention sinks plus the most recent tokens, rerotated."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from lmcache_mp.edits._window import SinkWindow
from lmcache_mp.hints import releases_gil

__all__ = ["StreamingLLM"]


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
        rerotate: Move the kept keys' RoPE to positions ``0 .. kept - 1``
            (default ``True``).
        attention: The model's attention shape and RoPE; required while
            ``rerotate`` is set.
        sinks: Leading tokens kept.

    Raises:
        ValueError: If a parameter is out of range, or ``rerotate`` is set
            without ``attention``; the message names it.
    """

    name: ClassVar[str] = "streamingllm"
    default_keep: ClassVar[float | None] = 0.5

    rerotate: bool = True
