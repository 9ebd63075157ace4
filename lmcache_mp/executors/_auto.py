"""``executor="auto"``: threads or processes, chosen per phase.

Data flow of a phase::

    batch --run(spec, jobs)--> AutoExecutor
      generate: the engines' GIL hints ------------------------> choice
      modify:   fn digest seen before? -------------------------> choice
                else fn hint gil_bound? ------------------------> processes
                else run jobs[0] under a GIL watch:
                     pool running: every job to the pool, jobs[0] first,
                     a round in flight until its figures are back (the
                     hold); a choice of threads takes the jobs not sent
                     pool idle: jobs[0] alone here, the rest after it
                     seconds c, GIL-held share g --> cost model -> choice
      the other jobs --> ThreadExecutor | ProcessExecutor --> PhaseRun
                         (.executor and .reason say which and why)

Threads cost nothing to start and move no state through pipes, but run
Python bytecode one stream at a time; processes run it on every core but
pay a round trip per stream and, once per batch, the pool start. The
first modify stream of an unknown fn is a real run (its outcome commits),
measured where a worker would run it: in one, when the pool runs,
else on the caller's thread with one BLAS thread. The cost model
(:func:`~lmcache_mp.executors._cost.weigh`) counts the GIL-held share of
a stream's wall time as serial on threads.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Sequence

import cloudpickle

from lmcache_mp._core.phase import PhaseSpec, StreamJob, StreamOutcome
from lmcache_mp._util.blas import limit_blas_while, physical_cores
from lmcache_mp._util.gilwatch import GilProbe
from lmcache_mp.errors import LMCachePicklingError
from lmcache_mp.executors._base import PhaseExecutor, PhaseRun, Preload
from lmcache_mp.executors._cost import Choice, weigh
from lmcache_mp.executors._dispatch import Hold
from lmcache_mp.executors._process import ProcessExecutor
from lmcache_mp.executors._thread import ThreadExecutor
from lmcache_mp.executors._worker import run_job
from lmcache_mp.hints import gil_hint

__all__ = ["AutoExecutor", "measurement"]

#: Pool start assumed before one was measured, by start method (the order
#: of a pool start with the default preload: spawn's the slowest, fork's
#: the fastest).
_START_GUESS_S = {"spawn": 1.0, "forkserver": 0.6, "fork": 0.1}


def measurement(outcome: StreamOutcome | None) -> GilProbe | None:
    """The figures a measured stream came back with (``None``: none came)."""
    return None if outcome is None else outcome.probe


def _fn_digest(spec: PhaseSpec) -> str | None:
    try:
        blob = cloudpickle.dumps(spec.fn)
    except Exception:
        return None
    return hashlib.blake2b(blob, digest_size=16).hexdigest()


class AutoExecutor(PhaseExecutor):
    """Runs each phase on threads or on a process pool, whichever is faster.

    Args:
        max_workers: As for ``"process"`` (workers) and ``"thread"``
            (threads; default one per stream).
        mp_context: Start method of the pool.
        preload: Modules each worker imports at start, and callables
            each calls then.
        blas_threads: BLAS threads per worker.

    Raises:
        ValueError: As :class:`~lmcache_mp.executors._process.ProcessExecutor`.
    """

    name = "auto"

    def __init__(
        self,
        max_workers: int | None = None,
        mp_context: str = "spawn",
        preload: Sequence[Preload] = (),
        blas_threads: int | None = None,
    ) -> None:
        self._process = ProcessExecutor(max_workers, mp_context, preload, blas_threads)
        self._thread = ThreadExecutor(max_workers)
        self._mp_context = mp_context
        self._decisions: dict[str, Choice] = {}
        self._start_s: float | None = None
        #: A generate phase ran on the pool: the engine holds the GIL, so
        #: the batch's generate phases pay the pool start.
        self._engine_on_pool = False

    @property
    def workers(self) -> int:
        """Worker processes the pool has (or would have)."""
        return self._process.workers

    @property
    def process(self) -> ProcessExecutor:
        """The pool the process choice runs on (started on first use)."""
        return self._process

    def close(self) -> None:
        """Stop the pool if it was started; safe to call twice."""
        self._process.close()
        self._thread.close()

    def _pool_start_s(self) -> float:
        """The pool start a modify that picks processes is charged.

        The pool is persistent: its start is paid once per batch, by the
        first phase that uses it, and serves every later one.
        Nothing when it runs, or when this batch's engine holds the GIL (its
        generate phases run on the pool anyway); else the measured start,
        or a guess by start method before one was measured.
        """
        if self._process.pids() or self._engine_on_pool:
            return 0.0
        if self._start_s is not None:
            return self._start_s
        return _START_GUESS_S.get(self._mp_context, 1.0)

    def choose_generate(self, spec: PhaseSpec, n_jobs: int) -> Choice:
        """Pick by the engines: GIL-bound ones (the embedded engine) need
        processes; I/O-bound ones (an HTTP client) run on threads."""
        hints = [gil_hint(engine) for engine in spec.engines]
        if n_jobs > 1 and physical_cores() > 1 and any(h is True for h in hints):
            return Choice("process", "the engine computes in Python (holds the GIL)")
        if hints and all(h is False for h in hints):
            return Choice("thread", "the engine waits on I/O (releases the GIL)")
        if n_jobs <= 1 or physical_cores() <= 1:
            return Choice("thread", "nothing to run in parallel")
        return Choice("thread", "the engine gives no GIL hint: threads, as upstream")

    def run(
        self,
        spec: PhaseSpec,
        jobs: list[StreamJob],
        *,
        timeout: float | None = None,
        max_in_flight: int | None = None,
    ) -> PhaseRun:
        """Run a phase on the chosen executor; see :meth:`PhaseExecutor.run`."""
        if spec.kind == "generate":
            choice = self.choose_generate(spec, len(jobs))
            self._engine_on_pool |= choice.executor == "process"
            return self._run_on(choice, spec, jobs, timeout, max_in_flight)
        digest = _fn_digest(spec)
        if digest is None:
            # A fn that cannot be pickled still runs, on threads.
            choice = Choice("thread", "the modify fn cannot be pickled")
        elif digest in self._decisions:
            choice = self._decisions[digest]
        elif len(jobs) <= 1 or physical_cores() <= 1:
            choice = Choice("thread", "nothing to run in parallel")
        elif gil_hint(spec.fn) is True:
            choice = self._decisions[digest] = Choice(
                "process", "the modify fn is marked gil_bound"
            )
        else:
            return self._probe(spec, jobs, digest, timeout, max_in_flight)
        return self._run_on(choice, spec, jobs, timeout, max_in_flight)

    def _probe(
        self,
        spec: PhaseSpec,
        jobs: list[StreamJob],
        digest: str,
        timeout: float | None,
        max_in_flight: int | None,
    ) -> PhaseRun:
        """Run the first stream measured, and the rest where it says.

        With the pool running, every stream goes to the pool, the measured
        one first, a round at a time (one in flight per worker) until the
        measurement is back, then as usual; a choice of threads takes the
        streams not sent yet instead. Nothing runs alone while it is measured, and a fn
        that belongs on processes loses nothing to it: a lone measurement
        of one large stream in the caller would add a whole round to a
        modify phase that the pool runs in a few. Without a pool, the
        measured stream runs alone on the caller's thread with one BLAS
        thread, as a worker would: a start would outlast it, and threads
        may be the choice. The measured stream is real work; its outcome
        commits.
        """
        begin = time.perf_counter()
        first = dataclasses.replace(jobs[0], measure=True)
        # The choice once the measured outcome is back (None: it came back
        # without figures, its worker lost).
        decided: list[Choice | None] = []

        def decide(run: PhaseRun) -> Choice | None:
            outcome = run.outcomes.get(first.stream_id)
            if not decided and outcome is not None:
                choice = self._weigh(spec, len(jobs), digest, outcome)
                decided.append(choice)
            return decided[0] if decided else None

        def hold(run: PhaseRun) -> bool | None:
            choice = decide(run)
            return None if choice is None else choice.executor != "process"

        if self._process.pids():
            pool = Choice("process", "the pool runs the measured stream")
            all_jobs = [first, *jobs[1:]]
            run = self._run_on(pool, spec, all_jobs, timeout, max_in_flight, hold)
            if run.executor != "process":
                return run  # the phase could not reach the pool
            unrun = set(run.unrun)
            rest = [job for job in jobs if job.stream_id in unrun]
        else:
            with limit_blas_while(physical_cores()):
                run = PhaseRun(
                    outcomes={first.stream_id: run_job(spec, first, remote=False)}
                )
            rest = jobs[1:]
        # A worker that died before reporting: nothing learnt, nothing kept.
        choice = decide(run) or Choice(
            "process" if self._process.pids() else "thread",
            "the measured stream did not report",
        )
        if rest:
            spent = time.perf_counter() - begin
            left = None if timeout is None else max(0.0, timeout - spent)
            run = _merged(run, self._run_on(choice, spec, rest, left, max_in_flight))
        run.executor, run.reason = choice.executor, choice.reason
        return run

    def _weigh(
        self, spec: PhaseSpec, n_jobs: int, digest: str, outcome: StreamOutcome
    ) -> Choice | None:
        """The choice for a phase's other streams from its measured one's
        outcome; kept for the fn when that stream succeeded."""
        probe = measurement(outcome)
        if probe is None:
            return None
        held = 0.0 if gil_hint(spec.fn) is False else probe.held
        # Weighed for every other stream, as a later phase of the same fn
        # (which reuses the choice) runs them all on it.
        choice = weigh(
            probe.wall_s,
            held,
            n_jobs - 1,
            physical_cores(),
            self._pool_start_s(),
            probe.cpu,
        )
        if outcome.error is None:
            self._decisions[digest] = choice
        return choice

    def _run_on(
        self,
        choice: Choice,
        spec: PhaseSpec,
        jobs: list[StreamJob],
        timeout: float | None,
        max_in_flight: int | None,
        hold: Hold | None = None,
    ) -> PhaseRun:
        try:
            if choice.executor == "thread":
                inner: PhaseExecutor = self._thread
                run = inner.run(
                    spec, jobs, timeout=timeout, max_in_flight=max_in_flight
                )
            else:
                inner = self._process
                run = self._process.run(
                    spec, jobs, timeout=timeout, max_in_flight=max_in_flight, hold=hold
                )
        except LMCachePicklingError as exc:
            # A context or engine that cannot reach a worker still runs
            # here; nothing was sent, so no stream has run yet.
            choice = Choice("thread", f"the phase cannot be pickled: {exc}")
            inner = self._thread
            run = inner.run(spec, jobs, timeout=timeout, max_in_flight=max_in_flight)
        if run.pool_start_s:
            self._start_s = run.pool_start_s
        run.executor, run.reason = choice.executor, choice.reason
        run.workers = self._process.workers if inner is self._process else len(jobs)
        return run


def _merged(first: PhaseRun, second: PhaseRun) -> PhaseRun:
    """One phase's figures from two runs of disjoint jobs."""
    return PhaseRun(
        outcomes={**first.outcomes, **second.outcomes},
        bytes_sent=first.bytes_sent + second.bytes_sent,
        bytes_received=first.bytes_received + second.bytes_received,
        pool_start_s=first.pool_start_s + second.pool_start_s,
        pool_rebuilds=first.pool_rebuilds + second.pool_rebuilds,
        workers=max(first.workers, second.workers),
    )
