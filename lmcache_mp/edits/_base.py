"""The base class of the ready-made edits, and the checks they share."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from lmcache_mp._util.arrays import as_numpy
from lmcache_mp.cache_kind import LMCacheSDKCacheKind

__all__ = [
    "Edit",
    "EditResult",
    "check_fraction",
    "check_int",
    "check_kernel",
    "check_layers",
    "resolve_layers",
]

#: What every edit returns: ``(new_kv, new_tokens, info)``.
EditResult = tuple[npt.NDArray[Any], list[int], dict[str, Any]]


@dataclass(frozen=True)
class Edit(ABC):
    """A modify fn ``edit(kv, tokens) -> (new_kv, new_tokens, info)``.

    Every ready-made edit is a frozen dataclass defined at module level: its
    parameters are its fields, so it pickles by reference to its class (a
    few hundred bytes) and compares by value. Calling it checks the input
    and hands it to the subclass's ``_apply``.

    Attributes:
        name: The edit's name in :data:`lmcache_mp.edits.EDITS`.
    """

    name: ClassVar[str]

    def __call__(self, kv: Any, tokens: Sequence[int]) -> EditResult:
        """Edit one stream's KV.

        Args:
            kv: The KV, ``[2, L, T, D]`` (K/V, layers, tokens, width), as a
                numpy array (float32, float16 or ml_dtypes bfloat16) or
                anything :func:`numpy.asarray` accepts; or a mapping
                ``{kind: tensor}`` (a 0.5.6-API stream's), whose KV is used.
            tokens: The ``T`` token ids the KV belongs to.

        Returns:
            ``(new_kv, new_tokens, info)``: the edited ``[2, L, T', D]`` KV
            of the input's dtype (possibly the input array itself when
            nothing changes), its ``T'`` token ids, and a small dict saying
            what the edit did (always with ``kept`` and ``dropped``).

        Raises:
            ValueError: If ``kv`` is not a 4-D ``[2, L, T, D]`` array with
                ``T == len(tokens)``, or does not fit the edit's parameters
                (e.g. a layer index out of range).
        """
        if isinstance(kv, Mapping):
            # A 0.5.6-API stream hands {kind: tensor}: these edits read and
            # return its KV, so make_edit works on either API.
            kv = kv[LMCacheSDKCacheKind.KV]
        arr, toks = _check_input(kv, tokens, type(self).__name__)
        return self._apply(arr, toks)

    @abstractmethod
    def _apply(self, kv: npt.NDArray[Any], tokens: list[int]) -> EditResult:
        """Edit a checked ``[2, L, T, D]`` KV and its ``T`` token ids."""


def _check_input(
    kv: Any, tokens: Sequence[int], owner: str
) -> tuple[npt.NDArray[Any], list[int]]:
    """Return ``kv`` as numpy and ``tokens`` as ints, checking their shapes."""
    try:
        arr = as_numpy(kv)
    except TypeError as exc:
        raise ValueError(f"{owner}: kv: {exc}") from exc
    toks = [int(t) for t in tokens]
    if arr.ndim != 4 or arr.shape[0] != 2:
        raise ValueError(
            f"{owner}: kv has shape {arr.shape}, expected 4-D "
            "[2, layers, tokens, width]"
        )
    if arr.shape[2] != len(toks):
        raise ValueError(
            f"{owner}: kv has {arr.shape[2]} tokens on axis 2 but "
            f"{len(toks)} token ids were given"
        )
    return arr, toks


def check_int(owner: str, name: str, value: Any, minimum: int) -> None:
    """Raise ValueError unless ``value`` is an int (not a bool) >= ``minimum``.

    Args:
        owner: The edit class name, for the message.
        name: The parameter name, for the message.
        value: The value to check.
        minimum: The smallest allowed value.

    Raises:
        ValueError: If the check fails; the message names the parameter.
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(
            f"{owner}: parameter {name!r} must be an int >= {minimum}, "
            f"got {value!r} ({type(value).__name__})"
        )
    if value < minimum:
        raise ValueError(
            f"{owner}: parameter {name!r} must be an int >= {minimum}, got {value!r}"
        )


def check_kernel(owner: str, value: Any) -> None:
    """Raise ValueError unless ``value`` is an odd int >= 1 (a pooling width).

    Args:
        owner: The edit class name, for the message.
        value: The ``kernel`` parameter.

    Raises:
        ValueError: If the check fails; the message names ``kernel``.
    """
    check_int(owner, "kernel", value, 1)
    if value % 2 == 0:
        raise ValueError(
            f"{owner}: parameter 'kernel' must be odd (a centred pool of the "
            f"same length), got {value!r}"
        )


def check_fraction(owner: str, name: str, value: Any) -> None:
    """Raise ValueError unless ``value`` is a real number in ``(0, 1]``.

    Args:
        owner: The edit class name, for the message.
        name: The parameter name, for the message.
        value: The value to check.

    Raises:
        ValueError: If the check fails; the message names the parameter.
    """
    ok = (
        not isinstance(value, (bool, np.bool_))
        and isinstance(value, (int, float, np.integer, np.floating))
        and math.isfinite(value)
        and 0 < value <= 1
    )
    if not ok:
        raise ValueError(
            f"{owner}: parameter {name!r} must be a fraction in (0, 1], got {value!r}"
        )


def check_layers(owner: str, value: Any) -> tuple[int, ...]:
    """Return the ``layers`` parameter as a tuple of distinct ints.

    Args:
        owner: The edit class name, for the message.
        value: A non-empty sequence of layer indices (negative ones count
            from the last layer, as in Python indexing).

    Returns:
        The indices as a tuple, so the frozen edit stays hashable.

    Raises:
        ValueError: If ``value`` is empty, not a sequence of ints, or has
            duplicates; the message names ``layers``.
    """
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ValueError(
            f"{owner}: parameter 'layers' must be a sequence of layer indices, "
            f"got {value!r}"
        )
    layers = tuple(value)
    bad = [v for v in layers if isinstance(v, bool) or not isinstance(v, int)]
    if not layers or bad or len(set(layers)) != len(layers):
        raise ValueError(
            f"{owner}: parameter 'layers' must be a non-empty sequence of "
            f"distinct ints, got {value!r}"
        )
    return layers


def resolve_layers(owner: str, layers: tuple[int, ...], count: int) -> list[int]:
    """Map layer indices (negative from the end) onto ``range(count)``.

    Args:
        owner: The edit class name, for the message.
        layers: The indices from the edit's ``layers`` parameter.
        count: The number of layers of the KV being edited.

    Returns:
        The indices, each in ``range(count)``, in the given order.

    Raises:
        ValueError: If an index is out of range for ``count`` layers, or
            two indices name the same layer.
    """
    out = []
    for layer in layers:
        if not -count <= layer < count:
            raise ValueError(
                f"{owner}: parameter 'layers' has index {layer}, but the KV "
                f"has {count} layers"
            )
        out.append(layer % count)
    if len(set(out)) != len(out):
        raise ValueError(
            f"{owner}: parameter 'layers' {layers} names a layer twice for a KV "
            f"of {count} layers"
        )
    return out
