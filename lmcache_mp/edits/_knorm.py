"""K-norm: keep the tokens whose keys have the lowest L2 norm."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from lmcache_mp.edits._scored import ScoredDrop
from lmcache_mp.hints import releases_gil

__all__ = ["KeyNorm"]


@releases_gil
@dataclass(frozen=True)
class KeyNorm(ScoredDrop):
    """Keep the tokens whose keys have the lowest L2 norm.

    The rule of Devoto et al. (2024), "A Simple and Effective L2 Norm-Based
    Strategy for KV Cache Compression": a low key norm goes with high
    attention, so the tokens of *lowest* key norm are kept. KV only (no
    queries). A token's score is its key's L2 norm per layer and KV head
    (``attention.kv_heads`` heads of ``head_dim``; the whole width as one
    vector without ``attention``), averaged over layers and heads: the
    paper ranks per head, one token axis needs one subset. The first
    ``keep_first`` and last ``keep_last`` tokens are always kept (none by
    default, as in the paper), and the lowest-scored tokens between, so
    that the budget is met exactly (see
    :class:`~lmcache_mp.edits._scored.ScoredDrop`); of equal norms the later
    token is kept.

    Args:
        keep: Fraction of all tokens to keep, in ``(0, 1]`` (default 0.5).
        budget: Tokens to keep, instead of ``keep``.
        rerotate: Move the kept keys' RoPE: ``"compact"`` (or ``True``)
            to positions ``0 .. kept - 1``, ``"shift"`` each by
            ``-(T - kept)``.
        attention: The model's attention shape and RoPE (heads; rerotate).
        keep_first: Leading tokens always kept.
        keep_last: Trailing tokens always kept.

    Raises:
        ValueError: If a parameter is out of range; the message names it.
            At call time, if ``attention`` does not fit the KV's width.
    """

    name: ClassVar[str] = "knorm"

    keep_first: int = 0
    keep_last: int = 0

    def _priority(
        self, kv: npt.NDArray[Any], tokens: list[int], lo: int, hi: int
    ) -> npt.NDArray[Any]:
        norms = np.linalg.norm(self.key_heads(kv, lo, hi), axis=-1)
        # [L, t, H] -> [t]: the mean norm; lower norms are kept.
        priority: npt.NDArray[np.float64] = -norms.mean(axis=(0, 2), dtype=np.float64)
        return priority
