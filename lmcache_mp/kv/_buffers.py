"""Arrays for KV moved in and out of a store, in memory that is fast to fill.

A retrieved KV is hundreds of MiB of new process memory, and filling
memory faulted in 4 KiB pages is many times slower than filling memory
already touched (docs/benchmarks/2026-12-06-store-pages.md); fresh
transparent huge pages are fast only while the kernel has free huge pages
at hand. So large arrays come from a small pool of anonymous mappings per
process, advised to use huge pages: a mapping no array uses any more is
handed out again, its pages already touched, as LMCache's local CPU
backend reuses its buffers. The pool keeps at most :data:`_KEEP`
mappings; others are freed with their array. Small arrays stay ordinary.

A process can touch its mappings ahead of use (:func:`reserve`,
:func:`reserve_kv`): a VM's host backs each page on its first touch, so
the first retrieve of each worker would otherwise pay for it. A batch's
``preload`` does so as the pool starts (``map_arena(reserve_tokens=...)``)."""

from __future__ import annotations

import contextlib
import mmap
import sys
import threading
from typing import Any

import numpy as np
import numpy.typing as npt

from lmcache_mp.errors import KVConfigError
from lmcache_mp.kv._chunk import chunk_payload_size
from lmcache_mp.kv._layout import Layout

__all__ = [
    "check_reserve_tokens",
    "contiguous",
    "empty_kv",
    "reserve",
    "reserve_kv",
    "scratch",
]


# Below this, a mapping costs more than the page faults it saves.
_MIN_MAPPED = 4 << 20
# Mappings a process keeps for reuse: a stream's retrieved KV and its
# edit's copy (more would stay resident after a phase of many threads).
_KEEP = 2
# References to a pooled mapping when no array uses it: the pool's list
# and sys.getrefcount's argument (an array holds one through its buffer).
_IDLE_REFS = 2


class _Pool:
    """Large mappings kept for reuse, most recently used last."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._regions: list[mmap.mmap] = []

    def array(self, nbytes: int) -> npt.NDArray[np.uint8]:
        """``nbytes`` of a mapping no array uses, or of a new one."""
        with self._lock:
            index = self._idle(nbytes)
            if index is not None:
                self._regions.append(self._regions.pop(index))
                return np.frombuffer(self._regions[-1], np.uint8, nbytes)
            region = _new_region(nbytes)
            self._keep(region)
            return np.frombuffer(region, np.uint8, nbytes)

    def reserve(self, nbytes: int, count: int) -> int:
        """Make ``count`` (at most ``_KEEP``) idle mappings fit ``nbytes``,
        touching the new ones' pages; return how many were made."""
        with self._lock:
            fitting = [i for i in range(len(self._regions)) if self._fits(i, nbytes)]
            # They become the most recently used: new ones push out others.
            for index in reversed(fitting):
                self._regions.append(self._regions.pop(index))
            wanted = max(0, min(count, _KEEP) - len(fitting))
            for _ in range(wanted):
                region = _new_region(nbytes)
                # One write per page faults it in (a whole huge page when
                # the kernel gives one).
                np.frombuffer(region, np.uint8)[:: mmap.PAGESIZE] = 0
                self._keep(region)
        return wanted

    def _idle(self, nbytes: int) -> int | None:
        """The index of the least recently used idle mapping that fits."""
        fitting = (i for i in range(len(self._regions)) if self._fits(i, nbytes))
        return next(fitting, None)

    def _fits(self, index: int, nbytes: int) -> bool:
        """Whether mapping ``index`` fits ``nbytes`` and no array uses it."""
        # By index: a local name would hold a reference too.
        return nbytes <= len(self._regions[index]) <= 2 * nbytes and (
            sys.getrefcount(self._regions[index]) == _IDLE_REFS
        )

    def _keep(self, region: mmap.mmap) -> None:
        """Add ``region`` as the most recently used, dropping the least."""
        self._regions.append(region)
        if len(self._regions) > _KEEP:
            self._regions.pop(0)  # freed once no array uses it


def _new_region(nbytes: int) -> mmap.mmap:
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(OSError):
        # No transparent huge pages here: ordinary pages still work.
        region.madvise(mmap.MADV_HUGEPAGE)
    return region


_POOL = _Pool()


_SCRATCH = threading.local()


def scratch(nbytes: int) -> npt.NDArray[np.uint8]:
    """The calling thread's scratch buffer, at least ``nbytes`` long.

    One buffer per thread, reused by its next call (its pages stay
    touched, and it stays in cache): what a store stages one piece of a
    strided KV in, where a copy of the whole KV would fault in hundreds of
    MiB of new memory per stored stream. The caller is done
    with it before its thread asks again.

    Args:
        nbytes: Bytes wanted.

    Returns:
        ``nbytes`` of the buffer (grown when too small).
    """
    buf: npt.NDArray[np.uint8] | None = getattr(_SCRATCH, "buf", None)
    if buf is None or len(buf) < nbytes:
        buf = _SCRATCH.buf = np.empty(nbytes, np.uint8)
    return buf[:nbytes]


def reserve(nbytes: int, count: int = _KEEP) -> int:
    """Touch, now, ``count`` pooled mappings for arrays of ``nbytes``, so
    that this process's next arrays of that size fill at memory speed.

    What a worker does as its pool starts, before it retrieves KV of that
    size. Mappings already idle and of a fitting size count.

    Args:
        nbytes: The arrays' size in bytes; nothing is done below the size
            the pool serves.
        count: How many (at most the pool's size, 2).

    Returns:
        How many mappings were made.
    """
    if nbytes < _MIN_MAPPED or not hasattr(mmap, "MADV_HUGEPAGE"):
        return 0
    return _POOL.reserve(nbytes, count)


def empty_kv(shape: tuple[int, ...], dtype: np.dtype[Any]) -> npt.NDArray[Any]:
    """A new uninitialised C-contiguous array; a large one from the pool.

    Args:
        shape: Its shape.
        dtype: Its element type.

    Returns:
        A writable array whose memory no other live array shares.
    """
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if nbytes < _MIN_MAPPED or not hasattr(mmap, "MADV_HUGEPAGE"):
        return np.empty(shape, dtype)
    return _POOL.array(nbytes).view(dtype).reshape(shape)


def contiguous(arr: npt.NDArray[Any], dtype: np.dtype[Any]) -> npt.NDArray[Any]:
    """``arr`` as a C-contiguous array of ``dtype``: itself when it is one,
    else a copy made with :func:`empty_kv`.

    Args:
        arr: Any array.
        dtype: The element type wanted.

    Returns:
        ``arr`` or its copy.
    """
    if arr.dtype == dtype and arr.flags.c_contiguous:
        return arr
    out = empty_kv(arr.shape, dtype)
    np.copyto(out, arr, casting="unsafe")
    return out


def check_reserve_tokens(tokens: object) -> None:
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
