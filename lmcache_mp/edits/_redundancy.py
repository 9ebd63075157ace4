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

# Elements of one block of the similarity matrix (4 MiB of float32): bounds
# memory whatever T, and keeps the block in cache between the matmul and
# the maxima that read it, while each matmul stays large enough for BLAS.
_BLOCK_ELEMENTS = 1 << 20


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
      BLAS in row blocks of bounded memory, each half of it (the matrix
      is symmetric). Two identical keys score
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
        rerotate: Move the kept keys' RoPE: ``"compact"`` (or ``True``)
            to positions ``0 .. kept - 1``, ``"shift"`` each by
            ``-(T - kept)``.
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
        owner = type(self).__name__
        _, n_layers, _, width = kv.shape
        layers = (
            list(range(n_layers))
            if self.layers is None
            else resolve_layers(owner, tuple(self.layers), n_layers)
        )
        heads = 1 if self.heads is None else self.heads
        if width % heads:
            raise ValueError(
                f"{owner}: parameter 'heads' is {heads}, which does not "
                f"divide the KV width {width}"
            )
        similarity = _max_similarity if self.reduce == "max" else _mean_similarity
        redundancy = np.zeros(hi - lo, dtype=np.float64)
        # A layer at a time: float32 keys of every layer at once
        # were another copy of the KV's size, 512 MiB per Llama-3-8B stream.
        for layer in layers:
            for group in _unit_keys(kv[0, layer], heads):
                redundancy += similarity(group, lo, hi)
        return -redundancy / (len(layers) * heads)


def _unit_keys(keys: npt.NDArray[Any], heads: int) -> npt.NDArray[np.float32]:
    """One layer's ``[T, D]`` keys as ``[heads, T, D / heads]`` unit vectors."""
    total, width = keys.shape
    # A copy always (np.array's default), so normalizing it leaves the KV be.
    unit = np.array(
        keys.reshape(total, heads, width // heads).transpose(1, 0, 2),
        dtype=np.float32,
        order="C",
    )
    norms = np.linalg.norm(unit, axis=-1, keepdims=True)
    unit /= np.maximum(norms, np.finfo(np.float32).tiny)
    return unit


def _max_similarity(
    keys: npt.NDArray[np.float32], lo: int, hi: int
) -> npt.NDArray[np.float32]:
    """Each of tokens ``lo..hi-1``'s largest cosine similarity to another.

    The similarity matrix is symmetric, so a block of rows is multiplied
    only by the keys from its first row on, and its maxima update both its
    rows and those columns: half the multiplications of the whole matrix.
    Blocks of ``_BLOCK_ELEMENTS`` stay in cache for the two maxima, and
    one buffer serves them all.
    """
    total = keys.shape[0]
    rows = max(1, _BLOCK_ELEMENTS // total)
    best = np.full(total, -np.inf, dtype=np.float32)
    buffer = np.empty(min(rows, total) * total, dtype=np.float32)
    # Blocks from hi on only add pairs of tokens at or after hi.
    for start in range(0, hi, rows):
        stop = min(start + rows, total)
        sim = buffer[: (stop - start) * (total - start)].reshape(
            stop - start, total - start
        )
        np.matmul(keys[start:stop], keys[start:].T, out=sim)
        # A token is trivially similar to itself: mask the diagonal.
        sim[np.arange(stop - start), np.arange(stop - start)] = -np.inf
        np.maximum(best[start:stop], sim.max(axis=1), out=best[start:stop])
        np.maximum(best[start:], sim.max(axis=0), out=best[start:])
    return best[lo:hi]


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
