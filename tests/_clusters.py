"""Real Dask and Ray clusters on this machine, for the scale-out tests.

Dask: a scheduler on 127.0.0.1 and one ``dask worker`` per "host", each
bound to its own loopback address (127.0.0.2, .3, .4) in its own session,
so that killing a host kills all its processes. Ray: a head node and one
single-CPU Ray node per "host", each its own raylet and workers, started
with Ray's own ``ray.cluster_utils.Cluster`` (what Ray's multi-node tests
use), all on 127.0.0.1; killing a host kills its raylet and every worker.

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
#: address (read in ray._private.services.get_node_ip_address, when ray is
#: imported). ``ray start`` then refuses several nodes, but
#: ``ray.cluster_utils.Cluster`` starts them.
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


class RayHosts:
    """A Ray head node (no CPUs: tasks run on the hosts) and ``hosts``
    single-CPU nodes on 127.0.0.1, with this process connected as driver.

    Args:
        hosts: How many worker "hosts" (Ray nodes).

    ``ray`` must be imported after :data:`RAY_LOOPBACK_ENV` is set.
    """

    def __init__(self, hosts: int = 2) -> None:
        os.environ.update(RAY_LOOPBACK_ENV)
        # Ray workers inherit the driver's environment: the tests' fns
        # import by name there, as on Dask's hosts.
        os.environ["PYTHONPATH"] = worker_env()["PYTHONPATH"]
        import ray
        from ray.cluster_utils import Cluster

        self._ray = ray
        self.nodes: list[Any] = []
        self._pids: set[int] = set()
        self._cluster = self._own(
            lambda: Cluster(
                initialize_head=True,
                head_node_args={
                    "num_cpus": 0,
                    "include_dashboard": False,
                    # The GCS declares a silent node dead after 3 missed 1 s
                    # checks (Ray's default: about 30 s), so that a lost
                    # host's tasks fail within a test's time.
                    "_system_config": {
                        "health_check_period_ms": 1000,
                        "health_check_timeout_ms": 1000,
                        "health_check_failure_threshold": 3,
                    },
                },
            )
        )
        try:
            for _ in range(hosts):
                self.add_host()
            ray.init(
                address=self._cluster.address,
                log_to_driver=False,
                logging_level="warning",
            )
        except BaseException:
            self.close()
            raise

    def _own(self, start: Any) -> Any:
        # The processes ``start`` spawns are cluster processes to the leak
        # check (the raylet's workers are its descendants).
        before = {p.pid for p in psutil.Process().children()}
        started = start()
        self._pids |= {p.pid for p in psutil.Process().children()} - before
        CLUSTER_ROOTS.update(self._pids)
        return started

    def add_host(self) -> Any:
        """Start a single-CPU Ray node; returns it once the cluster sees it."""
        node = self._own(lambda: self._cluster.add_node(num_cpus=1, wait=True))
        self.nodes.append(node)
        return node

    @staticmethod
    def node_id(node: Any) -> str:
        """The node's Ray id (what ``get_runtime_context().get_node_id()``
        gives in its workers)."""
        return str(node.node_id)

    def kill_host(self, node: Any) -> None:
        """SIGKILL the node's raylet and every process under it, then let
        Ray reap the node's other processes."""
        from ray._private import ray_constants

        raylet = psutil.Process(
            node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid
        )
        doomed = [*raylet.children(recursive=True), raylet]
        for proc in doomed:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        psutil.wait_procs(doomed, timeout=30)
        self.nodes.remove(node)
        self._cluster.remove_node(node, allow_graceful=False)

    def close(self) -> None:
        """Disconnect the driver and stop every node; safe to call twice."""
        self._ray.shutdown()
        self._cluster.shutdown()
        self.nodes.clear()
        CLUSTER_ROOTS.difference_update(self._pids)


def descendants_of_clusters() -> set[int]:
    """Pids of the running clusters' processes and all their children."""
    found = set()
    for pid in list(CLUSTER_ROOTS):
        with contextlib.suppress(psutil.Error):
            root = psutil.Process(pid)
            found.add(pid)
            found.update(p.pid for p in root.children(recursive=True))
    return found
