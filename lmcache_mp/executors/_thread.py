"""The thread executor: one thread per stream, as upstream."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

from lmcache_mp._core.phase import PhaseSpec, StreamJob, StreamOutcome
from lmcache_mp._util.blas import limit_blas_while
from lmcache_mp.executors._base import (
    PhaseExecutor,
    PhaseRun,
    timeout_outcome,
    wait_interruptibly,
)
from lmcache_mp.executors._worker import run_job

__all__ = ["ThreadExecutor"]


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
        if not jobs:
            return PhaseRun()
        n = min(len(jobs), self._max_workers or len(jobs))
        if spec.kind == "modify" and max_in_flight is not None:
            n = min(n, max(1, max_in_flight))
        result = PhaseRun(workers=n)
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
