"""Simulated KV quantization: quantize, then dequantize."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from lmcache_mp.edits._base import Edit, EditResult, check_int

__all__ = ["Quantize"]

_MAX_BITS = 16


@dataclass(frozen=True)
class Quantize(Edit):
    """Round the KV to ``bits``-bit integers per group and back.

    Simulates storing the KV quantized: the values of each token's K or V
    row, per layer, are split into groups of ``group_size`` consecutive
    channels (the last group may be shorter); a group with largest
    magnitude ``m`` gets the scale ``s = m / (2**(bits-1) - 1)`` and each
    value ``x`` becomes ``round(x / s) * s``. Symmetric, no zero point:
    the error of a value is at most ``s / 2`` (before the cast back to the
    input dtype, which adds that dtype's own rounding). Tokens are
    unchanged. The arithmetic is float32 whatever the input dtype.

    ``info`` reports ``max_abs_error``, the largest absolute difference
    between the result and the input.

    Args:
        bits: Bits per value, 2 to 16.
        group_size: Channels sharing one scale, at least 1.

    Raises:
        ValueError: If a parameter is out of range; the message names it.
    """

    name: ClassVar[str] = "quantize"

    bits: int = 8
    group_size: int = 64

    def __post_init__(self) -> None:
        """Check the parameters.

        Raises:
            ValueError: If a parameter is out of range; the message names it.
        """
        owner = type(self).__name__
        check_int(owner, "bits", self.bits, 2)
        if self.bits > _MAX_BITS:
            raise ValueError(
                f"{owner}: parameter 'bits' must be at most {_MAX_BITS}, "
                f"got {self.bits}"
            )
        check_int(owner, "group_size", self.group_size, 1)

    def _apply(self, kv: npt.NDArray[Any], tokens: list[int]) -> EditResult:
        lead, width = kv.shape[:3], kv.shape[3]
        groups = -(-width // self.group_size)
        # Zero padding fills a short last group without changing its scale.
        x = np.zeros((*lead, groups * self.group_size), dtype=np.float32)
        x[..., :width] = kv
        grouped = x.reshape(*lead, groups, self.group_size)
        # max(max, -min) avoids an |x| temporary the size of the KV.
        amax = np.maximum(
            grouped.max(axis=-1, keepdims=True), -grouped.min(axis=-1, keepdims=True)
        )
        qmax = float(2 ** (self.bits - 1) - 1)
        inv = np.divide(qmax, amax, out=np.zeros_like(amax), where=amax > 0)
        # |x * inv| <= qmax up to rounding, so rint stays within the range.
        q = grouped * inv
        np.rint(q, out=q)
        q *= amax / qmax
        out = q.reshape(x.shape)[..., :width]
        new_kv = out.astype(kv.dtype)
        # Measure the error of what is returned, after the cast back; reuse
        # the buffer rather than allocate another KV-sized array.
        out[...] = new_kv
        np.subtract(out, x[..., :width], out=out)
        err = np.abs(out, out=out)
        info = {
            "kept": len(tokens),
            "dropped": 0,
            "bits": self.bits,
            "max_abs_error": float(err.max()) if err.size else 0.0,
        }
        return new_kv, tokens, info
