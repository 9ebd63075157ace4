"""How a phase is run: serially, on threads, or on a process pool.

Every executor takes the same input (a :class:`~lmcache_mp._phase.PhaseSpec`
and one job per stream) and returns one outcome per stream; the batch
commits the successful ones. The batch picks an executor by name
(``"auto"``, ``"serial"``, ``"thread"``, ``"process"``) or wraps a caller-owned
:class:`concurrent.futures.Executor`.
"""

from __future__ import annotations

import abc
import contextlib
import os
import time
import warnings
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from types import TracebackType

from lmcache_mp._phase import PhaseSpec, StreamJob, StreamOutcome
from lmcache_mp._worker import run_job
from lmcache_mp.errors import PhaseTimeoutError

__all__ = [
    "EXECUTOR_NAMES",
    "PhaseExecutor",
    "PhaseRun",
    "SerialExecutor",
    "ThreadExecutor",
    "limit_blas_while",
    "physical_cores",
    "timeout_outcome",
]

#: The executor names ``LMCacheBatchedStream(executor=...)`` accepts.
EXECUTOR_NAMES = ("auto", "process", "serial", "thread")


def physical_cores() -> int:
    """Return the number of physical cores (logical ones if unknown)."""
    import psutil

    return psutil.cpu_count(logical=False) or os.cpu_count() or 1


@dataclass
class PhaseRun:
    """What running one phase produced.

    Args:
        outcomes: Stream id to its outcome, for every job.
        bytes_sent: Bytes pickled from the parent to workers.
        bytes_received: Bytes pickled from workers back to the parent.
        pool_start_s: Seconds spent starting worker processes in this phase.
        pool_rebuilds: Times the pool was rebuilt after a worker died.
        executor: The executor ``"auto"`` chose (``""`` for the others).
        reason: Why it chose it.
        workers: Workers or threads the chosen executor ran (``"auto"``).
    """

    outcomes: dict[str, StreamOutcome] = field(default_factory=dict)
    bytes_sent: int = 0
    bytes_received: int = 0
    pool_start_s: float = 0.0
    pool_rebuilds: int = 0
    executor: str = ""
    reason: str = ""
    workers: int = 0


def timeout_outcome(job: StreamJob, timeout: float | None) -> StreamOutcome:
    """The outcome of a stream still unfinished when the phase timed out."""
    error = PhaseTimeoutError(
        f"stream {job.stream_id}: unfinished when the phase timeout of "
        f"{timeout:g}s ran out; it keeps its previous state"
    )
    return StreamOutcome(job.stream_id, error=error)


class PhaseExecutor(abc.ABC):
    """Runs the jobs of a phase and returns one outcome per stream."""

    #: Short name shown in reports.
    name: str = ""

    @property
    @abc.abstractmethod
    def workers(self) -> int:
        """How many streams can run at once (0 when unbounded/unknown)."""

    @abc.abstractmethod
    def run(
        self,
        spec: PhaseSpec,
        jobs: list[StreamJob],
        *,
        timeout: float | None = None,
        max_in_flight: int | None = None,
    ) -> PhaseRun:
        """Run every job of a phase.

        Args:
            spec: The phase.
            jobs: One job per stream; each holds a copy of the state.
            timeout: Seconds after which unfinished streams fail with
                :class:`~lmcache_mp.errors.PhaseTimeoutError`.
            max_in_flight: For modify phases, how many streams may hold
                their KV in memory at once (``None``: no extra bound).

        Returns:
            The outcomes and transport figures.

        Raises:
            LMCachePicklingError: If the phase cannot be shipped to workers.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Release what the executor holds; safe to call twice."""

    def __enter__(self) -> PhaseExecutor:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


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
                done, _ = wait(futures, timeout=timeout)
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
