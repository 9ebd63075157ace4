"""The serial executor: one stream after the other, in the calling thread."""

from __future__ import annotations

import time

from lmcache_mp._core.phase import PhaseSpec, StreamJob
from lmcache_mp.executors._base import PhaseExecutor, PhaseRun, timeout_outcome
from lmcache_mp.executors._worker import run_job

__all__ = ["SerialExecutor"]


class SerialExecutor(PhaseExecutor):
    """Runs the streams one after the other in the calling thread.

    The reference for correctness and the baseline of the benchmark. A
    timeout is checked between streams (a running stream is not stopped).
    """

    name = "serial"

    @property
    def workers(self) -> int:
        """Always 1."""
        return 1

    def close(self) -> None:
        """Nothing to release."""

    def run(
        self,
        spec: PhaseSpec,
        jobs: list[StreamJob],
        *,
        timeout: float | None = None,
        max_in_flight: int | None = None,
    ) -> PhaseRun:
        """Run the jobs in order; see :meth:`PhaseExecutor.run`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        result = PhaseRun()
        for job in jobs:
            if deadline is not None and time.monotonic() >= deadline:
                result.outcomes[job.stream_id] = timeout_outcome(job, timeout)
            else:
                result.outcomes[job.stream_id] = run_job(spec, job, remote=False)
        return result
