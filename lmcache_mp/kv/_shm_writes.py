"""Writing a KV's chunk files into a shared-memory store's directory.

Each chunk goes through a temp file (a free file claimed for reuse when
there is one) and is renamed onto its name, or left staged for the caller
to publish; a strided KV is staged one chunk at a time
(:func:`~lmcache_mp.kv._common.chunk_payloads`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lmcache_mp.errors import KVStoreError
from lmcache_mp.kv._chunk import write_chunk
from lmcache_mp.kv._common import chunk_payloads
from lmcache_mp.kv._layout import Layout
from lmcache_mp.kv._pinfiles import clear_evicted
from lmcache_mp.kv._recycle import list_free
from lmcache_mp.kv._stats import Counters

__all__ = ["write_chunks"]


def write_chunks(
    dir_fd: int,
    path: str,
    counts: Counters,
    arr: Any,
    layout: Layout,
    chunk_size: int,
    chunks: Sequence[tuple[int, str, bytes]],
    publish: bool,
) -> list[tuple[str, str]]:
    """Write some chunks of a KV into a store directory.

    Args:
        dir_fd: The store directory.
        path: Its path (named in errors).
        counts: The handle's counters (one write per chunk).
        arr: The KV, checked against ``layout``.
        layout: The store's layout.
        chunk_size: The store's chunk size.
        chunks: ``(index along the tokens, file name, key)`` of each chunk.
        publish: Rename each onto its name now; otherwise leave it staged.

    Returns:
        The ``(temp, chunk)`` names of the chunks left unpublished.

    Raises:
        KVStoreError: If a chunk cannot be written.
    """
    moves = []
    free = [entry.name for entry in list_free(dir_fd)]
    names = {index: (name, key) for index, name, key in chunks}
    for index, views in chunk_payloads(arr, layout, chunk_size, list(names)):
        name, key = names[index]
        try:
            tmp = write_chunk(
                dir_fd,
                name,
                key,
                views,
                layout,
                chunk_size,
                publish=publish,
                free=free,
            )
        except OSError as exc:
            raise KVStoreError(f"{path}/{name}: cannot write chunk: {exc}") from exc
        counts.add(writes=1)
        clear_evicted(dir_fd, name)
        if not publish:
            moves.append((tmp, name))
    return moves
