"""What runs inside a worker process (and, for in-process executors, in
the caller): rebuild a stream from its state, run the phase, hand back the
new state and the figures.

Nothing here touches the parent's objects; the boundary is the plain
dataclasses of :mod:`lmcache_mp._core.phase`.
"""

from __future__ import annotations

import importlib
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import threading
import traceback
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import cloudpickle

from lmcache_mp._core.phase import PhaseSpec, StreamJob, StreamOutcome
from lmcache_mp._core.streambase import StreamBase
from lmcache_mp._util.gilwatch import GilWatch
from lmcache_mp.errors import (
    LMCachePicklingError,
    LMCacheStreamError,
    TerminatedWorkerError,
)
from lmcache_mp.executors._base import Preload
from lmcache_mp.executors._claims import Claims

__all__ = ["BLAS_ENV_VARS", "ShardTask", "initialize", "run_job", "run_shard"]

#: Environment variables that cap the threads of the common BLAS/OpenMP
#: runtimes; read when the library loads.
BLAS_ENV_VARS = (
    "OMP_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "MKL_NUM_THREADS",
    "BLIS_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
    "NUMEXPR_NUM_THREADS",
)


@dataclass(frozen=True)
class ShardTask:
    """One task sent to a worker: some jobs of one phase.

    Args:
        spec_path: File holding the cloudpickled :class:`PhaseSpec`; the
            spec is written once per phase and read once per worker, so a
            large closure crosses no pipe at all. ``""`` when the engine
            hands the spec's bytes to the task itself (Dask's scatter,
            Ray's object store).
        spec_digest: Digest of the spec's bytes (the worker's cache key).
        jobs: The jobs.
        job_nos: Phase-wide number of each job (its claim's name).
        concurrent: Run the jobs on threads, all at once (prefill/decode
            keep every request in flight, as upstream's thread per stream).
        claims: Where a job is claimed while it runs, so that the parent
            can tell which streams a dead worker was running.
    """

    spec_path: str
    spec_digest: str
    jobs: list[StreamJob]
    job_nos: list[int]
    concurrent: bool
    claims: Claims


_spec_lock = threading.Lock()
# One spec only: a large closure is dropped as soon as the next phase starts.
_cached_spec: tuple[str, PhaseSpec] | None = None


