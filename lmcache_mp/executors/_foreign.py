"""Phases on a ``concurrent.futures.Executor`` the caller owns."""

from __future__ import annotations

from concurrent.futures import Executor

from lmcache_mp._core.phase import StreamJob
from lmcache_mp._util.paths import remove_tree
from lmcache_mp.errors import TerminatedWorkerError
from lmcache_mp.executors._base import PhaseRun
from lmcache_mp.executors._claims import Claims
from lmcache_mp.executors._dispatch import ShardExecutor, fail_all

__all__ = ["ForeignExecutor"]


class ForeignExecutor(ShardExecutor):
    """Runs phases on a ``concurrent.futures.Executor`` the caller owns.

    The executor is not shut down by :meth:`close`. It must run tasks on
    this machine (the KV store and the phase file are local). A broken
    executor cannot be rebuilt here: the streams it lost fail.

    Args:
        executor: The caller's executor.
    """

    name = "custom"

    def __init__(self, executor: Executor) -> None:
        super().__init__()
        self._foreign = executor
        self.name = type(executor).__name__

    @property
    def workers(self) -> int:
        """The executor's ``_max_workers`` when it has one, else 0."""
        return int(getattr(self._foreign, "_max_workers", 0) or 0)

    def _executor(self, n_jobs: int, result: PhaseRun) -> Executor:
        return self._foreign

    def _after_break(
        self, jobs: list[StreamJob], lost: list[int], claims: Claims, result: PhaseRun
    ) -> list[int]:
        error = TerminatedWorkerError(
            f"the caller's executor {self._foreign!r} broke (a worker died); "
            "lmcache_mp cannot rebuild an executor it does not own"
        )
        fail_all(result, jobs, lost, error)
        return []

    def close(self) -> None:
        """Remove the phase files; the caller's executor is left running."""
        remove_tree(self._dir)
        self._dir = None
