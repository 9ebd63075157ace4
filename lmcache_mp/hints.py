"""Hints that tell ``executor="auto"`` how a fn or engine uses the GIL.

A modify fn that runs Python bytecode per token holds the GIL: threads run
one stream at a time and only processes use every core. A fn that spends
its time in numpy, BLAS or I/O releases it: threads use the cores too and
avoid the process round trip. ``"auto"`` measures this on the first stream
when it is not told; a hint skips the measurement.
"""

from __future__ import annotations

import functools
from typing import Any, TypeVar

__all__ = ["gil_bound", "gil_hint", "releases_gil"]

_T = TypeVar("_T")
_ATTR = "__lmcache_mp_gil_bound__"


def _mark(obj: _T, value: bool) -> _T:
    try:
        setattr(obj, _ATTR, value)
    except (AttributeError, TypeError) as exc:
        raise TypeError(
            f"cannot mark {obj!r} with a GIL hint: it takes no attributes "
            "(mark its class, or wrap it in a function)"
        ) from exc
    return obj


def gil_bound(obj: _T) -> _T:
    """Mark a modify fn or engine (function or class) as holding the GIL.

    ``executor="auto"`` then runs its phases on processes without measuring.

    Args:
        obj: A function, or a class whose instances are the callables.

    Returns:
        ``obj`` itself, marked.

    Raises:
        TypeError: If ``obj`` takes no attributes (a built-in, a frozen
            instance): mark its class instead.
    """
    return _mark(obj, True)


def releases_gil(obj: _T) -> _T:
    """Mark a modify fn or engine as releasing the GIL (numpy, BLAS, I/O).

    ``executor="auto"`` then weighs threads against processes by cost
    alone, without measuring whether the fn holds the GIL.

    Args:
        obj: A function, or a class whose instances are the callables.

    Returns:
        ``obj`` itself, marked.

    Raises:
        TypeError: If ``obj`` takes no attributes: mark its class instead.
    """
    return _mark(obj, False)


def gil_hint(obj: Any) -> bool | None:
    """Return the hint on a fn or engine, looking through ``functools.partial``.

    Args:
        obj: A callable.

    Returns:
        ``True`` (:func:`gil_bound`), ``False`` (:func:`releases_gil`), or
        ``None`` when it has no hint.
    """
    while isinstance(obj, functools.partial):
        obj = obj.func
    value = getattr(obj, _ATTR, None)
    return value if isinstance(value, bool) else None
