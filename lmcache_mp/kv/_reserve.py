"""Retrieve buffers touched ahead of a worker's first retrieves (issue #20).

A store's arena is mapped in each process once (:mod:`._maps`); what a
retrieve copies into is process memory pooled by :mod:`._buffers`, whose
first use in a process faults its pages in (slow on this VM: see there).
A batch's ``preload`` touches them as the pool starts instead
(``map_arena(reserve_tokens=...)``).
"""

from __future__ import annotations

from lmcache_mp.errors import KVConfigError
from lmcache_mp.kv._buffers import reserve
from lmcache_mp.kv._chunk import chunk_payload_size
from lmcache_mp.kv._layout import Layout

__all__ = ["check_tokens", "reserve_kv"]


def check_tokens(tokens: object) -> None:
    """Check a ``reserve_tokens`` argument.

    Raises:
        KVConfigError: If it is not an int >= 0.
    """
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        raise KVConfigError(f"reserve_tokens must be an int >= 0, got {tokens!r}")


def reserve_kv(layout: Layout, chunk_size: int, tokens: int) -> int:
    """Touch this process's pooled buffers for two retrieves of ``tokens``
    tokens' KV, rounded down to whole chunks (as a retrieve returns).

    Args:
        layout: The store's layout.
        chunk_size: The store's chunk size.
        tokens: Tokens of the longest prefix a stream will retrieve.

    Returns:
        How many buffers were made (none when they are already there, or
        the KV is too small to be pooled).
    """
    chunks = tokens // chunk_size
    if not chunks:
        return 0
    return reserve(chunk_payload_size(layout, chunk_size) * chunks)
