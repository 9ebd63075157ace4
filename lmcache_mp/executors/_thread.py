"""The thread executor: one thread per stream, as upstream."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

from lmcache_mp._core.phase import PhaseSpec, StreamJob, StreamOutcome
from lmcache_mp.executors._base import (
    PhaseExecutor,
    PhaseRun,
    physical_cores,
    timeout_outcome,
    wait_interruptibly,
)
from lmcache_mp.executors._worker import run_job

__all__ = ["ThreadExecutor", "limit_blas_while"]

_warned_uncapped = False


@contextlib.contextmanager
def limit_blas_while(concurrent: int) -> Iterator[None]:
    """Cap BLAS threads so that ``concurrent`` callers do not oversubscribe.

    One thread per stream with BLAS's default of one thread per core runs
    cores² threads; measured here, upstream's thread batch ran an O(T²) numpy
    edit at 0.8x the speed of a serial loop on 2 cores (issue #4), and the
    default benchmark's prefill 3.3x slower than with the cap. Needs
    threadpoolctl (the ``blas`` extra); without it, nothing is capped and a
    ``RuntimeWarning`` says so once.
    """
    global _warned_uncapped
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        if concurrent > 1 and not _warned_uncapped:
            _warned_uncapped = True
            warnings.warn(
                "lmcache_mp: threadpoolctl is not installed, so the thread "
                "executor cannot cap BLAS threads and oversubscribes the cores; "
                "pip install 'lmcache-mp[blas]'",
                RuntimeWarning,
                stacklevel=4,
            )
        yield
        return
    with threadpool_limits(limits=max(1, physical_cores() // max(1, concurrent))):
        yield


def _discard_late(future: Future[StreamOutcome]) -> None:
    if not future.cancelled() and future.exception() is None:
        future.result().discard_staged()


class ThreadExecutor(PhaseExecutor):
    """One thread per stream, as upstream; BLAS threads capped meanwhile.

    Args:
        max_workers: Cap on threads (default: one per stream, as upstream).
    """

    name = "thread"

    def __init__(self, max_workers: int | None = None) -> None:
        self._max_workers = max_workers

    @property
    def workers(self) -> int:
        """The thread cap, or 0 for one thread per stream."""
        return self._max_workers or 0

    def close(self) -> None:
        """Nothing to release: each phase's threads end with the phase."""

    def run(
        self,
        spec: PhaseSpec,
        jobs: list[StreamJob],
        *,
        timeout: float | None = None,
        max_in_flight: int | None = None,
    ) -> PhaseRun:
        """Run the jobs on threads; see :meth:`PhaseExecutor.run`.

        A stream still running at the timeout cannot be stopped (threads
        cannot be killed): it fails, and whatever it finishes later is
        discarded, never committed.
        """
        result = PhaseRun()
        if not jobs:
            return result
        n = min(len(jobs), self._max_workers or len(jobs))
        if spec.kind == "modify" and max_in_flight is not None:
            n = min(n, max(1, max_in_flight))
        pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="lmcache-mp")
        try:
            with limit_blas_while(n):
                futures: dict[Future[StreamOutcome], StreamJob] = {
                    pool.submit(run_job, spec, job, remote=False): job for job in jobs
                }
                done = wait_interruptibly(futures, timeout)
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        for future, job in futures.items():
            if future in done:
                result.outcomes[job.stream_id] = future.result()
            else:
                result.outcomes[job.stream_id] = timeout_outcome(job, timeout)
                # What the stream stages once it finishes is never committed.
                future.add_done_callback(_discard_late)
        return result
