"""The cores of this machine, and BLAS threads capped for concurrent callers."""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator

__all__ = ["limit_blas_while", "physical_cores"]

_warned_uncapped = False


def physical_cores() -> int:
    """Return the number of physical cores (logical ones if unknown)."""
    import psutil

    return psutil.cpu_count(logical=False) or os.cpu_count() or 1


@contextlib.contextmanager
def limit_blas_while(concurrent: int) -> Iterator[None]:
    """Cap BLAS threads so that ``concurrent`` callers do not oversubscribe.

    One thread per caller with BLAS's default of one thread per core runs
    cores² threads: slower than a serial loop for an O(T²) numpy edit, and
    OpenBLAS aborts the process once its callers outnumber the threads it
    was built for ("precompiled NUM_THREADS exceeded"). Needs threadpoolctl
    (the ``blas`` extra); without it, nothing is capped and a
    ``RuntimeWarning`` says so once.
    """
    global _warned_uncapped
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        if concurrent > 1 and not _warned_uncapped:
            _warned_uncapped = True
            warnings.warn(
                "lmcache_mp: threadpoolctl is not installed, so BLAS threads "
                "cannot be capped for concurrent callers and oversubscribe "
                "the cores; pip install 'lmcache-mp[blas]'",
                RuntimeWarning,
                stacklevel=4,
            )
        yield
        return
    with threadpool_limits(limits=max(1, physical_cores() // max(1, concurrent))):
        yield
