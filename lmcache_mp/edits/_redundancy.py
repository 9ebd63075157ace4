"""Dropping the tokens whose keys are most redundant (R-KV-style)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import numpy as np
import numpy.typing as npt

from lmcache_mp.edits._base import check_int, check_layers, resolve_layers
from lmcache_mp.edits._scored import ScoredDrop
from lmcache_mp.hints import releases_gil

__all__ = ["RedundancyDrop"]

# Elements of one block of the similarity matrix (64 MiB of float32): bounds
# memory whatever T while keeping each matmul large enough for BLAS.
_BLOCK_ELEMENTS = 1 << 24


@releases_gil
@dataclass(frozen=True)
class RedundancyDrop(ScoredDrop):
    """Drop the tokens whose keys most resemble other tokens' keys.

    A token whose key nearly repeats another's adds little that attention
    could not find elsewhere (the idea behind R-KV). For each scored layer,
    and each head when ``heads`` is given (the width ``D`` split into
    ``heads`` vectors; otherwise the whole ``D``-vector), the keys are
    normalized and a token's redundancy is its cosine similarity to the
    other tokens, reduced by ``reduce``:

    * ``"max"``: the similarity to its closest other token. Needs the
      ``T x T`` similarity matrix: ``O(T^2 * D)`` per layer, computed by
      BLAS in row blocks of bounded memory. Two identical keys score
      alike, so one of them goes before any distinct key does.
    * ``"mean"``: the mean similarity to all other tokens, which reduces
      to one dot product with the sum of the keys: ``O(T * D)``.

    The redundancy is averaged over layers and heads. The first
    ``keep_first`` and last ``keep_last`` tokens are always kept, and the
    least redundant tokens in between, so that ``round(keep * T)`` (or
    ``budget``) tokens remain (more when the protected ones alone are more; all when
    ``T <= keep_first + keep_last``); of equally redundant tokens the later
    one is kept. A zero key is similar to nothing. Only K is scored; V rows
    follow their tokens.

    Args:
        keep: Fraction of all tokens to keep, in ``(0, 1]`` (default 0.5).
        budget: Tokens to keep, instead of ``keep``.
        rerotate: Move the kept keys' RoPE to positions ``0 .. kept - 1``.
        attention: The model's attention shape and RoPE (for ``rerotate``).
        keep_first: Leading tokens always kept.
        keep_last: Trailing tokens always kept.
        layers: Layer indices to score (negative from the last), or
            ``None`` for every layer.
        heads: Number of heads ``D`` splits into, or ``None`` to score the
            whole width as one vector.
        reduce: ``"max"`` or ``"mean"``, as above.

    Raises:
        ValueError: If a parameter is out of range; the message names it.
            At call time, if ``layers`` or ``heads`` does not fit the KV.
    """

    name: ClassVar[str] = "redundancy"

    layers: Sequence[int] | None = None
    heads: int | None = None
    reduce: Literal["max", "mean"] = "max"

    def __post_init__(self) -> None:
        """Check the parameters.

        Raises:
            ValueError: If a parameter is out of range; the message names it.
        """
        super().__post_init__()
        owner = type(self).__name__
        if self.layers is not None:
            # A tuple keeps the frozen edit hashable when given a list.
            object.__setattr__(self, "layers", check_layers(owner, self.layers))
        if self.heads is not None:
            check_int(owner, "heads", self.heads, 1)
        if self.reduce not in ("max", "mean"):
            raise ValueError(
                f"{owner}: parameter 'reduce' must be 'max' or 'mean', "
                f"got {self.reduce!r}"
            )

    def _priority(
        self, kv: npt.NDArray[Any], tokens: list[int], lo: int, hi: int
    ) -> npt.NDArray[Any]:
        keys = self._unit_keys(kv)
        redundancy = np.zeros(hi - lo, dtype=np.float64)
        for group in keys:
            if self.reduce == "max":
                redundancy += _max_similarity(group, lo, hi)
            else:
                redundancy += _mean_similarity(group, lo, hi)
        return -redundancy / len(keys)

    def _unit_keys(self, kv: npt.NDArray[Any]) -> npt.NDArray[np.float32]:
        """Return the scored keys as ``[groups, T, d]`` unit vectors."""
        owner = type(self).__name__
        _, n_layers, total, width = kv.shape
        layers = (
            list(range(n_layers))
            if self.layers is None
            else resolve_layers(owner, tuple(self.layers), n_layers)
        )
        # Fancy indexing already copied, so normalizing in place is safe.
        keys = kv[0, layers].astype(np.float32, copy=False)
        if self.heads is not None:
            if width % self.heads:
                raise ValueError(
                    f"{owner}: parameter 'heads' is {self.heads}, which does not "
                    f"divide the KV width {width}"
                )
            keys = keys.reshape(len(layers), total, self.heads, width // self.heads)
            keys = keys.transpose(0, 2, 1, 3).reshape(
                len(layers) * self.heads, total, width // self.heads
            )
        norms = np.linalg.norm(keys, axis=-1, keepdims=True)
        keys /= np.maximum(norms, np.finfo(np.float32).tiny)
        return keys


def _max_similarity(
    keys: npt.NDArray[np.float32], lo: int, hi: int
) -> npt.NDArray[np.float32]:
    """Each of tokens ``lo..hi-1``'s largest cosine similarity to another."""
    total = keys.shape[0]
    rows = max(1, _BLOCK_ELEMENTS // total)
    out = np.empty(hi - lo, dtype=np.float32)
    for start in range(lo, hi, rows):
        stop = min(start + rows, hi)
        sim = keys[start:stop] @ keys.T
        # A token is trivially similar to itself: mask the diagonal.
        sim[np.arange(stop - start), np.arange(start, stop)] = -np.inf
        out[start - lo : stop - lo] = sim.max(axis=1)
    return out


def _mean_similarity(
    keys: npt.NDArray[np.float32], lo: int, hi: int
) -> npt.NDArray[np.float32]:
    """Each of tokens ``lo..hi-1``'s mean cosine similarity to the others."""
    total = keys.shape[0]
    rows = keys[lo:hi]
    # sum_j<k_i, k_j> over j != i is <k_i, sum_j k_j> minus |k_i|^2.
    self_sim = np.einsum("td,td->t", rows, rows)
    result: npt.NDArray[np.float32] = (rows @ keys.sum(axis=0) - self_sim) / (total - 1)
    return result
