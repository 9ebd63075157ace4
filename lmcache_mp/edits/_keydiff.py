"""KeyDiff: keep the tokens whose keys differ most from the mean key."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from lmcache_mp.edits._scored import ScoredDrop
from lmcache_mp.hints import releases_gil

__all__ = ["KeyDiff"]


@releases_gil
@dataclass(frozen=True)
class KeyDiff(ScoredDrop):
    """Keep the tokens whose keys are least similar to the mean key.

    The rule of KeyDiff (Park et al., 2025, "KeyDiff: Key Similarity-Based
    KV Cache Eviction for Long-Context LLM Inference in Resource-Constrained
    Environments"): keys that point away from the others carry what
    attention cannot find elsewhere. Per layer and KV head
    (``attention.kv_heads`` heads of ``head_dim``; the whole width as one
    vector without ``attention``) the anchor is the mean of all ``T``
    unit-normalized keys, and a token's similarity is the cosine between
    its key and the anchor; the similarity is averaged over layers and
    heads (one subset per stream) and the *least* similar tokens are kept.
    KV only. A zero key has similarity 0. The first ``keep_first`` and last
    ``keep_last`` tokens are always kept (none by default), and the least
    similar tokens between, so that the budget is met exactly; of equal
    similarity the later token is kept.

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

    name: ClassVar[str] = "keydiff"

    keep_first: int = 0
    keep_last: int = 0

    def _priority(
        self, kv: npt.NDArray[Any], tokens: list[int], lo: int, hi: int
    ) -> npt.NDArray[Any]:
        keys = self.key_heads(kv, 0, kv.shape[2])
        tiny = np.finfo(np.float32).tiny
        keys /= np.maximum(np.linalg.norm(keys, axis=-1, keepdims=True), tiny)
        anchor = keys.mean(axis=1, keepdims=True)
        anchor /= np.maximum(np.linalg.norm(anchor, axis=-1, keepdims=True), tiny)
        # [L, t, H]: the cosine of each unit key with the unit anchor.
        cosine = np.einsum("lthd,lhd->lth", keys[:, lo:hi], anchor[:, 0])
        priority: npt.NDArray[np.float64] = -cosine.mean(axis=(0, 2), dtype=np.float64)
        return priority
