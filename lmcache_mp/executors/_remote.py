"""What the Dask and Ray executors share: an engine that owns the workers.

Data flow of one phase (the process pool's, with the engine's transport)::

    parent (batch thread)                       engine worker (any host)
    ---------------------                       ------------------------
    PhaseSpec: fn, contexts, engines
      | cloudpickle, once per phase
      v
    Dask scatter(broadcast) / Ray put  .......> run_shard(ShardTask, spec)
    StreamJobs (states only)                      | loads the spec once per digest
      | pickle, a few jobs per ShardTask          | claims each job (the store's
      +---- engine task ---------------------->   |   Redis, or files on one host)
                                                  | KV: store <-> worker directly
    StreamOutcomes (state+figures | error) <----  + one pickled outcome per job
      | engine result
      v
    the batch commits each successful stream

The engine schedules, ships and retries; lmcache_mp adds only the claims
(:mod:`lmcache_mp.executors._claims`). A task lost with its worker is not a
broken pool here: the engine keeps running on the workers that remain. Its
claimed streams fail, naming the lost worker; its other streams run again.
"""

from __future__ import annotations

import abc
from concurrent.futures import Executor
from typing import Any

from lmcache_mp._core.phase import PhaseSpec, StreamJob, StreamOutcome
from lmcache_mp._util.paths import remove_tree
from lmcache_mp.errors import TerminatedWorkerError
from lmcache_mp.executors._base import PhaseRun
from lmcache_mp.executors._claims import Claims, FileClaims, RedisClaims
from lmcache_mp.executors._dispatch import ShardExecutor
from lmcache_mp.kv import RedisKVStore

__all__ = ["RemoteExecutor"]


class RemoteExecutor(ShardExecutor):
    """A phase executor over a distributed engine's workers.

    Subclasses connect to the engine, share the spec through it, submit
    tasks and say which task errors mean a lost worker.
    """

    def __init__(self) -> None:
        super().__init__()
        self._spec_ref: Any = None
        # The phase's concurrent.futures view of the engine's tasks; its
        # shutdown(wait=False) cancels what is queued or running.
        self._tasks: Executor | None = None

    @abc.abstractmethod
    def _worker_count(self) -> int:
        """Tasks the engine runs at once now (its workers' threads/CPUs)."""

    @property
    def workers(self) -> int:
        """Tasks the engine can run at once (0 before it is connected)."""
        return self._worker_count()

    def _spec_copies(self) -> int:
        # The engine sends the spec to every worker (Dask's broadcast, Ray's
        # object transfer), once per phase.
        return max(1, self.workers)

    def _unshare_spec(self, path: str) -> None:
        """Drop the engine's reference to the spec; it frees the copies."""
        self._spec_ref = None

    def _make_claims(self, spec: PhaseSpec) -> Claims:
        """Claims in the phase's Redis store when it has one: every host
        reaches it. Otherwise files: a shared-memory store only works for
        workers on this machine anyway."""
        for ctx in spec.contexts:
            if isinstance(ctx, RedisKVStore):
                return RedisClaims.create(ctx)
        return FileClaims.create(self._private_dir())

    def _after_break(
        self, jobs: list[StreamJob], lost: list[int], claims: Claims, result: PhaseRun
    ) -> list[int]:
        """Fail the streams the lost worker held; run the others again."""
        owners = claims.owners()
        retry = []
        for no in lost:
            owner = owners.get(no)
            if owner is None:
                retry.append(no)
                continue
            sid = jobs[no].stream_id
            error = TerminatedWorkerError(
                f"stream {sid}: {self.name} worker {owner} was lost while running "
                "it (the worker process or its host died). The stream keeps "
                "its previous state."
            )
            result.outcomes[sid] = StreamOutcome(sid, error=error)
        return retry

    def _abort(self) -> None:
        tasks, self._tasks = self._tasks, None
        if tasks is not None:
            tasks.shutdown(wait=False)

    def _on_timeout(self) -> None:
        self._abort()

    @abc.abstractmethod
    def _disconnect(self) -> None:
        """Release the engine connection if this executor opened it."""

    def close(self) -> None:
        """Remove the phase files; disconnect from an engine this executor
        connected to (a caller's client or runtime is left running)."""
        self._abort()
        self._disconnect()
        remove_tree(self._dir)
        self._dir = None
