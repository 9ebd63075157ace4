"""Real Dask and Ray clusters on this machine, for the scale-out tests.

Dask: a scheduler on 127.0.0.1 and one ``dask worker`` per "host", each
bound to its own loopback address (127.0.0.2, .3, .4) in its own session,
so that killing a host kills all its processes. Ray: a local runtime bound
to 127.0.0.1 (Ray's multi-node mode binds every node to the machine's
routable address, never loopback, so the several-hosts tests use Dask;
Ray's loss test kills a Ray worker process).

Every process is started here, waited for with a deadline, and stopped by
``close`` (terminate, then kill); the test's leak check ignores only the
processes these clusters own while they run.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

import psutil

#: Pids whose descendants the leak check ignores (running clusters' own).
CLUSTER_ROOTS: set[int] = set()

_BIN = os.path.dirname(sys.executable)
_START_TIMEOUT_S = 60.0
#: Keeps Ray on 127.0.0.1: by default it binds to the machine's routable
#: address (read in ray._private.services.get_node_ip_address).
RAY_LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def _stop(proc: subprocess.Popen[bytes], timeout: float = 15.0) -> None:
    """Terminate a process group, then kill it if it lingers."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout)
            return
        except subprocess.TimeoutExpired:
            continue


def worker_env() -> dict[str, str]:
    """This environment, with the repository on ``PYTHONPATH`` so that
    workers import the tests' modify fns by name, as a user's workers
    import the user's modules."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, path]))}


def _spawn(args: list[str], log: str) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            args,
            env=worker_env(),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    CLUSTER_ROOTS.add(proc.pid)
    return proc


class DaskHosts:
    """A Dask scheduler and ``hosts`` single-threaded workers, one per
    loopback address.

    Args:
        hosts: How many worker "hosts".
    """

    def __init__(self, hosts: int = 3) -> None:
        self.dir = tempfile.mkdtemp(prefix="dask-hosts-")
        self.scheduler_file = os.path.join(self.dir, "scheduler.json")
        self.workers: dict[str, subprocess.Popen[bytes]] = {}
        self._scheduler = _spawn(
            [
                os.path.join(_BIN, "dask"),
                "scheduler",
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--no-dashboard",
                "--scheduler-file",
                self.scheduler_file,
            ],
            os.path.join(self.dir, "scheduler.log"),
        )
        try:
            self.address = self._wait_for_scheduler()
            for n in range(hosts):
                self.add_host(f"127.0.0.{n + 2}")
            self.wait_for_workers(hosts)
        except BaseException:
            self.close()
            raise

    def _wait_for_scheduler(self) -> str:
        deadline = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline:
            with (
                contextlib.suppress(OSError, ValueError),
                open(self.scheduler_file) as f,
            ):
                return str(json.load(f)["address"])
            if self._scheduler.poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError(f"the Dask scheduler did not start; see {self.dir}")

    def add_host(self, ip: str) -> None:
        """Start a worker bound to ``ip``."""
        self.workers[ip] = _spawn(
            [
                os.path.join(_BIN, "dask"),
                "worker",
                self.address,
                "--host",
                ip,
                "--nthreads",
                "1",
                "--no-nanny",
                "--no-dashboard",
                "--memory-limit",
                "0",
                "--death-timeout",
                "60",
                "--local-directory",
                self.dir,
            ],
            os.path.join(self.dir, f"worker-{ip}.log"),
        )

    def client(self) -> Any:
        """A new ``distributed.Client`` on the scheduler."""
        import distributed

        return distributed.Client(
            self.address, timeout=_START_TIMEOUT_S, set_as_default=False
        )

    def wait_for_workers(self, n: int) -> None:
        """Wait (bounded) until ``n`` workers are connected."""
        with self.client() as client:
            client.wait_for_workers(n, timeout=_START_TIMEOUT_S)

    def kill_host(self, ip: str) -> None:
        """SIGKILL every process of host ``ip`` and wait for them."""
        proc = self.workers.pop(ip)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
        CLUSTER_ROOTS.discard(proc.pid)

    def close(self) -> None:
        """Stop every worker and the scheduler; safe to call twice."""
        for proc in [*self.workers.values(), self._scheduler]:
            _stop(proc)
            CLUSTER_ROOTS.discard(proc.pid)
        self.workers.clear()
        shutil.rmtree(self.dir, ignore_errors=True)


def descendants_of_clusters() -> set[int]:
    """Pids of the running clusters' processes and all their children."""
    found = set()
    for pid in list(CLUSTER_ROOTS):
        with contextlib.suppress(psutil.Error):
            root = psutil.Process(pid)
            found.add(pid)
            found.update(p.pid for p in root.children(recursive=True))
    return found
