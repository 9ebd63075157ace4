"""An engine's per-process totals of the calls it served."""

from __future__ import annotations

import threading
from dataclasses import dataclass, fields

__all__ = ["EngineStats", "StatsCounter"]


@dataclass(frozen=True)
class EngineStats:
    """Totals over every call an engine has served in this process.

    Args:
        calls: Calls whose prompt was prefilled.
        prompt_tokens: Prompt tokens of those calls.
        cached_tokens: Prompt tokens whose KV came from the context.
        computed_tokens: Prompt tokens run through the model
            (``prompt_tokens - cached_tokens``).
        generated_tokens: Tokens yielded.
    """

    calls: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    computed_tokens: int = 0
    generated_tokens: int = 0

    def __add__(self, other: EngineStats) -> EngineStats:
        """Return the field-by-field sum of two totals."""
        return EngineStats(
            *(getattr(self, f.name) + getattr(other, f.name) for f in fields(self))
        )


class StatsCounter:
    """The thread-safe :class:`EngineStats` totals an engine keeps (a base).

    The totals are per process: an unpickled copy of an engine starts at 0.
    """

    def __init__(self) -> None:
        self._stats = EngineStats()
        self._stats_lock = threading.Lock()

    def stats(self) -> EngineStats:
        """Return the totals of every call so far (thread-safe).

        Returns:
            A snapshot of the counters.
        """
        with self._stats_lock:
            return self._stats

    def _count(self, delta: EngineStats) -> None:
        """Add ``delta`` to the totals."""
        with self._stats_lock:
            self._stats = self._stats + delta
