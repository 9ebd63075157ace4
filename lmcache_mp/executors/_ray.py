"""Phases on Ray (``executor="ray"``, ``"ray://HOST:PORT"``, or a runtime
the caller has initialised).

The spec goes into Ray's object store once per phase (``ray.put``); each
task is a Ray task with ``max_retries=0``, so a worker or node that dies
fails its task instead of Ray running it again: the claims then say which
of its streams were running (:mod:`lmcache_mp.executors._remote`).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from concurrent.futures import Executor, Future
from typing import Any

from lmcache_mp._util.extras import import_extra
from lmcache_mp.executors._base import PhaseRun
from lmcache_mp.executors._remote import RemoteExecutor
from lmcache_mp.executors._worker import run_shard

__all__ = ["RayExecutor"]


def _ray_shard(payload: bytes, spec_blob: bytes) -> list[bytes]:
    """The task a Ray worker runs: :func:`run_shard`, claimed in the
    worker's node address so that a lost node is named."""
    ray = import_extra("ray", "ray")
    node = ray.get_runtime_context().get_node_id()[:12]
    where = f"{ray.util.get_node_ip_address()} node {node} (pid {os.getpid()})"
    return run_shard(payload, spec_blob, where)


class _RayTasks(Executor):
    """A ``concurrent.futures`` view of one remote function's Ray tasks."""

    def __init__(self, remote: Any) -> None:
        self._remote = remote
        self._refs: list[Any] = []
        self._lock = threading.Lock()

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Future[Any]:
        # Always the one remote function this view was made for.
        ref = self._remote.remote(*args, **kwargs)
        with self._lock:
            self._refs.append(ref)
        return ref.future()  # type: ignore[no-any-return]

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        ray = import_extra("ray", "ray")
        with self._lock:
            refs, self._refs = self._refs, []
        for ref in refs:
            # A finished task, or one on a lost node, cannot be cancelled.
            with contextlib.suppress(Exception):
                ray.cancel(ref, force=True)


class RayExecutor(RemoteExecutor):
    """Runs phases as Ray tasks.

    Args:
        address: ``None`` for the runtime already initialised in this
            process (or a new local one), or an address ``ray.init``
            takes (``"ray://HOST:PORT"``, ``"HOST:PORT"``, ``"auto"``).
        num_cpus: CPUs of a new local runtime (default: Ray's, every
            core); ignored when connecting to a cluster.

    A runtime this executor initialised is shut down by :meth:`close`.
    """

    name = "ray"

    def __init__(self, address: str | None = None, num_cpus: int | None = None) -> None:
        super().__init__()
        self._address = address
        self._num_cpus = num_cpus if address is None else None
        self._remote: Any = None
        self._owned = False

    def _ray(self) -> Any:
        ray = import_extra("ray", "ray")
        if self._remote is None:
            if not ray.is_initialized():
                ray.init(
                    address=self._address,
                    num_cpus=self._num_cpus,
                    include_dashboard=False,
                    log_to_driver=False,
                    logging_level="warning",
                )
                self._owned = True
            self._remote = ray.remote(num_cpus=1, max_retries=0)(_ray_shard)
        return ray

    def _worker_count(self) -> int:
        ray = sys.modules.get("ray")
        if ray is None or not ray.is_initialized():
            return 0
        # The CPUs of the nodes alive now: a lost node's are gone.
        return int(self._ray().cluster_resources().get("CPU", 0))

    def _executor(self, n_jobs: int, result: PhaseRun) -> Executor:
        self._ray()
        tasks = _RayTasks(self._remote)
        self._tasks = tasks
        return tasks

    def _share_spec(self, blob: bytes, digest: str) -> tuple[str, tuple[Any, ...]]:
        self._spec_ref = self._ray().put(blob)
        return "", (self._spec_ref,)

    def _is_lost(self, error: BaseException) -> bool:
        exceptions = import_extra("ray.exceptions", "ray")
        # A RayTaskError is the task's own exception (a bug, not a loss).
        return isinstance(error, exceptions.RayError) and not isinstance(
            error, exceptions.RayTaskError
        )

    def _disconnect(self) -> None:
        if self._owned:
            self._ray().shutdown()
            self._owned = False
        self._remote = None
