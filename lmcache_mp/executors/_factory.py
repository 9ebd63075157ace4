"""Turning a batch's ``executor=`` argument into a phase executor."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Executor

from lmcache_mp.executors._auto import AutoExecutor
from lmcache_mp.executors._base import EXECUTOR_NAMES, PhaseExecutor
from lmcache_mp.executors._foreign import ForeignExecutor
from lmcache_mp.executors._process import ProcessExecutor
from lmcache_mp.executors._serial import SerialExecutor
from lmcache_mp.executors._thread import ThreadExecutor

__all__ = ["make_executor"]


def make_executor(
    executor: str | Executor | PhaseExecutor,
    max_workers: int | None,
    mp_context: str,
    preload: Sequence[str],
    blas_threads: int | None,
) -> PhaseExecutor:
    """Turn a batch's ``executor=`` argument into a :class:`PhaseExecutor`.

    Raises:
        ValueError: For an unknown executor name or start method.
    """
    if isinstance(executor, PhaseExecutor):
        return executor
    if isinstance(executor, Executor):
        return ForeignExecutor(executor)
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
        " or pass a concurrent.futures.Executor"
    )
