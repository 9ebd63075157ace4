"""What the benchmark records about the machine it ran on."""

from __future__ import annotations

import os
import pickle
import platform
import sys
import time
from typing import Any

import numpy as np
import psutil

from lmcache_mp._util.version import __version__
from lmcache_mp.executors import physical_cores

__all__ = ["load_average", "machine_info", "references", "usable_cores"]

#: Bytes of the reference copies: well past any last-level cache.
_REF_BYTES = 256 * 2**20
#: Copies timed; the best is kept (the least disturbed by other processes).
_REF_TRIES = 5


def usable_cores() -> int:
    """Cores a parallel run can use: physical cores, within the CPU affinity.

    Returns:
        At least 1.
    """
    cores = physical_cores()
    affinity = getattr(os, "sched_getaffinity", None)
    if affinity is not None:
        cores = min(cores, len(affinity(0)))
    return max(1, cores)


def load_average() -> float | None:
    """The 1-minute load average (``None`` where the OS has none).

    Recorded before and after a run: a load well above zero at the start
    means something else was using the cores.
    """
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _blas() -> list[dict[str, Any]] | None:
    """The BLAS/OpenMP runtimes numpy loaded, via threadpoolctl if installed."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return None
    keys = ("user_api", "internal_api", "prefix", "version", "num_threads")
    return [{k: info.get(k) for k in keys} for info in threadpool_info()]


def machine_info(start_method: str) -> dict[str, Any]:
    """Describe the machine and software a run used.

    Args:
        start_method: The multiprocessing start method of the run.

    Returns:
        A JSON-ready dict; see the schema in :mod:`lmcache_mp.bench`.
    """
    memory = psutil.virtual_memory()
    return {
        "cores_physical": psutil.cpu_count(logical=False),
        "cores_logical": psutil.cpu_count(logical=True),
        "cores_used": usable_cores(),
        "cpu_model": _cpu_model(),
        "memory_total_bytes": memory.total,
        "memory_available_bytes": memory.available,
        "load_average_1m": load_average(),
        "python": sys.version.split()[0],
        "python_implementation": platform.python_implementation(),
        "numpy": np.__version__,
        "lmcache_mp": __version__,
        "platform": platform.platform(),
        "machine": platform.machine(),
        "start_method": start_method,
        "blas": _blas(),
    }


def references() -> dict[str, float]:
    """Measure this machine's memcpy and pickle speeds (GB/s, best of 5).

    Returns:
        ``memcpy_gb_s`` (a 256 MiB copy by one core into pages already
        touched, the rate a copy between two allocated buffers reaches)
        and ``pickle_gb_s`` (a 256 MiB array pickled and unpickled: one
        trip through a pipe's encoding).
    """
    src = np.ones(_REF_BYTES, np.uint8)
    # Touched before timing: a first write into fresh pages pays the page
    # faults, which is not the copy's speed.
    dst = np.zeros_like(src)
    dst.fill(1)

    def best(fn: Any) -> float:
        times = []
        for _ in range(_REF_TRIES):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return _REF_BYTES / min(times) / 1e9

    return {
        "memcpy_gb_s": best(lambda: np.copyto(dst, src)),
        "pickle_gb_s": best(
            lambda: pickle.loads(pickle.dumps(src, protocol=pickle.HIGHEST_PROTOCOL))
        ),
    }
