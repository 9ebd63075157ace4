"""An engine's per-process totals of the calls it served."""

from __future__ import annotations

from dataclasses import dataclass, fields

__all__ = ["EngineStats"]


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
