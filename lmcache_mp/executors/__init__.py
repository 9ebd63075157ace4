"""How a phase is run: serially, on threads, on a process pool, auto, or
on a Dask or Ray cluster.

The batch picks an executor by name (``"auto"``, ``"serial"``,
``"thread"``, ``"process"``, ``"ray"``), by address (``"dask://..."``,
``"ray://..."``), or wraps a caller-owned
:class:`concurrent.futures.Executor` or ``distributed.Client``. One module
per engine, over one worker boundary (:mod:`lmcache_mp.executors._worker`,
the claims of :mod:`lmcache_mp.executors._claims` and the plain
dataclasses of :mod:`lmcache_mp._core.phase`).
"""

from lmcache_mp._util.blas import limit_blas_while, physical_cores
from lmcache_mp.executors._auto import AutoExecutor
from lmcache_mp.executors._base import (
    EXECUTOR_NAMES,
    PhaseExecutor,
    PhaseRun,
    Preload,
    timeout_outcome,
)
from lmcache_mp.executors._dask import DaskExecutor
from lmcache_mp.executors._factory import make_executor
from lmcache_mp.executors._process import ProcessExecutor
from lmcache_mp.executors._ray import RayExecutor
from lmcache_mp.executors._serial import SerialExecutor
from lmcache_mp.executors._thread import ThreadExecutor

__all__ = [
    "EXECUTOR_NAMES",
    "AutoExecutor",
    "DaskExecutor",
    "PhaseExecutor",
    "PhaseRun",
    "Preload",
    "ProcessExecutor",
    "RayExecutor",
    "SerialExecutor",
    "ThreadExecutor",
    "limit_blas_while",
    "make_executor",
    "physical_cores",
    "timeout_outcome",
]