def initialize(blas_threads: int | None, preload: Sequence[Preload]) -> None:
    """Prepare a fresh worker process.

    Ctrl-C is left to the parent, which stops the pool itself (a worker
    interrupted mid-store would otherwise report a spurious failure).

    Args:
        blas_threads: Cap on BLAS/OpenMP threads, or ``None`` for no cap.
        preload: Modules to import now rather than in every phase, and
            callables to call now (e.g. an engine's ``load``, so that each
            worker loads its model once, as it starts).
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = multiprocessing.parent_process()
    if parent is not None:
        # An idle worker blocks on the call queue forever if the parent is
        # SIGKILLed (e.g. by the OOM killer): exit when the parent does.
        threading.Thread(
            target=_exit_with_parent, args=(parent.sentinel,), daemon=True
        ).start()
    if blas_threads is not None:
        limit_blas_threads(blas_threads)
    for item in preload:
        if isinstance(item, str):
            importlib.import_module(item)
        else:
            item()


def _exit_with_parent(sentinel: int) -> None:
    multiprocessing.connection.wait([sentinel])
    os._exit(1)


def limit_blas_threads(n: int) -> None:
    """Cap BLAS/OpenMP threads in this process at ``n``.

    Sets the environment variables (for runtimes loaded later, e.g. torch
    imported by a modify fn) and, with threadpoolctl installed, also limits
    the runtimes already loaded (numpy's BLAS).

    Args:
        n: The number of threads, at least 1.
    """
    for var in BLAS_ENV_VARS:
        os.environ[var] = str(n)
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return
    threadpool_limits(limits=n)


def _load_spec(task: ShardTask, blob: bytes | None) -> PhaseSpec:
    global _cached_spec
    digest = task.spec_digest
    with _spec_lock:
        if _cached_spec is not None and _cached_spec[0] == digest:
            return _cached_spec[1]
        _cached_spec = None  # drop the previous phase's spec before loading
        if blob is None:
            with open(task.spec_path, "rb") as f:
                blob = f.read()
        spec = cloudpickle.loads(blob)
        if not isinstance(spec, PhaseSpec):
            raise TypeError(f"phase {digest} does not hold a PhaseSpec")
        _cached_spec = (digest, spec)
        return spec


def run_job(spec: PhaseSpec, job: StreamJob, *, remote: bool) -> StreamOutcome:
    """Run one stream's share of a phase; never raises for the stream's errors.

    Args:
        spec: The phase.
        job: The stream's job; its state is used (and replaced) in place.
        remote: Record the formatted traceback of an error (it does not
            survive pickling, so a worker must send it as text).

    Returns:
        The new state and figures, or the error; for a measured job
        (``job.measure``), with the GIL watch's figures of the whole run
        (retrieve, fn and store) in ``probe``.
    """
    if not job.measure:
        return _run_stream(spec, job, remote)
    with GilWatch() as watch:
        outcome = _run_stream(spec, job, remote)
    outcome.probe = watch.probe()
    return outcome


def _run_stream(spec: PhaseSpec, job: StreamJob, remote: bool) -> StreamOutcome:
    stream = StreamBase(
        spec.contexts[job.ctx_index],
        spec.engines[job.engine_index],
        (),
        job.cache_salt,
        stream_id=job.stream_id,
        state=job.state,
        # Only the KV context may be absent (a 0.5.6 stream without one).
        others={
            kind: ctx
            for kind, index in job.others
            if (ctx := spec.contexts[index]) is not None
        },
        kinds=job.kinds,
    )
    try:
        if spec.kind == "generate":
            perf = stream.generate(spec.sampling_params)
            return StreamOutcome(job.stream_id, state=stream.state, perf=perf)
        assert spec.fn is not None
        modify, staged = stream._modify(
            spec.fn,
            spec.retrieve_timeout,
            spec.poll_interval,
            stage=True,
            array=spec.array,
            skip_unchanged=spec.skip_unchanged,
        )
        return StreamOutcome(
            job.stream_id, state=stream.state, modify=modify, staged=staged
        )
    except (Exception, SystemExit, KeyboardInterrupt) as exc:
        # A fn's own sys.exit() or KeyboardInterrupt fails its stream only,
        # on a thread as in a worker process: the caller's Ctrl-C is
        # delivered to its main thread, which stops the phase itself.
        error = exc if isinstance(exc, Exception) else _exited(job.stream_id, exc)
        tb = "".join(traceback.format_exception(exc)) if remote else None
        return StreamOutcome(job.stream_id, error=error, traceback=tb)


def _exited(sid: str, exc: BaseException) -> LMCacheStreamError:
    """The stream error for a ``SystemExit``/``KeyboardInterrupt`` its work
    raised, with that exception as its cause."""
    error = LMCacheStreamError(
        f"stream {sid}: its work raised {type(exc).__name__}({exc}); the "
        "stream fails, the other streams of the phase run on",
        sid,
    )
    error.__cause__ = exc
    return error


def _dump_outcome(outcome: StreamOutcome) -> bytes:
    """Pickle an outcome; an unpicklable part fails this stream only."""
    sid = outcome.stream_id
    if outcome.error is not None:
        try:
            pickle.loads(pickle.dumps(outcome.error))
        except Exception:
            # Some exceptions cannot round-trip (custom __init__ signatures);
            # keep their text, and the traceback that goes with it.
            outcome.error = LMCacheStreamError(
                f"stream {sid}: {type(outcome.error).__name__}: {outcome.error}", sid
            )
    try:
        return pickle.dumps(outcome, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        outcome.discard_staged()
        error = LMCachePicklingError(
            f"stream {sid}: its result could not be pickled to send it back "
            f"from the worker (is the modify fn's info picklable?): "
            f"{type(exc).__name__}: {exc}"
        )
        failed = StreamOutcome(
            sid, error=error, traceback="".join(traceback.format_exception(exc))
        )
        return pickle.dumps(failed, protocol=pickle.HIGHEST_PROTOCOL)


def _run_claimed(task: ShardTask, spec: PhaseSpec, index: int, owner: str) -> bytes:
    no, job = task.job_nos[index], task.jobs[index]
    holder = task.claims.begin(no, owner)
    if holder is not None:
        # The engine runs this task again after losing the worker that held
        # the claim (Dask reschedules a lost worker's tasks): that stream
        # was running there, and fails as it would on the process pool.
        error = TerminatedWorkerError(
            f"stream {job.stream_id}: worker {holder} was lost while running "
            "it (the engine retried the task; lmcache_mp runs a stream once "
            "per phase). The stream keeps its previous state."
        )
        return _dump_outcome(StreamOutcome(job.stream_id, error=error))
    data = _dump_outcome(run_job(spec, job, remote=True))
    task.claims.end(no)
    return data


def run_shard(
    payload: bytes, spec_blob: bytes | None = None, owner: str = ""
) -> list[bytes]:
    """Worker entry point: run a pickled :class:`ShardTask`.

    Args:
        payload: The pickled task (the parent pickles it itself to count
            the bytes it sends).
        spec_blob: The cloudpickled spec, when the engine ships it rather
            than a file (``task.spec_path`` is then empty).
        owner: Names this worker in its claims (default: its pid, which is
            what the process pool's parent looks up).

    Returns:
        One pickled :class:`StreamOutcome` per job, in job order.
    """
    task: ShardTask = pickle.loads(payload)
    spec = _load_spec(task, spec_blob)
    owner = owner or str(os.getpid())
    indices = range(len(task.jobs))
    if task.concurrent and len(task.jobs) > 1:
        with ThreadPoolExecutor(max_workers=len(task.jobs)) as threads:
            return list(
                threads.map(lambda i: _run_claimed(task, spec, i, owner), indices)
            )
    return [_run_claimed(task, spec, i, owner) for i in indices]
