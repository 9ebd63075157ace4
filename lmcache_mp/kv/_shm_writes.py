"""Writing a KV's chunk files into a shared-memory store's directory.

Each chunk goes through a temp file (a free file claimed for reuse when
there is one) and is renamed onto its name, or left staged for the caller
to publish; a strided KV is staged one chunk at a time
(:func:`~lmcache_mp.kv._common.chunk_payloads`).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from lmcache_mp.errors import KVStoreError
from lmcache_mp.kv._chunk import write_chunk
from lmcache_mp.kv._common import chunk_payloads
from lmcache_mp.kv._files import (
    CHUNK_SUFFIX,
    clear_evicted,
    list_free,
    retire,
    retire_replaced,
    staged_name,
)
from lmcache_mp.kv._layout import Layout
from lmcache_mp.kv._stats import Counters

__all__ = ["Touched", "publish_staged", "touch_chunks", "write_chunks"]


class Touched(NamedTuple):
    """The chunks of a KV given to ``store``, sorted by :func:`touch_chunks`."""

    #: Each chunk's key and file name, in order.
    keys: list[bytes]
    names: list[str]
    #: Indices of the chunks not cached, and of those cached.
    missing: list[int]
    present: list[int]


def touch_chunks(dir_fd: int, keys: Iterable[bytes]) -> Touched:
    """Mark each cached chunk of ``keys`` used now (its recency, for
    eviction) and sort the chunks into missing and present.

    Args:
        dir_fd: The store directory.
        keys: The chunks' keys, in order.

    Returns:
        The chunks, with indices counted from the first key.
    """
    touched = Touched([], [], [], [])
    now = time.time_ns()
    for index, key in enumerate(keys):
        name = key.hex() + CHUNK_SUFFIX
        touched.keys.append(key)
        touched.names.append(name)
        try:
            os.utime(name, ns=(now, now), dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            touched.missing.append(index)
        else:
            touched.present.append(index)
    return touched


def write_chunks(
    dir_fd: int,
    path: str,
    counts: Counters,
    arr: Any,
    layout: Layout,
    chunk_size: int,
    chunks: Sequence[tuple[int, str, bytes]],
    stage_for: str | None = None,
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
        stage_for: ``None`` to rename each chunk onto its name now; else
            the tag of the batch that will publish them, to which each
            chunk is left staged (:func:`~lmcache_mp.kv._files.staged_name`).

    Returns:
        The ``(staged, chunk)`` names of the chunks left unpublished.

    Raises:
        KVStoreError: If a chunk cannot be written.
    """
    moves: list[tuple[str, str]] = []
    try:
        _write_all(
            dir_fd, path, counts, arr, layout, chunk_size, chunks, stage_for, moves
        )
    except BaseException:
        # What was staged before the failure has no publisher any more.
        publish_staged(dir_fd, path, moves, keep=False)
        raise
    return moves


def _write_all(
    dir_fd: int,
    path: str,
    counts: Counters,
    arr: Any,
    layout: Layout,
    chunk_size: int,
    chunks: Sequence[tuple[int, str, bytes]],
    stage_for: str | None,
    moves: list[tuple[str, str]],
) -> None:
    """The loop of :func:`write_chunks`; appends each staged chunk to
    ``moves`` as it is made."""
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
                publish=stage_for is None,
                free=free,
            )
            if stage_for is not None:
                # Leased to the publisher: the writer (a pool worker) may be
                # gone before the parent publishes the stream's edit.
                staged = staged_name(stage_for)
                os.rename(tmp, staged, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
                moves.append((staged, name))
        except OSError as exc:
            raise KVStoreError(f"{path}/{name}: cannot write chunk: {exc}") from exc
        counts.add(writes=1)
        clear_evicted(dir_fd, name)


def publish_staged(
    dir_fd: int, path: str, moves: Sequence[tuple[str, str]], keep: bool
) -> None:
    """Rename staged files onto their chunks (``keep``) or drop them; the
    files replaced or dropped are kept for reuse.

    Every staged file is checked before any is renamed, so that a stream
    whose staging was lost keeps its old chunks, never a mix of old and new.

    Args:
        dir_fd: The store directory.
        path: Its path (named in errors).
        moves: ``(staged name, chunk name)`` of each staged chunk.
        keep: Publish (``True``) or discard.

    Raises:
        KVStoreError: If ``keep`` and a staged file is gone (the store was
            swept by hand, or its publisher's lease looked expired); the
            rest are discarded and the cached chunks stay as they were.
    """
    if keep:
        lost = [tmp for tmp, _ in moves if not _exists(dir_fd, tmp)]
        if lost:
            publish_staged(dir_fd, path, moves, keep=False)
            raise KVStoreError(
                f"{path}: {len(lost)} of {len(moves)} staged chunks are gone "
                "before the commit; the cached chunks are unchanged"
            )
    for tmp, name in moves:
        with contextlib.suppress(FileNotFoundError):
            if keep:
                retire_replaced(dir_fd, tmp, name)
            else:
                retire(dir_fd, tmp)


def _exists(dir_fd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True
