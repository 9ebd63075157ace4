"""Moving keys' RoPE to new positions."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from lmcache_mp._core.attention import AttentionConfig
from lmcache_mp._util.arrays import as_numpy, as_type

__all__ = ["rerotate_keys"]


def _positions(name: str, value: Any, total: int) -> npt.NDArray[np.float64]:
    pos = np.asarray(value) if isinstance(value, range) else as_numpy(value)
    if pos.ndim != 1 or pos.shape[0] != total:
        raise ValueError(
            f"rerotate_keys: {name} has shape {pos.shape}, expected ({total},): "
            "one position per token of the KV"
        )
    if pos.size and pos.dtype.kind not in "iu":
        raise ValueError(f"rerotate_keys: {name} must be ints, got dtype {pos.dtype}")
    return pos.astype(np.float64)


def rerotate_keys(
    kv: Any, old_positions: Any, new_positions: Any, config: AttentionConfig
) -> Any:
    """Move every key's RoPE from its old position to its new one.

    A key rotated for position ``p`` becomes the key rotated for ``p'`` by
    one more rotation, by the angle ``(p' - p) * inv_freq`` of each channel
    pair (RoPE's rotations compose): ``k' = k * cos + rotate_half(k) * sin``
    with ``rotate_half(x) = concat(-x[d/2:], x[:d/2])`` per head, as
    ``transformers`` applies RoPE (upstream's ``rerotate_k_cache`` helper
    does the same in two steps). The angles are float64, the arithmetic
    float32 whatever the KV's dtype, rounded once to that dtype at the
    end. Values (``kv[1]``) are copied unchanged. Use it after keeping a
    subset of tokens at positions ``idx``: ``rerotate_keys(kept_kv, idx,
    range(len(idx)), config)`` moves them to ``0 .. len(idx) - 1``, where
    decoding will look for them.

    Args:
        kv: The KV, ``[2, L, T, kv_heads * head_dim]``, keys after RoPE; a
            numpy array (float32, float16, ml_dtypes bfloat16, float64) or
            a torch tensor.
        old_positions: ``T`` int positions the keys are rotated for.
        new_positions: ``T`` int positions to rotate them for.
        config: The model's attention shape and RoPE.

    Returns:
        A new KV of the input's type, dtype (and torch device), with moved
        keys; the input is not modified.

    Raises:
        ValueError: If ``kv`` is not ``[2, L, T, kv_heads * head_dim]`` or
            the positions are not ``T`` ints each.
    """
    arr = as_numpy(kv)
    if arr.ndim != 4 or arr.shape[0] != 2:
        raise ValueError(
            f"rerotate_keys: kv has shape {arr.shape}, expected 4-D "
            "[2, layers, tokens, kv_heads * head_dim]"
        )
    _, layers, total, width = arr.shape
    heads, dim = config.kv_heads, config.head_dim
    if width != heads * dim:
        raise ValueError(
            f"rerotate_keys: kv width {width} is not kv_heads * head_dim = "
            f"{heads} * {dim} of the AttentionConfig"
        )
    shift = _positions("new_positions", new_positions, total) - _positions(
        "old_positions", old_positions, total
    )
    angles = shift[:, None] * config.inverse_frequencies()[None, :]
    # [T, 1, d/2]: one angle per token and channel pair, shared by the heads.
    cos = np.cos(angles).astype(np.float32)[:, None, :]
    sin = np.sin(angles).astype(np.float32)[:, None, :]
    out = arr.copy()
    half = dim // 2
    for layer in range(layers):
        k = arr[0, layer].astype(np.float32).reshape(total, heads, dim)
        a, b = k[..., :half], k[..., half:]
        # k * cos + rotate_half(k) * sin, on the two halves of each head.
        rotated = np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)
        out[0, layer] = rotated.reshape(total, width).astype(arr.dtype)
    if not hasattr(kv, "detach"):
        return out
    # A torch tensor in, a torch tensor out, on the input's device.
    return as_type(out, "torch").to(kv.device)
