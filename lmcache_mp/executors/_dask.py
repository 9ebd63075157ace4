"""Phases on a Dask distributed cluster (``executor=client`` or
``"dask://HOST:PORT"``).

The spec is scattered to every worker once per phase (``broadcast=True``);
tasks carry only stream states and go through the client's
``concurrent.futures`` view. Dask reschedules the tasks of a lost worker by
itself: the claims turn that retry into a typed failure of the streams the
worker was running (:mod:`lmcache_mp.executors._remote`).
"""

from __future__ import annotations

import os
from concurrent.futures import CancelledError, Executor, Future
from typing import Any

from lmcache_mp._util.extras import import_extra
from lmcache_mp.executors._base import PhaseRun
from lmcache_mp.executors._remote import RemoteExecutor
from lmcache_mp.executors._worker import run_shard

__all__ = ["DaskExecutor", "is_dask_client"]

#: Seconds to wait for the scheduler when connecting by address.
CONNECT_TIMEOUT_S = 30.0


def is_dask_client(obj: object) -> bool:
    """Whether ``obj`` is a ``distributed.Client`` (without importing Dask)."""
    module = type(obj).__module__ or ""
    return module.split(".")[0] == "distributed" and hasattr(obj, "scatter")


def _dask_shard(payload: bytes, spec_blob: bytes) -> list[bytes]:
    """The task a Dask worker runs: :func:`run_shard`, claimed in the
    worker's address so that a lost host is named."""
    distributed = import_extra("distributed", "dask")
    address = distributed.get_worker().address
    return run_shard(payload, spec_blob, f"{address} (pid {os.getpid()})")


class DaskExecutor(RemoteExecutor):
    """Runs phases as tasks of a Dask distributed cluster.

    Args:
        client: A ``distributed.Client`` the caller owns (left open by
            :meth:`close`), or a scheduler address (``"dask://HOST:PORT"``,
            ``"tcp://HOST:PORT"``) to connect to at the first phase.

    Raises:
        ValueError: For an address that is not ``dask://`` or ``tcp://``.
    """

    name = "dask"

    def __init__(self, client: Any) -> None:
        super().__init__()
        self._client: Any = None
        self._address = ""
        if isinstance(client, str):
            scheme, sep, rest = client.partition("://")
            if not sep or scheme not in ("dask", "tcp") or not rest:
                raise ValueError(
                    f"bad Dask scheduler address {client!r}: expected dask://HOST:PORT"
                )
            self._address = f"tcp://{rest}"
        else:
            self._client = client
        self._owned = self._client is None

    @property
    def client(self) -> Any:
        """The ``distributed.Client`` (connecting to the address if needed).

        Raises:
            OSError: If the scheduler cannot be reached in time.
        """
        if self._client is None:
            distributed = import_extra("distributed", "dask")
            self._client = distributed.Client(
                self._address, timeout=CONNECT_TIMEOUT_S, set_as_default=False
            )
        return self._client

    def _worker_count(self) -> int:
        if self._client is None and self._owned:
            return 0
        return sum(self.client.nthreads().values())

    def _executor(self, n_jobs: int, result: PhaseRun) -> Executor:
        tasks: Executor = self.client.get_executor(pure=False)
        self._tasks = tasks
        return tasks

    def _share_spec(self, blob: bytes, digest: str) -> tuple[str, tuple[Any, ...]]:
        self._spec_ref = self.client.scatter(blob, broadcast=True, hash=False)
        return "", (self._spec_ref,)

    def _submit(
        self, executor: Executor, payload: bytes, extra: tuple[Any, ...]
    ) -> Future[list[bytes]]:
        return executor.submit(_dask_shard, payload, *extra)

    def _is_lost(self, error: BaseException) -> bool:
        distributed = import_extra("distributed", "dask")
        return isinstance(error, distributed.KilledWorker | CancelledError)

    def _disconnect(self) -> None:
        if self._owned and self._client is not None:
            self._client.close()
            self._client = None
