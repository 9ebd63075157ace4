"""Conversions between array types (numpy is the array type; torch optional)."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["as_numpy"]


def as_numpy(value: Any) -> npt.NDArray[Any]:
    """Return ``value`` as a numpy array without copying when possible.

    Accepts numpy arrays, torch tensors (on any device; moved to the CPU) and
    anything ``np.asarray`` turns into a numeric array.

    Args:
        value: The array-like to convert.

    Returns:
        A numpy array of a numeric dtype.

    Raises:
        TypeError: If ``value`` is ``None``, a scalar, or does not convert to
            a numeric array.
    """
    if value is None:
        raise TypeError("got None, expected an array")
    # torch without importing torch: a tensor has detach() and numpy().
    if hasattr(value, "detach") and hasattr(value, "numpy"):
        value = value.detach().cpu().numpy()
    try:
        arr = np.asarray(value)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"got {type(value).__name__}, expected an array") from exc
    if arr.dtype == object or arr.ndim == 0:
        raise TypeError(f"got {type(value).__name__}, expected a numeric array")
    return arr
