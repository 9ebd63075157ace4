"""Exact fixed-point kernels: the reason the engine is bitwise reproducible.

A cache hit must give exactly the tokens a cold run gives, so the K/V of a
position must not depend on how many positions were computed with it. Float
reductions do depend on that: BLAS picks kernels, blockings and summation
orders by matrix shape (and uses gemv for one row), and numpy's pairwise sum
groups terms by array length. Here every reduction (matmul, norm, attention)
runs on float64 arrays holding *integers* (values snapped to a power-of-two
grid) whose partial sums provably stay below 2**53: such sums are exact, so
they are the same in any order, blocking, kernel or thread count (maxima are
exact anyway). Every other operation is elementwise (correctly rounded, or a
deterministic function of one element), so a row's result depends only on
that row.

The bounds: activations are snapped to multiples of ``2**-ACT_FRAC`` and
clipped to ``+-ACT_LIMIT`` (integers below ``2**23``), weights to multiples
of ``2**-W_FRAC`` within ``+-1`` (below ``2**20``), attention probabilities to
multiples of ``2**-PROB_FRAC`` (at most ``2**16``). Hence the limits on matmul
depth, head size and sequence length below, checked by ``EngineConfig``.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = [
    "ACT_FRAC",
    "ACT_LIMIT",
    "F64",
    "MAX_HEAD_DIM",
    "MAX_MATMUL_DEPTH",
    "MAX_POSITIONS",
    "MLP_EXPANSION",
    "PROB_FRAC",
    "W_FRAC",
    "attend",
    "linear",
    "rms_norm",
    "snap_weights",
    "to_grid",
]

F64 = npt.NDArray[np.float64]

ACT_FRAC = 16
ACT_LIMIT = 128.0
W_FRAC = 20
PROB_FRAC = 16
#: Grid of the residual stream inside RMSNorm (coarser: it is squared).
_NORM_FRAC = 10
_EXACT_BITS = 53
_ACT_BITS = ACT_FRAC + int(math.log2(ACT_LIMIT))

#: Longest reduction of activation x weight products that stays exact.
MAX_MATMUL_DEPTH = 2 ** (_EXACT_BITS - _ACT_BITS - W_FRAC)
#: Longest head whose query . key products stay exact.
MAX_HEAD_DIM = 2 ** (_EXACT_BITS - 2 * _ACT_BITS)
#: Longest sequence whose probability x value sums stay exact.
MAX_POSITIONS = 2 ** (_EXACT_BITS - PROB_FRAC - _ACT_BITS)
#: Hidden width of the MLP, in multiples of ``d_model``.
MLP_EXPANSION = 4

_NORM_EPS = 1e-6


def to_grid(x: npt.ArrayLike, frac: int = ACT_FRAC, limit: float = ACT_LIMIT) -> F64:
    """Return ``x`` as integers counting multiples of ``2**-frac``.

    Args:
        x: Values of any float dtype.
        frac: Fraction bits of the grid.
        limit: Values are clipped to ``[-limit, limit]`` first.

    Returns:
        A new float64 array of integer values, ``rint(clip(x) * 2**frac)``.
    """
    out = np.array(x, dtype=np.float64)
    np.minimum(out, limit, out=out)
    np.maximum(out, -limit, out=out)
    out *= 2.0**frac
    return np.rint(out, out=out)


def linear(x: F64, weight_grid: F64) -> F64:
    """Return ``x @ W`` exactly for the snapped ``x``.

    Args:
        x: ``[M, K]`` activations (snapped to the activation grid here).
        weight_grid: ``[K, N]`` weights already on the weight grid.

    Returns:
        ``[M, N]`` float64, the same for a row whatever ``M`` is.
    """
    exact = to_grid(x) @ weight_grid
    exact *= 2.0 ** -(ACT_FRAC + W_FRAC)
    return exact


def rms_norm(x: F64) -> F64:
    """Return ``x`` divided by its root mean square over the last axis.

    Args:
        x: ``[..., d]`` activations.

    Returns:
        The normalized activations (no learned gain).
    """
    coarse = to_grid(x, _NORM_FRAC)
    squares = np.sum(coarse * coarse, axis=-1, keepdims=True)
    squares *= 2.0 ** (-2 * _NORM_FRAC)
    squares /= x.shape[-1]
    squares += _NORM_EPS
    normed: F64 = x / np.sqrt(squares)
    return normed


@functools.lru_cache(maxsize=4)
def _future_mask(block: int) -> F64:
    """``-inf`` above the diagonal of a ``[block, block]`` square, else 0.

    Added to the scores of a query block against its own positions, it
    hides the keys that come after each query.
    """
    mask = np.triu(np.full((block, block), -np.inf), k=1)
    mask.flags.writeable = False
    return mask


def attend(
    q: F64,
    k_grid: F64,
    v_grid: F64,
    first: int,
    scale: float,
    block: int = 64,
) -> F64:
    """Causal attention of new queries over the cached and new keys.

    Args:
        q: ``[H, M, hd]`` queries of positions ``first .. first+M-1``.
        k_grid: ``[H, >= first+M, hd]`` keys on the activation grid.
        v_grid: ``[H, >= first+M, hd]`` values on the activation grid.
        first: Position of the first query.
        scale: Multiplier of the raw scores (``1 / sqrt(hd)``).
        block: Queries per step; small blocks keep the scores in cache.

    Returns:
        ``[H, M, hd]`` outputs; row ``i`` depends only on query ``i`` and the
        keys/values of positions ``0 .. first+i``.
    """
    q_grid = to_grid(q)
    heads, rows, dim = q.shape
    out = np.empty((heads, rows, dim), dtype=np.float64)
    score_scale = scale * 2.0 ** (-2 * ACT_FRAC)
    future = _future_mask(block)
    for b0 in range(0, rows, block):
        b1 = min(rows, b0 + block)
        end = first + b1
        scores = q_grid[:, b0:b1] @ k_grid[:, :end].transpose(0, 2, 1)
        scores[:, :, first + b0 :] += future[: b1 - b0, : b1 - b0]
        # Integer scores: subtracting the maximum is exact.
        scores -= scores.max(axis=-1, keepdims=True)
        # float32 is plenty for weights snapped to 16 fraction bits, and its
        # exp is twice as fast; each element's result is still deterministic.
        probs = np.multiply(scores, score_scale, dtype=np.float32)
        np.exp(probs, out=probs)
        probs *= 2.0**PROB_FRAC
        np.rint(probs, out=probs)
        weights = probs.astype(np.float64)
        mixed = weights @ v_grid[:, :end]
        mixed /= weights.sum(axis=-1, keepdims=True)
        mixed *= 2.0**-ACT_FRAC
        out[:, b0:b1] = mixed
    return out


def snap_weights(w: npt.NDArray[Any]) -> F64:
    """Return weights on the weight grid (clipped to ``[-1, 1]``).

    Args:
        w: Real-valued weights.

    Returns:
        Integer-valued float64 weights for :func:`linear`.
    """
    return to_grid(w, W_FRAC, 1.0)
