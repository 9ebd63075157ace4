"""Phases on worker processes: a persistent pool of them.

Data flow of one phase (after CPython's ``concurrent/futures/process.py``)::

    parent (batch thread)                       worker process (x max_workers)
    ---------------------                       ------------------------------
    PhaseSpec: fn, contexts, engines
      | cloudpickle, once per phase
      v
    spec file (private dir, /dev/shm) ........> run_shard(ShardTask bytes)
    StreamJobs (states only)                      | loads the spec once per digest
      | pickle, a few jobs per ShardTask          | rebuilds each stream, runs it
      +---- call queue ------------------------>  | claims each job while it runs
                                                  | KV: store <-> worker directly,
                                                  |     never through a pipe
    StreamOutcomes (state+figures | error) <----  + one pickled outcome per job
      | result queue
      v
    the batch commits each successful stream

A worker that dies breaks a ``ProcessPoolExecutor`` and fails every pending
future. The claims (files) tell which streams the dead worker was running:
those fail with :class:`~lmcache_mp.errors.TerminatedWorkerError`; every
other unfinished stream is run again on a rebuilt pool.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Executor
from concurrent.futures.process import BrokenProcessPool, ProcessPoolExecutor
from multiprocessing.process import BaseProcess

from lmcache_mp._core.phase import StreamJob, StreamOutcome
from lmcache_mp._util.blas import physical_cores
from lmcache_mp._util.paths import remove_tree
from lmcache_mp.errors import TerminatedWorkerError
from lmcache_mp.executors._base import PhaseRun, Preload
from lmcache_mp.executors._claims import Claims
from lmcache_mp.executors._dispatch import ShardExecutor
from lmcache_mp.executors._worker import BLAS_ENV_VARS, initialize

__all__ = ["ProcessExecutor", "describe_exit"]

_SIGNAL_CAUSES = {
    signal.SIGKILL: "killed by another process or by the kernel's out-of-memory killer",
    signal.SIGSEGV: "a segmentation fault in native code (a C extension, ctypes)",
    signal.SIGBUS: "a bus error in native code",
    signal.SIGABRT: "an abort in native code",
    signal.SIGILL: "an illegal instruction in native code",
    signal.SIGFPE: "a floating-point exception in native code",
    signal.SIGTERM: "terminated by another process",
}


def describe_exit(exitcode: int | None) -> str:
    """Say how a worker ended and the likely cause, from its exit code."""
    if exitcode is None:
        return "its exit status is unknown"
    if exitcode < 0:
        try:
            sig = signal.Signals(-exitcode)
        except ValueError:
            return f"it was killed by signal {-exitcode}"
        cause = _SIGNAL_CAUSES.get(sig, "an unexpected signal")
        return f"it was killed by {sig.name} ({-exitcode}); likely cause: {cause}"
    return (
        f"it exited with code {exitcode}; likely cause: the code it ran called "
        "os._exit() or the interpreter hit a fatal error"
    )


@contextlib.contextmanager
def _blas_env(threads: int) -> Iterator[None]:
    """Set the BLAS thread variables the user has not set, while workers
    are spawned: a spawned interpreter reads them before importing numpy,
    which is the only time OpenBLAS/OpenMP read them."""
    added = [var for var in BLAS_ENV_VARS if var not in os.environ]
    for var in added:
        os.environ[var] = str(threads)
    try:
        yield
    finally:
        for var in added:
            os.environ.pop(var, None)


def _ping() -> int:
    # Sleep a little so that one fast worker does not take every ping.
    time.sleep(0.02)
    return os.getpid()


class ProcessExecutor(ShardExecutor):
    """A persistent pool of worker processes, started at the first phase.

    Args:
        max_workers: Worker processes (default: physical cores, at most the
            number of streams of the first phase).
        mp_context: Start method: ``"spawn"`` (default: safe with threads,
            same on every OS), ``"forkserver"`` or ``"fork"``.
        preload: Modules every worker imports once at start, and
            callables each calls then (with
            ``"forkserver"``, the server imports them once for all).
        blas_threads: BLAS/OpenMP threads per worker (default: cores //
            workers, so that workers x threads <= cores).

    Raises:
        ValueError: If ``mp_context`` is not a start method of this platform
            or ``max_workers`` is below 1.
    """

    name = "process"

    def __init__(
        self,
        max_workers: int | None = None,
        mp_context: str = "spawn",
        preload: Sequence[Preload] = (),
        blas_threads: int | None = None,
    ) -> None:
        super().__init__()
        methods = multiprocessing.get_all_start_methods()
        if mp_context not in methods:
            raise ValueError(
                f"mp_context {mp_context!r} is not a start method here; "
                f"choose one of {', '.join(methods)}"
            )
        if max_workers is not None and max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        if blas_threads is not None and blas_threads < 1:
            raise ValueError(f"blas_threads must be >= 1, got {blas_threads}")
        self._max_workers = max_workers
        self._mp_context = mp_context
        self._preload = tuple(preload)
        self._blas_threads = blas_threads
        self._pool: ProcessPoolExecutor | None = None
        self._procs: dict[int, BaseProcess] = {}
        self._n = 0

    @property
    def workers(self) -> int:
        """Worker processes of the running pool (or of the next one)."""
        return self._n or self._max_workers or physical_cores()

    @property
    def mp_context(self) -> str:
        """The start method."""
        return self._mp_context

    def pids(self) -> list[int]:
        """Return the pids of the running pool's workers."""
        return sorted(self._procs)

    def start(self, n_streams: int | None = None) -> float:
        """Start the workers now and wait until they run; no-op if running.

        Args:
            n_streams: Streams to size the pool for when ``max_workers``
                was not given.

        Returns:
            Seconds spent starting (0.0 when already running).
        """
        if self._pool is not None:
            return 0.0
        begin = time.perf_counter()
        n = self._max_workers or min(physical_cores(), n_streams or physical_cores())
        blas = self._blas_threads or max(1, physical_cores() // n)
        ctx = multiprocessing.get_context(self._mp_context)
        if self._mp_context == "forkserver":
            # threadpoolctl: each worker caps BLAS with it at start, and its
            # import is a large share of a worker's start; preloaded, a later
            # pool starts at once. The server skips a module it cannot import.
            ctx.set_forkserver_preload(
                [
                    "lmcache_mp.executors._worker",
                    "threadpoolctl",
                    *(m for m in self._preload if isinstance(m, str)),
                ]
            )
        pool = ProcessPoolExecutor(
            max_workers=n,
            mp_context=ctx,
            initializer=initialize,
            initargs=(blas, self._preload),
        )
        self._pool, self._n = pool, n
        try:
            with _blas_env(blas):
                seen: set[int] = set()
                while len(seen) < n:
                    pings = [pool.submit(_ping) for _ in range(n)]
                    # No deadline: a preload may load a model's weights for
                    # minutes on a busy machine, and a worker that dies
                    # while starting fails its ping with BrokenProcessPool
                    # (CPython's pool watches its processes' sentinels).
                    seen.update(f.result() for f in pings)
        except (BrokenProcessPool, OSError, ValueError) as exc:
            # OSError/ValueError: spawning raced with the pool's teardown.
            self._discard(kill=True)
            raise TerminatedWorkerError(
                f"the {self._mp_context} worker processes died while starting "
                "(their stderr says why). A script that uses the process "
                "executor must guard its entry point with "
                "`if __name__ == '__main__':`, because each worker imports the "
                "main module."
            ) from exc
        self._procs = dict(getattr(pool, "_processes", None) or {})
        return time.perf_counter() - begin

    def _executor(self, n_jobs: int, result: PhaseRun) -> Executor:
        result.pool_start_s += self.start(n_jobs)
        assert self._pool is not None
        # A pool spawns on demand; remember every worker it has had.
        self._procs.update(getattr(self._pool, "_processes", None) or {})
        return self._pool

    def _after_break(
        self, jobs: list[StreamJob], lost: list[int], claims: Claims, result: PhaseRun
    ) -> list[int]:
        """Blame the streams the dead worker ran; run the rest again."""
        procs = self._procs
        self._discard(kill=False)
        result.pool_rebuilds += 1
        running: dict[int, int] = {}
        for no, owner in claims.owners().items():
            with contextlib.suppress(ValueError):
                running[no] = int(owner)
        exits = {pid: proc.exitcode for pid, proc in procs.items()}
        codes = {pid: exits.get(pid) for pid in running.values()}
        # The pool SIGTERMs its other workers when one dies: those are
        # victims, whether or not the worker that died was running a stream.
        dead = {
            pid for pid, code in exits.items() if code not in (None, 0, -signal.SIGTERM)
        }
        if not dead:
            dead = set(codes)
        retry = []
        for no in lost:
            pid = running.get(no)
            if pid not in dead:
                retry.append(no)
                continue
            sid = jobs[no].stream_id
            code = codes[pid]
            error = TerminatedWorkerError(
                f"stream {sid}: worker process {pid} died while running it: "
                f"{describe_exit(code)}. The stream keeps its previous state.",
                code,
            )
            result.outcomes[sid] = StreamOutcome(sid, error=error)
        return retry

    def _discard(self, *, kill: bool) -> None:
        """Shut the pool down (killing its workers first if ``kill``)."""
        pool, procs = self._pool, self._procs
        self._pool, self._procs, self._n = None, {}, 0
        if pool is None:
            return
        # Include workers the pool spawned after the last snapshot (it may
        # spawn one while tearing itself down).
        procs = {**procs, **(getattr(pool, "_processes", None) or {})}
        if kill:
            for proc in procs.values():
                with contextlib.suppress(Exception):
                    proc.kill()
        # Joins the pool's manager thread, which joins every worker. Only that
        # thread may join them: a second reader of a forkserver child's exit
        # status finds the pipe drained and reports 255.
        pool.shutdown(wait=True, cancel_futures=True)

    def _on_timeout(self) -> None:
        self._discard(kill=True)

    def _abort(self) -> None:
        self._discard(kill=True)

    def close(self) -> None:
        """Stop the workers and remove the pool's files; safe to call twice."""
        self._discard(kill=False)
        remove_tree(self._dir)
        self._dir = None
