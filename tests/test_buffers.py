"""Large KV arrays come from a pool of reused mappings: fast to
fill, and never shared by two live arrays."""

from __future__ import annotations

import numpy as np
import psutil

from lmcache_mp.kv._buffers import _Pool, contiguous, empty_kv, reserve
from tests._store_util import address, pooled

SHAPE = (2, 4, 1024, 512)  # 16 MiB of float32: pooled
F32 = np.dtype(np.float32)


def test_live_arrays_never_share_memory() -> None:
    """Arrays handed out while others live are distinct, whatever they hold."""
    arrays = [empty_kv(SHAPE, F32) for _ in range(4)]
    for index, arr in enumerate(arrays):
        arr.fill(index)
    assert [float(a[0, 0, 0, 0]) for a in arrays] == [0.0, 1.0, 2.0, 3.0]
    assert len({address(a) for a in arrays}) == 4


def test_the_memory_of_a_dropped_array_is_reused() -> None:
    """Once no array (or view) uses a mapping, the next request gets it."""
    pool = _Pool()
    first = pool.array(16 << 20)
    view = first[10:]
    where = address(first)
    del first
    assert address(pool.array(16 << 20)) != where  # the view still uses it
    del view
    assert address(pool.array(16 << 20)) == where


def test_contiguous_copies_only_what_is_not_already_contiguous() -> None:
    """A C-contiguous array of the dtype is returned as is; a strided one is
    copied into a pooled array with the same values."""
    arr = np.arange(np.prod(SHAPE), dtype=np.float32).reshape(SHAPE)
    assert contiguous(arr, F32) is arr
    strided = arr[:, :, ::2]
    copy = contiguous(strided, F32)
    assert copy.flags.c_contiguous and np.array_equal(copy, strided)


MIB16 = 16 << 20


def _rss() -> int:
    return int(psutil.Process().memory_info().rss)


def test_reserve_touches_mappings_the_next_arrays_reuse() -> None:
    """reserve(n, 2) faults in two mappings of n bytes now (the process's
    RSS grows by them), and the next two live arrays of n bytes use them."""
    pool = _Pool()
    before = _rss()
    assert pool.reserve(MIB16, 2) == 2
    assert _rss() - before >= 2 * MIB16 * 0.9
    made = pooled(pool)
    first, second = pool.array(MIB16), pool.array(MIB16)
    assert {address(first), address(second)} == made


def test_reserve_counts_the_idle_mappings_that_fit() -> None:
    """An idle mapping of a fitting size counts toward the reservation and
    stays in the pool; a second reservation makes nothing."""
    pool = _Pool()
    kept = address(pool.array(MIB16))  # dropped at once: idle
    assert pool.reserve(MIB16, 2) == 1
    assert kept in pooled(pool)
    assert pool.reserve(MIB16, 2) == 0


def test_reserve_makes_at_most_the_pools_size() -> None:
    """A reservation past the pool's size makes only what it keeps, and a
    mapping in use does not count."""
    pool = _Pool()
    held = pool.array(MIB16)
    assert pool.reserve(MIB16, 5) == 2
    assert address(held) not in pooled(pool)


def test_reserve_ignores_arrays_too_small_to_pool() -> None:
    """Below the pooled size, reserve does nothing."""
    assert reserve(1 << 20) == 0
