"""The fixed layout of a store's chunks: layers, width and dtype.

A store holds KV of one layout only. It is fixed by ``connect(layers=...,
width=..., dtype=...)`` or by the first store, and persisted in
``layout.json`` (a key of the Redis store) so that every process opening
the store agrees on it.
"""

from __future__ import annotations

import json
import os
from typing import Any, NamedTuple

import numpy as np

from lmcache_mp.errors import KVConfigError, KVStoreError
from lmcache_mp.kv._files import temp_name

__all__ = [
    "LAYOUT_FILE",
    "Layout",
    "dtype_code",
    "dtype_from_code",
    "encode_layout",
    "load_layout",
    "parse_layout",
    "publish_layout",
    "resolve_dtype",
]

LAYOUT_FILE = "layout.json"

# On-disk dtype codes; never renumber (they are in every chunk header).
_CODES = {"float32": 1, "float16": 2, "bfloat16": 3}
_NAMES = {code: name for name, code in _CODES.items()}


class Layout(NamedTuple):
    """The shape and element type every chunk of a store shares.

    ``planes`` is the tensor's first axis: 2 for KV (K and V), 1 for a
    store of queries (:class:`~lmcache_mp.cache_kind.LMCacheSDKCacheKind`).
    """

    layers: int
    width: int
    dtype: np.dtype[Any]
    planes: int = 2

    def describe(self) -> str:
        """A human-readable form for error messages."""
        planes = "" if self.planes == 2 else f", planes={self.planes}"
        return (
            f"(layers={self.layers}, width={self.width}, "
            f"dtype={self.dtype.name}{planes})"
        )


def _bfloat16() -> np.dtype[Any]:
    try:
        import ml_dtypes
    except ImportError as exc:
        raise KVConfigError(
            "dtype bfloat16 needs the ml_dtypes package "
            "(pip install 'lmcache-mp[bfloat16]')"
        ) from exc
    dtype: np.dtype[Any] = np.dtype(ml_dtypes.bfloat16)
    return dtype


def resolve_dtype(value: Any) -> np.dtype[Any]:
    """Return the little-endian numpy dtype of a supported KV element type.

    Args:
        value: A dtype, a type, or a name such as ``"float16"``.

    Returns:
        float32, float16 or bfloat16 (the latter via ``ml_dtypes``).

    Raises:
        KVConfigError: If ``value`` names another type or bfloat16 is asked
            for without ``ml_dtypes`` installed.
    """
    if isinstance(value, str) and value == "bfloat16":
        return _bfloat16()
    try:
        dtype: np.dtype[Any] = np.dtype(value)
    except TypeError as exc:
        raise KVConfigError(f"unknown KV dtype {value!r}") from exc
    if dtype.name not in _CODES:
        raise KVConfigError(
            f"unsupported KV dtype {dtype.name}; supported: {', '.join(_CODES)}"
        )
    if dtype.name == "bfloat16":
        return dtype
    little: np.dtype[Any] = dtype.newbyteorder("<")
    return little


def dtype_code(dtype: np.dtype[Any]) -> int:
    """The header code of a dtype returned by :func:`resolve_dtype`."""
    return _CODES[dtype.name]


def dtype_from_code(code: int) -> str | None:
    """The dtype name of a header code, or ``None`` for an unknown code."""
    return _NAMES.get(code)


def encode_layout(layout: Layout) -> bytes:
    """The JSON document a store persists its layout as (``layout.json``, or
    the Redis store's layout value).

    Args:
        layout: The layout.

    Returns:
        UTF-8 JSON with ``layers``, ``width``, ``dtype`` and ``planes``.
    """
    doc = {
        "layers": layout.layers,
        "width": layout.width,
        "dtype": layout.dtype.name,
        "planes": layout.planes,
    }
    return json.dumps(doc).encode()


def parse_layout(raw: bytes, where: str) -> Layout:
    """Parse a document written by :func:`encode_layout` (JSON, never pickle).

    Args:
        raw: The document.
        where: Where it was read from, for error messages.

    Returns:
        The layout.

    Raises:
        KVStoreError: If ``raw`` is not a valid layout document.
    """
    try:
        doc = json.loads(raw)
        layers, width, name = int(doc["layers"]), int(doc["width"]), doc["dtype"]
        # Stores written before kinds existed hold KV: two planes.
        planes = int(doc.get("planes", 2))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise KVStoreError(f"{where}: not a valid store layout: {exc}") from exc
    if layers < 1 or width < 1 or name not in _CODES or planes not in (1, 2):
        raise KVStoreError(f"{where}: not a valid store layout: {raw!r}")
    return Layout(layers, width, resolve_dtype(name), planes)


def load_layout(dir_fd: int, where: str) -> Layout | None:
    """Read a store's layout, or ``None`` when none has been fixed yet.

    Args:
        dir_fd: An open descriptor of the store directory.
        where: The directory's path, for error messages.

    Returns:
        The persisted layout, or ``None``.

    Raises:
        KVStoreError: If the layout file is unreadable or malformed.
    """
    try:
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
        fd = os.open(LAYOUT_FILE, flags, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise KVStoreError(f"{where}/{LAYOUT_FILE}: cannot open: {exc}") from exc
    with os.fdopen(fd, "rb") as fh:
        return parse_layout(fh.read(4096), f"{where}/{LAYOUT_FILE}")


def publish_layout(dir_fd: int, where: str, layout: Layout) -> Layout:
    """Fix ``layout`` as the store's layout unless one is already fixed.

    The file is written under a temporary name and hard-linked into place,
    which fails when another process got there first: the first layout wins
    and every process sees it whole.

    Args:
        dir_fd: An open descriptor of the store directory.
        where: The directory's path, for error messages.
        layout: The layout to fix.

    Returns:
        The store's layout: ``layout``, or the one fixed earlier.

    Raises:
        KVStoreError: If the layout cannot be written or read back.
    """
    tmp = temp_name()
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
    try:
        fd = os.open(tmp, flags, 0o600, dir_fd=dir_fd)
        try:
            os.write(fd, encode_layout(layout))
        finally:
            os.close(fd)
        try:
            os.link(tmp, LAYOUT_FILE, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp, dir_fd=dir_fd)
    except OSError as exc:
        raise KVStoreError(f"{where}/{LAYOUT_FILE}: cannot write: {exc}") from exc
    fixed = load_layout(dir_fd, where)
    if fixed is None:
        raise KVStoreError(f"{where}/{LAYOUT_FILE}: vanished while being written")
    return fixed
