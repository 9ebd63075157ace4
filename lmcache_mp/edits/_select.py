"""Keeping a subset of token positions: the budget, and the gather."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["choose_top", "keep_count", "keep_indices"]


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


def choose_top(priority: npt.NDArray[Any], count: int) -> npt.NDArray[np.intp]:
    """Return the positions of the ``count`` highest priorities, increasing.

    The choice every scored edit makes: equal priorities favour the later
    position (the recent context matters more to decoding).

    Args:
        priority: One score per position (higher is kept).
        count: How many positions to keep, ``0 <= count <= len(priority)``.

    Returns:
        The chosen positions, sorted.
    """
    if count <= 0:
        return np.empty(0, dtype=np.intp)
    # lexsort's last key is the primary one: by priority, then position, so
    # the tail of the order holds the best, later positions first.
    order = np.lexsort((np.arange(len(priority)), priority))
    return np.sort(order[len(order) - count :]).astype(np.intp)
