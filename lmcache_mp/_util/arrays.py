"""Conversions between array types (numpy is the array type; torch optional)."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["ARRAY_TYPES", "as_numpy", "as_type", "check_array_type", "fn_array"]

#: What a modify fn can be handed: numpy arrays, or CPU torch tensors.
ARRAY_TYPES = ("numpy", "torch")


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
        tensor = value.detach().cpu()
        if str(tensor.dtype) == "torch.bfloat16":
            # numpy has no bfloat16: reinterpret the bits as ml_dtypes'.
            import ml_dtypes
            import torch

            bits: npt.NDArray[Any] = tensor.view(torch.int16).numpy()
            return bits.view(ml_dtypes.bfloat16)
        value = tensor.numpy()
    try:
        arr = np.asarray(value)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"got {type(value).__name__}, expected an array") from exc
    # Strings, objects and datetimes are not KV (bfloat16 is kind "V").
    if arr.dtype.kind in "OUSMm" or arr.ndim == 0:
        raise TypeError(f"got {type(value).__name__}, expected a numeric array")
    return arr


def check_array_type(name: str) -> None:
    """Check an ``array=`` argument now, before any stream runs.

    Raises:
        ValueError: If ``name`` is not one of :data:`ARRAY_TYPES`.
        ImportError: If it is ``"torch"`` and torch is not installed (the
            message names the extra).
    """
    if name not in ARRAY_TYPES:
        raise ValueError(f"array must be one of {', '.join(ARRAY_TYPES)}, got {name!r}")
    if name == "torch":
        try:
            import torch  # noqa: F401
        except ImportError as exc:
            raise ImportError(
                "array='torch' needs torch: pip install 'lmcache-mp[torch]'"
            ) from exc


def fn_array(name: str | None, kinds: bool) -> str:
    """What a modify fn is handed when ``array=name`` was asked for.

    Args:
        name: ``"numpy"``, ``"torch"``, or ``None`` for the stream's default.
        kinds: Whether the stream is of upstream 0.5.6's API, whose fns
            take torch tensors (its notebooks run unchanged).

    Returns:
        ``name``, or by default ``"torch"`` for a 0.5.6-API stream where
        torch is installed and ``"numpy"`` otherwise.
    """
    if name is not None:
        return name
    if kinds:
        try:
            import torch  # noqa: F401
        except ImportError:
            return "numpy"
        return "torch"
    return "numpy"


def as_type(arr: npt.NDArray[Any], name: str) -> Any:
    """Hand a numpy KV over as ``name`` without copying.

    Args:
        arr: The KV (float32, float16 or ml_dtypes bfloat16).
        name: ``"numpy"`` (``arr`` itself) or ``"torch"`` (a CPU tensor
            sharing ``arr``'s memory; bfloat16 bits are reinterpreted, so
            they round-trip exactly).

    Returns:
        The array to give the modify fn.
    """
    if name == "numpy":
        return arr
    import torch

    if arr.dtype.name == "bfloat16":
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(arr)
