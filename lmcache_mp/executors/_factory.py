"""Turning a batch's ``executor=`` argument into a phase executor."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Executor
from typing import Any

from lmcache_mp.executors._auto import AutoExecutor
from lmcache_mp.executors._base import EXECUTOR_NAMES, PhaseExecutor, Preload
from lmcache_mp.executors._dask import DaskExecutor, is_dask_client
from lmcache_mp.executors._foreign import ForeignExecutor
from lmcache_mp.executors._process import ProcessExecutor
from lmcache_mp.executors._ray import RayExecutor
from lmcache_mp.executors._serial import SerialExecutor
from lmcache_mp.executors._thread import ThreadExecutor

__all__ = ["make_executor"]


def make_executor(
    executor: str | Executor | PhaseExecutor | Any,
    max_workers: int | None,
    mp_context: str,
    preload: Sequence[Preload],
    blas_threads: int | None,
) -> PhaseExecutor:
    """Turn a batch's ``executor=`` argument into a :class:`PhaseExecutor`.

    ``"dask://HOST:PORT"`` or a ``distributed.Client`` runs phases on Dask;
    ``"ray"`` (the runtime this process has, or a local one) or
    ``"ray://HOST:PORT"`` on Ray.

    Raises:
        ValueError: For an unknown executor name or start method.
        TypeError: For an executor that is none of these.
    """
    if isinstance(executor, PhaseExecutor):
        return executor
    if is_dask_client(executor):
        return DaskExecutor(executor)
    if isinstance(executor, Executor):
        return ForeignExecutor(executor)
    if not isinstance(executor, str):
        raise TypeError(
            f"executor must be a name, a concurrent.futures.Executor or a "
            f"distributed.Client, got {type(executor).__name__}"
        )
    if executor.startswith(("dask://", "tcp://")):
        return DaskExecutor(executor)
    if executor == "ray" or executor.startswith("ray://"):
        if executor == "ray":
            return RayExecutor(None, max_workers)
        return RayExecutor(executor)
    if executor == "auto":
        return AutoExecutor(max_workers, mp_context, preload, blas_threads)
    if executor == "process":
        return ProcessExecutor(max_workers, mp_context, preload, blas_threads)
    if executor == "thread":
        return ThreadExecutor(max_workers)
    if executor == "serial":
        return SerialExecutor()
    raise ValueError(
        f"unknown executor {executor!r}; choose one of {', '.join(EXECUTOR_NAMES)}"
        ", dask://HOST:PORT, ray, ray://HOST:PORT, or pass a "
        "concurrent.futures.Executor or a distributed.Client"
    )
