"""Shipping a phase to a ``concurrent.futures`` executor, shard by shard.

The parent side of the data flow drawn in :mod:`lmcache_mp.executors._process`: the
phase spec goes to a private file once, the jobs go out a few per task, and
one pickled outcome per job comes back. What a broken executor loses is
handed to the subclass (rebuild and retry, or fail).
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import hashlib
import os
import pickle
import sys
import time
import types
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Executor, Future
from concurrent.futures.process import BrokenProcessPool
from typing import Any

import cloudpickle

from lmcache_mp._core.phase import PhaseSpec, StreamJob, StreamOutcome
from lmcache_mp._util.paths import private_tempdir
from lmcache_mp.errors import (
    LMCachePicklingError,
    LMCacheStreamError,
    RemoteTraceback,
    TerminatedWorkerError,
)
from lmcache_mp.executors._base import (
    PhaseExecutor,
    PhaseRun,
    timeout_outcome,
    wait_interruptibly,
)
from lmcache_mp.executors._claims import Claims, FileClaims
from lmcache_mp.executors._worker import ShardTask, run_shard

__all__ = ["JOIN_TIMEOUT", "Hold", "ShardExecutor", "fail_all", "pickle_spec"]

#: Asked with the phase's figures so far each time outcomes come back while
#: jobs wait to be sent, until it decides: ``None`` (not yet: at most one
#: task per worker stays in flight, so that a stop leaves the most jobs
#: unsent), ``False`` (send the rest as usual) or ``True`` (leave them
#: unrun, named in ``PhaseRun.unrun``). How ``executor="auto"`` stops a
#: measured phase that belongs on threads.
Hold = Callable[[PhaseRun], bool | None]

#: Times a phase rebuilds a broken pool before failing what is left.
_MAX_ROUNDS = 3
#: Seconds to wait for workers to start, or to exit when closing.
JOIN_TIMEOUT = 60.0
#: Modify jobs per task: enough tasks (4 per worker) to balance the load,
#: few enough that a task's round trip is amortised over several streams.
_TASKS_PER_WORKER = 4


def pickle_spec(spec: PhaseSpec) -> bytes:
    """Cloudpickle a phase, naming what cannot be pickled.

    Raises:
        LMCachePicklingError: If the fn, a context or an engine cannot be
            pickled; raised before any stream is touched.
    """
    local = _unimportable_modules([spec.fn, *spec.engines])
    for module in local:
        cloudpickle.register_pickle_by_value(module)
    try:
        return bytes(cloudpickle.dumps(spec, protocol=pickle.HIGHEST_PROTOCOL))
    except Exception as exc:
        parts: list[tuple[str, Any]] = [("the modify fn", spec.fn)]
        parts += [("the KV context", c) for c in spec.contexts]
        parts += [("the post_completion", e) for e in spec.engines]
        for what, obj in parts:
            try:
                cloudpickle.dumps(obj)
            except Exception as inner:
                raise LMCachePicklingError(
                    f"cannot send {what} {obj!r} to the worker processes: "
                    f"{type(inner).__name__}: {inner}"
                ) from inner
        raise LMCachePicklingError(
            f"cannot send the {spec.kind} phase to the worker processes: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    finally:
        for module in local:
            cloudpickle.unregister_pickle_by_value(module)


def _unimportable_modules(objs: Sequence[Any]) -> list[types.ModuleType]:
    """The modules defining ``objs`` that a worker could not import by name.

    cloudpickle pickles a module-level function by reference; a worker then
    imports its module, which fails for a module loaded from a file outside
    ``sys.path`` (a notebook's helper file, ``importlib`` by path). Those are
    pickled by value instead. Modules already registered by the
    caller are left to the caller.
    """
    roots = [os.path.abspath(p or os.curdir) + os.sep for p in sys.path]
    registered = set(cloudpickle.list_registry_pickle_by_value())
    found = []
    for obj in objs:
        target = getattr(obj, "func", obj)  # functools.partial
        name = getattr(target, "__module__", None) or type(target).__module__
        module = sys.modules.get(name)
        path = getattr(module, "__file__", None)
        if module is None or name == "__main__" or path is None or name in registered:
            continue
        if not any(os.path.abspath(path).startswith(root) for root in roots):
            found.append(module)
            registered.add(name)
    return found


def _shards(concurrent: bool, pending: list[int], workers: int) -> list[list[int]]:
    """Split job numbers into tasks.

    Prefill/decode (``concurrent``): one task per worker, round robin, all
    run at once. Modify: consecutive runs of a few jobs, pulled as workers
    free up.
    """
    if concurrent:
        n = min(workers, len(pending))
        return [pending[i::n] for i in range(n)]
    size = max(1, -(-len(pending) // (workers * _TASKS_PER_WORKER)))
    return [pending[i : i + size] for i in range(0, len(pending), size)]


def fail_all(
    result: PhaseRun, jobs: list[StreamJob], nos: Sequence[int], exc: BaseException
) -> None:
    for no in nos:
        sid = jobs[no].stream_id
        error = LMCacheStreamError(
            f"stream {sid}: the worker could not run its task: "
            f"{type(exc).__name__}: {exc}",
            sid,
        )
        error.__cause__ = exc
        result.outcomes[sid] = StreamOutcome(sid, error=error)


class ShardExecutor(PhaseExecutor):
    """Ships phases to a ``concurrent.futures`` executor as shard tasks.

    The defaults suit workers on this machine: the spec goes to a private
    file, claims are files, and a lost task is a ``BrokenProcessPool``.
    Engines that reach other hosts override the hooks.
    """

    def __init__(self) -> None:
        self._dir: str | None = None

    @abc.abstractmethod
    def _executor(self, n_jobs: int, result: PhaseRun) -> Executor:
        """Return the executor to submit to, starting it if needed."""

    @abc.abstractmethod
    def _after_break(
        self, jobs: list[StreamJob], lost: list[int], claims: Claims, result: PhaseRun
    ) -> list[int]:
        """Fail what a broken executor lost; return what to run again."""

    def _on_timeout(self) -> None:
        """Stop what still runs after a phase timeout."""

    def _abort(self) -> None:
        """Stop everything now (Ctrl-C in the parent)."""

    def _private_dir(self) -> str:
        if self._dir is None:
            self._dir = private_tempdir("lmcache-mp-pool-")
        return self._dir

    def _share_spec(self, blob: bytes, digest: str) -> tuple[str, tuple[Any, ...]]:
        """Make the phase's bytes reachable by every worker.

        Returns:
            The spec file's path (``""`` for none) and the extra arguments
            each task is submitted with.
        """
        path = os.path.join(self._private_dir(), f"spec-{digest}")
        with open(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
            f.write(blob)
        return path, ()

    def _unshare_spec(self, path: str) -> None:
        """Drop what :meth:`_share_spec` made, once the phase is over."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)

    def _make_claims(self, spec: PhaseSpec) -> Claims:
        """The claims of one phase (files: the workers share this machine)."""
        return FileClaims.create(self._private_dir())

    def _submit(
        self, executor: Executor, payload: bytes, extra: tuple[Any, ...]
    ) -> Future[list[bytes]]:
        return executor.submit(run_shard, payload, *extra)

    def _is_lost(self, error: BaseException) -> bool:
        """Whether a task's error means its worker was lost (not a bug)."""
        return isinstance(error, BrokenProcessPool)

    def run(
        self,
        spec: PhaseSpec,
        jobs: list[StreamJob],
        *,
        timeout: float | None = None,
        max_in_flight: int | None = None,
        hold: Hold | None = None,
    ) -> PhaseRun:
        """Run the jobs in worker processes; see :meth:`PhaseExecutor.run`.

        Args:
            spec: As :meth:`PhaseExecutor.run`.
            jobs: As :meth:`PhaseExecutor.run`.
            timeout: As :meth:`PhaseExecutor.run`.
            max_in_flight: As :meth:`PhaseExecutor.run`.
            hold: Stop sending jobs once it says so; see :data:`Hold`.

        Returns:
            As :meth:`PhaseExecutor.run`.

        Raises:
            LMCachePicklingError: If the phase cannot be shipped to workers.
        """
        result = PhaseRun()
        if not jobs:
            return result
        blob = pickle_spec(spec)
        deadline = None if timeout is None else time.monotonic() + timeout
        digest = hashlib.blake2b(blob, digest_size=16).hexdigest()
        start_error: BrokenProcessPool | None = None
        spec_path: str = ""
        claims: Claims | None = None
        extra: tuple[Any, ...] = ()
        try:
            pending = list(range(len(jobs)))
            for _ in range(_MAX_ROUNDS):
                try:
                    executor = self._executor(len(jobs), result)
                except BrokenProcessPool as exc:
                    # A worker died while the pool started: no stream ran.
                    start_error = exc
                    result.pool_rebuilds += 1
                    continue
                start_error = None
                if claims is None:
                    spec_path, extra = self._share_spec(blob, digest)
                    result.bytes_sent += len(blob) * self._spec_copies()
                    claims = self._make_claims(spec)
                task = ShardTask(
                    spec_path, digest, [], [], spec.kind == "generate", claims
                )
                lost = self._dispatch(
                    executor,
                    task,
                    extra,
                    jobs,
                    pending,
                    deadline,
                    timeout,
                    max_in_flight,
                    result,
                    hold,
                )
                if not lost:
                    break
                pending = self._after_break(jobs, lost, claims, result)
                claims.clear()
                if not pending:
                    break
            else:
                if start_error is not None:
                    raise start_error
                error = TerminatedWorkerError(
                    f"workers died in {_MAX_ROUNDS} rounds in a row"
                )
                fail_all(result, jobs, pending, error)
        except BaseException:
            self._abort()
            raise
        finally:
            if claims is not None:
                claims.remove()
                self._unshare_spec(spec_path)
        return result

    def _spec_copies(self) -> int:
        """How many copies of the spec cross the data plane (one per worker
        for engines that broadcast it; none for a local file)."""
        return 1

    def _dispatch(
        self,
        executor: Executor,
        template: ShardTask,
        extra: tuple[Any, ...],
        jobs: list[StreamJob],
        pending: list[int],
        deadline: float | None,
        timeout: float | None,
        max_in_flight: int | None,
        result: PhaseRun,
        hold: Hold | None = None,
    ) -> list[int]:
        """Submit the pending jobs and collect outcomes.

        Returns:
            The job numbers lost to a broken executor (empty otherwise).
        """
        workers = max(1, self.workers)
        queue = deque(_shards(template.concurrent, pending, workers))
        if template.concurrent:
            limit = len(queue)
        else:
            limit = 2 * workers if max_in_flight is None else max(1, max_in_flight)
        running: dict[Future[list[bytes]], list[int]] = {}
        lost: list[int] = []
        while (queue or running) and not lost:
            cap = limit if hold is None else min(limit, workers)
            while queue and len(running) < cap:
                nos = queue.popleft()
                task = dataclasses.replace(
                    template, jobs=[jobs[no] for no in nos], job_nos=nos
                )
                payload = pickle.dumps(task, protocol=pickle.HIGHEST_PROTOCOL)
                try:
                    future = self._submit(executor, payload, extra)
                except BrokenProcessPool:
                    lost.extend(nos)
                    break
                result.bytes_sent += len(payload)
                running[future] = nos
            remaining = (
                None if deadline is None else max(0.0, deadline - time.monotonic())
            )
            done = wait_interruptibly(running, remaining, FIRST_COMPLETED)
            if not done and not lost:
                for nos in [*running.values(), *queue]:
                    for no in nos:
                        result.outcomes[jobs[no].stream_id] = timeout_outcome(
                            jobs[no], timeout
                        )
                self._on_timeout()
                return []
            for future in done:
                lost += self._collect(future, running.pop(future), jobs, result)
            verdict = None
            if queue and not lost and hold is not None:
                verdict = hold(result)
            if verdict is not None:
                hold = None
            if verdict:
                result.unrun += [jobs[no].stream_id for nos in queue for no in nos]
                queue.clear()
        if lost:
            # A broken pool fails every pending future at once; keep the
            # outcomes that made it back before the break.
            done = wait_interruptibly(running, JOIN_TIMEOUT)
            for future, nos in running.items():
                lost += (
                    self._collect(future, nos, jobs, result) if future in done else nos
                )
            for nos in queue:
                lost += nos
        return lost

    def _collect(
        self,
        future: Future[list[bytes]],
        nos: list[int],
        jobs: list[StreamJob],
        result: PhaseRun,
    ) -> list[int]:
        """Record a finished task's outcomes; return its jobs if it was lost."""
        # exception(), not a raising result(): a raised exception's traceback
        # would hold this frame, the future and (through f_back) a broken
        # pool, keeping its pipes and semaphores until the next collection.
        error = future.exception()
        if error is not None and self._is_lost(error):
            return nos
        if error is not None:
            fail_all(result, jobs, nos, error)
            return []
        blobs = future.result()
        for blob in blobs:
            result.bytes_received += len(blob)
            outcome: StreamOutcome = pickle.loads(blob)
            if outcome.error is not None and outcome.traceback:
                outcome.error.__cause__ = RemoteTraceback(outcome.traceback)
            result.outcomes[outcome.stream_id] = outcome
        return []
