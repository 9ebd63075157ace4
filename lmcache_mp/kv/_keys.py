"""Prefix-chained chunk keys: the key of chunk i covers every token up to its end.

``key_i = H(key_{i-1} || tokens of chunk i)`` with ``key_{-1}`` derived from
the chunk size and the cache salt, so a chunk's key names its whole prefix:
the same tokens after a different prefix, under a different salt or with a
different chunk size never share a key.
"""

from __future__ import annotations

import hashlib
import itertools
import struct
from collections.abc import Iterator, Sequence
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt

from lmcache_mp.errors import KVConfigError

__all__ = ["KEY_BYTES", "Tokens", "check_start", "chunk_keys", "token_array"]

#: Token ids: a sequence of ints (Python or numpy) or an integer array.
Tokens: TypeAlias = Sequence[int] | npt.NDArray[np.integer[Any]]

#: Length of a chunk key in bytes (hex file names are twice as long).
KEY_BYTES = 32

_INT64_MAX = np.iinfo(np.int64).max
# Distinct personalisations keep the root and chain hashes in separate
# domains: no chain step can produce a root key, or the reverse.
_ROOT_PERSON = b"lmcache-mp/root"
_CHAIN_PERSON = b"lmcache-mp/chunk"


def token_array(tokens: Tokens) -> npt.NDArray[np.int64]:
    """Return ``tokens`` as a 1-D little-endian int64 array.

    Args:
        tokens: Token ids: a sequence of ints (Python or numpy) or an array.

    Returns:
        The ids as a ``<i8`` array; its bytes are what keys are hashed over.

    Raises:
        TypeError: If the ids are not a 1-D sequence of integers.
        ValueError: If an id is negative or does not fit in int64.
    """
    try:
        arr = np.asarray(tokens)
    except OverflowError as exc:
        raise ValueError(f"token ids must fit in int64: {exc}") from exc
    if arr.size == 0:
        return np.zeros(0, dtype="<i8")
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise TypeError(
            f"token ids must be a 1-D sequence of ints, got an array of dtype "
            f"{arr.dtype} and shape {arr.shape}"
        )
    low, high = int(arr.min()), int(arr.max())
    if low < 0 or high > _INT64_MAX:
        bad = low if low < 0 else high
        raise ValueError(f"token ids must be in [0, 2**63), got {bad}")
    return arr.astype("<i8", copy=False)


def chunk_keys(
    tokens: npt.NDArray[np.int64], chunk_size: int, cache_salt: str, start: int = 0
) -> Iterator[bytes]:
    """Return an iterator over the key of each full chunk of ``tokens``.

    Keys are computed lazily so that a lookup stopping at the first miss
    hashes no further than it reads.

    Args:
        tokens: Ids from :func:`token_array`.
        chunk_size: Tokens per chunk.
        cache_salt: Isolation salt.
        start: The token the first key wanted begins at: the keys of the
            chunks before it are hashed (each key covers its whole prefix)
            but not returned.

    Returns:
        An iterator of ``KEY_BYTES``-byte keys, one per full chunk from
        ``start`` on, in order.

    Raises:
        TypeError: If ``cache_salt`` is not a string.
        KVConfigError: If ``start`` is not a multiple of ``chunk_size`` in
            ``[0, len(tokens)]``.
    """
    check_start(start, len(tokens), chunk_size)
    if not isinstance(cache_salt, str):
        raise TypeError(f"cache_salt must be a str, got {type(cache_salt).__name__}")
    root = hashlib.blake2b(
        struct.pack("<Q", chunk_size) + cache_salt.encode("utf-8", "surrogatepass"),
        digest_size=KEY_BYTES,
        person=_ROOT_PERSON,
    ).digest()
    chain = _chain(root, memoryview(tokens.tobytes()), chunk_size * 8)
    return itertools.islice(chain, start // chunk_size, None)


def check_start(start: object, n_tokens: int, chunk_size: int) -> None:
    """Check the ``start`` of a chunk-wise store or retrieve.

    Args:
        start: The first token of the KV stored or wanted.
        n_tokens: How many tokens the prefix holds.
        chunk_size: The store's chunk size.

    Raises:
        KVConfigError: Naming ``start`` and the chunk size, if it is not an
            int multiple of the chunk size in ``[0, n_tokens]``.
    """
    if (
        isinstance(start, bool)
        or not isinstance(start, int)
        or not 0 <= start <= n_tokens
        or start % chunk_size
    ):
        raise KVConfigError(
            f"start must be a multiple of the chunk size {chunk_size} in "
            f"[0, {n_tokens}] (the tokens given), got {start!r}"
        )


def _chain(key: bytes, raw: memoryview, step: int) -> Iterator[bytes]:
    for start in range(0, (len(raw) // step) * step, step):
        hasher = hashlib.blake2b(key, digest_size=KEY_BYTES, person=_CHAIN_PERSON)
        hasher.update(raw[start : start + step])
        key = hasher.digest()
        yield key
