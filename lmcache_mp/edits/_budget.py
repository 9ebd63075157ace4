"""What every token-dropping edit shares: its budget, and rerotation."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import numpy as np
import numpy.typing as npt

from lmcache_mp._core.attention import AttentionConfig
from lmcache_mp.edits._base import Edit, check_fraction, check_int
from lmcache_mp.edits._rope import rerotate_keys
from lmcache_mp.edits._select import keep_count, keep_indices

__all__ = ["Rerotate", "TokenDrop"]

#: The named values of an edit's ``rerotate``; ``True`` means ``"compact"``.
_MODES = ("compact", "shift")

#: An edit's ``rerotate``: ``False`` (keys stay where they are), ``True`` or
#: ``"compact"``, or ``"shift"`` (see :class:`TokenDrop`).
Rerotate = bool | Literal["compact", "shift"]


@dataclass(frozen=True)
class TokenDrop(Edit):
    """A token-dropping edit: its budget, and where its kept keys sit.

    The budget is ``keep`` (a fraction: ``round(keep * T)`` tokens, halves
    up, at least 1) or ``budget`` (a token count), never both; the edit's
    own protected tokens (attention sinks, a recent window) raise it, and
    a sequence that fits is kept whole. The kept tokens stay in their
    order. Their keys stay rotated for their original positions unless
    ``rerotate`` is set, which needs the model's ``attention``: then
    :func:`~lmcache_mp.edits.rerotate_keys` moves them. Decoding goes on
    at position ``kept``, the length of the edited cache (as vLLM and
    LMCache count positions), so a key left at its original position
    ``p`` is seen ``kept - p`` tokens back instead of ``T - p``.
    ``"compact"`` (or ``True``) moves the kept keys to ``0 .. kept - 1``,
    as StreamingLLM places a cache's tokens; ``"shift"`` moves every kept
    key by the same ``-(T - kept)``, so each keeps its distance to every
    later token, as a cache that keeps original positions has it
    (kvpress's presses) in a layout with one token axis.

    Args:
        keep: Fraction of all tokens to keep, in ``(0, 1]``; the edit's
            default when neither ``keep`` nor ``budget`` is given.
        budget: Tokens to keep, at least 1, instead of ``keep``.
        rerotate: ``False``, ``True`` or ``"compact"`` (kept keys to
            ``0 .. kept - 1``), or ``"shift"`` (every kept key by
            ``-(T - kept)``).
        attention: The model's attention shape and RoPE
            (:class:`~lmcache_mp.edits.AttentionConfig`); needed by
            ``rerotate``, and by the edits that group query heads.

    Raises:
        ValueError: If a parameter is out of range, both ``keep`` and
            ``budget`` are given, or ``rerotate`` is set without
            ``attention``; the message names the parameter.
    """

    #: ``keep`` when neither ``keep`` nor ``budget`` is given (``None``:
    #: the edit has another size parameter).
    default_keep: ClassVar[float | None] = 0.5

    keep: float | None = None
    budget: int | None = None
    rerotate: Rerotate = False
    attention: AttentionConfig | None = None

    def __post_init__(self) -> None:
        """Check the parameters.

        Raises:
            ValueError: If a parameter is out of range; the message names it.
        """
        owner = type(self).__name__
        if self.keep is not None and self.budget is not None:
            raise ValueError(
                f"{owner}: give 'keep' (a fraction) or 'budget' (tokens), not "
                f"both; got keep={self.keep!r}, budget={self.budget!r}"
            )
        if self.budget is not None:
            check_int(owner, "budget", self.budget, 1)
        elif self.keep is None:
            object.__setattr__(self, "keep", self.default_keep)
        if self.keep is not None:
            check_fraction(owner, "keep", self.keep)
        if not isinstance(self.rerotate, (bool, np.bool_)) and (
            self.rerotate not in _MODES
        ):
            raise ValueError(
                f"{owner}: parameter 'rerotate' must be a bool, 'compact' or "
                f"'shift', got {self.rerotate!r}"
            )
        if self.attention is not None and not isinstance(
            self.attention, AttentionConfig
        ):
            raise ValueError(
                f"{owner}: parameter 'attention' must be an AttentionConfig, got "
                f"{type(self.attention).__name__}"
            )
        if self.rerotate and self.attention is None:
            raise ValueError(
                f"{owner}: rerotate={self.rerotate!r} needs "
                "attention=AttentionConfig(...) (the "
                "model's heads, head_dim and RoPE; e.g. engine.attention), or "
                "rerotate=False"
            )

    def sized(self) -> bool:
        """Whether ``keep`` or ``budget`` sets the size (else the edit's own
        size parameter does)."""
        return self.keep is not None or self.budget is not None

    def kept_count(self, total: int, protected: int) -> int:
        """Return how many of ``total`` tokens to keep.

        Args:
            total: Tokens of the sequence.
            protected: Tokens the edit keeps whatever the budget says.

        Returns:
            ``budget`` (or ``keep``'s count, see
            :func:`~lmcache_mp.edits.keep_count`), raised to ``protected``,
            at most ``total``.
        """
        if self.budget is not None:
            return min(total, max(self.budget, protected))
        return keep_count(float(self.keep or 0.0), total, protected)

    def check_width(self, width: int, kind: str = "KV") -> None:
        """Raise unless ``attention`` (when given) fits a ``width``-wide row.

        Raises:
            ValueError: If ``width`` is not ``kv_heads * head_dim`` (or
                ``q_heads * head_dim`` for ``kind == "queries"``).
        """
        if self.attention is None:
            return
        heads = self.attention.q_heads if kind == "queries" else self.attention.kv_heads
        if width != heads * self.attention.head_dim:
            raise ValueError(
                f"{type(self).__name__}: the {kind} width {width} is not "
                f"{heads} heads * head_dim {self.attention.head_dim} of the "
                "attention parameter"
            )

    def key_heads(self, kv: npt.NDArray[Any], lo: int, hi: int) -> npt.NDArray[Any]:
        """Return the keys of tokens ``lo..hi-1`` as float32 ``[L, t, H, d]``.

        ``H`` is ``attention.kv_heads`` when ``attention`` is given, else 1
        (the whole width as one vector).

        Raises:
            ValueError: If ``attention`` does not fit the KV's width.
        """
        width = kv.shape[3]
        self.check_width(width)
        heads = 1 if self.attention is None else self.attention.kv_heads
        keys = kv[0, :, lo:hi].astype(np.float32)
        return keys.reshape(*keys.shape[:2], heads, width // heads)

    def gather(
        self, kv: npt.NDArray[Any], tokens: Sequence[int], idx: Any
    ) -> tuple[npt.NDArray[Any], list[int]]:
        """Keep positions ``idx`` (increasing), rerotating when asked.

        Args:
            kv: The ``[2, L, T, D]`` KV.
            tokens: Its ``T`` token ids.
            idx: The kept positions, strictly increasing.

        Returns:
            ``(new_kv, new_tokens)``, keys moved as ``rerotate`` says.
        """
        new_kv, new_tokens = keep_indices(kv, tokens, idx)
        if self.rerotate and self.attention is not None:
            self.check_width(kv.shape[3])
            old = np.asarray(idx)
            kept = len(new_tokens)
            if self.rerotate == "shift":
                new = old - (len(tokens) - kept)
            else:
                new = np.arange(kept)
            new_kv = rerotate_keys(new_kv, old, new, self.attention)
        return new_kv, new_tokens
