"""What every executor shares: the phase executor interface and its result.

Every executor takes the same input (a :class:`~lmcache_mp._core.phase.PhaseSpec`
and one job per stream) and returns one outcome per stream; the batch
commits the successful ones.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable, Collection
from concurrent.futures import ALL_COMPLETED, FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, TypeAlias

from lmcache_mp._core.phase import PhaseSpec, StreamJob, StreamOutcome
from lmcache_mp.errors import PhaseTimeoutError

__all__ = [
    "EXECUTOR_NAMES",
    "PhaseExecutor",
    "PhaseRun",
    "Preload",
    "timeout_outcome",
    "wait_interruptibly",
]

#: What a worker preloads as it starts: a module to import, or a callable
#: to call (it must pickle, e.g. a bound method of a picklable engine).
Preload: TypeAlias = str | Callable[[], object]

#: The longest the parent blocks on its futures in one call. The kernel may
#: hand a process-directed signal (Ctrl-C's SIGINT) to any thread, and a
#: main thread blocked on a lock does not wake for a signal another thread
#: took: waking this often lets the KeyboardInterrupt through (a CI run of
#: test_ctrl_c_stops_the_parent_and_every_worker hung on it).
_POLL_S = 0.25

#: The executor names ``LMCacheBatchedStream(executor=...)`` accepts.
EXECUTOR_NAMES = ("auto", "process", "serial", "thread")


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
        workers: Workers or threads the phase ran on, where the executor
            decides it per phase (``"auto"``'s choice, the thread
            executor's one per stream); 0: the executor's own count.
        unrun: Streams a ``hold`` of the run left unrun (none were sent).
    """

    outcomes: dict[str, StreamOutcome] = field(default_factory=dict)
    bytes_sent: int = 0
    bytes_received: int = 0
    pool_start_s: float = 0.0
    pool_rebuilds: int = 0
    executor: str = ""
    reason: str = ""
    workers: int = 0
    unrun: list[str] = field(default_factory=list)


def timeout_outcome(job: StreamJob, timeout: float | None) -> StreamOutcome:
    """The outcome of a stream still unfinished when the phase timed out."""
    error = PhaseTimeoutError(
        f"stream {job.stream_id}: unfinished when the phase timeout of "
        f"{timeout:g}s ran out; it keeps its previous state"
    )
    return StreamOutcome(job.stream_id, error=error)


def wait_interruptibly(
    futures: Collection[Future[Any]],
    timeout: float | None,
    return_when: str = ALL_COMPLETED,
) -> set[Future[Any]]:
    """``concurrent.futures.wait`` that a signal interrupts within
    ``_POLL_S`` seconds, whichever thread the kernel handed it to.

    Args:
        futures: The futures to wait for.
        timeout: Seconds to wait at most; ``None`` for no limit.
        return_when: ``ALL_COMPLETED`` or ``FIRST_COMPLETED``.

    Returns:
        The futures done when it returned.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        step = _POLL_S
        if deadline is not None:
            step = min(step, max(0.0, deadline - time.monotonic()))
        done, not_done = wait(futures, timeout=step, return_when=return_when)
        if not not_done or (done and return_when == FIRST_COMPLETED):
            return done
        if deadline is not None and time.monotonic() >= deadline:
            return done


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
