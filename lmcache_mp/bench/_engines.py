"""The bench's distributed executors and stores: what ``--executors
dask,ray``, ``--scheduler`` and ``--store`` open for one run.

Without ``--scheduler``, ``dask`` starts a local cluster on 127.0.0.1 for
the run (one single-threaded worker process per worker), so that the
process pool, Dask and Ray are measured side by side in one command.
``ray`` starts a local runtime for the run (bound to loopback) unless
``--ray-address`` names a cluster or this process already has a runtime.
Starting either is reported as the run's pool start.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from lmcache_mp._util.extras import import_extra
from lmcache_mp.executors import physical_cores

__all__ = ["REMOTE_EXECUTORS", "executor_for", "fresh_store_url"]

#: Executor names the bench runs on a distributed engine.
REMOTE_EXECUTORS = ("dask", "ray")
#: Keeps a local Ray runtime on 127.0.0.1 (Ray binds to the machine's
#: routable address otherwise; read when ray is imported).
_RAY_LOOPBACK = ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


@contextlib.contextmanager
def executor_for(
    name: str,
    workers: int | None,
    scheduler: str | None,
    ray_address: str | None,
) -> Iterator[tuple[Any, float]]:
    """The ``executor=`` argument for one run, and seconds spent starting it.

    Args:
        name: The executor's name; names other than ``dask``/``ray`` are
            yielded as they are.
        workers: Workers of a local cluster or runtime (default: physical
            cores).
        scheduler: A Dask scheduler address, or ``None`` for a local one.
        ray_address: A Ray cluster address, or ``None`` for a local one.

    Yields:
        ``(executor, start_s)``.
    """
    n = workers or physical_cores()
    if name == "dask":
        with _dask(n, scheduler) as client:
            yield client
        return
    if name == "ray":
        with _ray(n, ray_address) as started:
            yield started
        return
    yield name, 0.0


@contextlib.contextmanager
def _dask(n: int, scheduler: str | None) -> Iterator[tuple[Any, float]]:
    distributed = import_extra("distributed", "dask")
    begin = time.perf_counter()
    cluster = None
    if scheduler is None:
        cluster = distributed.LocalCluster(
            n_workers=n,
            threads_per_worker=1,
            processes=True,
            host="127.0.0.1",
            dashboard_address=None,
        )
        address = cluster.scheduler_address
    else:
        address = scheduler.replace("dask://", "tcp://", 1)
    client = distributed.Client(address, set_as_default=False, timeout=60)
    try:
        if cluster is not None:
            client.wait_for_workers(n, timeout=60)
        yield client, time.perf_counter() - begin
    finally:
        client.close()
        if cluster is not None:
            cluster.close()


@contextlib.contextmanager
def _ray(n: int, address: str | None) -> Iterator[tuple[Any, float]]:
    if address is None:
        os.environ.setdefault(*_RAY_LOOPBACK)
    ray = import_extra("ray", "ray")
    if ray.is_initialized():
        # The caller's runtime (a notebook's, a test's): used as it is.
        yield "ray", 0.0
        return
    begin = time.perf_counter()
    ray.init(
        address=address,
        num_cpus=None if address else n,
        include_dashboard=False,
        log_to_driver=False,
        logging_level="warning",
    )
    try:
        warm = ray.remote(num_cpus=1)(_pid)
        ray.get([warm.remote() for _ in range(n)], timeout=120)
        yield "ray", time.perf_counter() - begin
    finally:
        ray.shutdown()


def _pid() -> int:
    return os.getpid()


def fresh_store_url(url: str) -> str:
    """``url`` with a fresh name for one run (the run destroys it after).

    ``redis://...?prefix=P`` gets ``prefix=P-<random>``; ``shm:///NAME``
    and ``file:///PATH`` get ``-<random>`` on their name.
    """
    token = secrets.token_hex(4)
    parts = urlsplit(url)
    if parts.scheme == "redis":
        query = dict(parse_qsl(parts.query))
        query["prefix"] = f"{query.get('prefix', 'lmcache-mp-bench')}-{token}"
        return urlunsplit(parts._replace(query=urlencode(query)))
    # shm:/// and file:/// URLs have no query; urlunsplit would drop "//".
    return f"{url.rstrip('/')}-{token}"
