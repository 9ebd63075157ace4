"""Large KV arrays come from a pool of reused mappings (issue #20): fast to
fill, and never shared by two live arrays."""

from __future__ import annotations

import numpy as np

from lmcache_mp.kv._buffers import _Pool, contiguous, empty_kv

SHAPE = (2, 4, 1024, 512)  # 16 MiB of float32: pooled
F32 = np.dtype(np.float32)


def _address(arr: np.ndarray) -> int:
    return int(arr.__array_interface__["data"][0])


def test_live_arrays_never_share_memory() -> None:
    """Arrays handed out while others live are distinct, whatever they hold."""
    arrays = [empty_kv(SHAPE, F32) for _ in range(4)]
    for index, arr in enumerate(arrays):
        arr.fill(index)
    assert [float(a[0, 0, 0, 0]) for a in arrays] == [0.0, 1.0, 2.0, 3.0]
    assert len({_address(a) for a in arrays}) == 4


def test_the_memory_of_a_dropped_array_is_reused() -> None:
    """Once no array (or view) uses a mapping, the next request gets it."""
    pool = _Pool()
    first = pool.array(16 << 20)
    view = first[10:]
    address = _address(first)
    del first
    assert _address(pool.array(16 << 20)) != address  # the view still uses it
    del view
    assert _address(pool.array(16 << 20)) == address


def test_contiguous_copies_only_what_is_not_already_contiguous() -> None:
    """A C-contiguous array of the dtype is returned as is; a strided one is
    copied into a pooled array with the same values."""
    arr = np.arange(np.prod(SHAPE), dtype=np.float32).reshape(SHAPE)
    assert contiguous(arr, F32) is arr
    strided = arr[:, :, ::2]
    copy = contiguous(strided, F32)
    assert copy.flags.c_contiguous and np.array_equal(copy, strided)
