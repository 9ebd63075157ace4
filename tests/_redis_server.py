"""A real ``redis-server`` for the tests: on a free local port, stopped after.

Each server runs with a password, a ``maxmemory`` and the allkeys-lru
policy the Redis store expects, saves nothing (``--save ""``, no AOF) and
keeps its working files in a temporary directory removed at stop.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import redis

#: Seconds a server may take to answer after it is started.
START_TIMEOUT_S = 10.0
#: Seconds it may take to exit once asked to.
STOP_TIMEOUT_S = 10.0
PASSWORD = "test-secret-pw"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (just now)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class RedisServer:
    """A ``redis-server`` child process (see :func:`running`).

    Args:
        maxmemory: Its ``--maxmemory`` (e.g. ``"64mb"``).
        policy: Its ``--maxmemory-policy``.
        password: Its ``--requirepass``.
    """

    def __init__(
        self,
        maxmemory: str = "64mb",
        policy: str = "allkeys-lru",
        password: str = PASSWORD,
    ) -> None:
        self.maxmemory = maxmemory
        self.policy = policy
        self.password = password
        self.port = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir: str | None = None

    def start(self) -> None:
        """Start the server and wait (bounded) until it answers PING.

        Raises:
            RuntimeError: If it exits or does not answer in time.
        """
        self._dir = tempfile.mkdtemp(prefix="redis-test-")
        self.port = free_port()
        options = {
            "bind": "127.0.0.1",
            "port": str(self.port),
            "requirepass": self.password,
            "maxmemory": self.maxmemory,
            "maxmemory-policy": self.policy,
            "save": "",
            "appendonly": "no",
            "dir": self._dir,
            "daemonize": "no",
            # A file, not a pipe nobody reads (a full pipe would block it).
            "logfile": os.path.join(self._dir, "redis.log"),
        }
        argv = ["redis-server"]
        for name, value in options.items():
            argv += [f"--{name}", value]
        self._proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                log = self._log()
                self.stop()
                raise RuntimeError(f"redis-server exited: {log}")
            with contextlib.suppress(redis.ConnectionError):
                if self.client().ping():
                    return
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server did not answer in {START_TIMEOUT_S} s")

    def _log(self) -> str:
        assert self._dir is not None
        with (
            contextlib.suppress(OSError),
            open(os.path.join(self._dir, "redis.log")) as fh,
        ):
            return fh.read()[-2000:]
        return "(no log)"

    def stop(self) -> None:
        """Terminate the server (kill it if it lingers); safe to call twice."""
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=STOP_TIMEOUT_S)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def url(self, prefix: str, password: str | None = None, **query: Any) -> str:
        """A ``redis://`` URL of this server (its password unless given)."""
        secret = self.password if password is None else password
        extra = "".join(f"&{name}={value}" for name, value in query.items())
        return f"redis://:{secret}@127.0.0.1:{self.port}/0?prefix={prefix}{extra}"

    def client(self) -> redis.Redis:
        """A plain client (the tests' own view of the server), 5 s timeouts."""
        return redis.Redis(
            port=self.port,
            password=self.password,
            socket_timeout=5,
            socket_connect_timeout=5,
        )

    def check_clean(self, prefix: str) -> None:
        """Assert that no key is left (the test's store destroyed, nothing
        outside its prefix), that the config and ACL are as started; then
        wipe the server so that one failure does not fail the next tests.

        Raises:
            AssertionError: Naming what was left.
        """
        client = self.client()
        keys = sorted(client.keys("*"))
        mine = [k for k in keys if k.startswith(prefix.encode())]
        others = [k for k in keys if not k.startswith(prefix.encode())]
        config = client.config_get("maxmemory*")
        users = client.acl_users()
        client.flushall()
        assert not others, f"keys outside the test's prefix {prefix}: {others[:10]}"
        assert not mine, f"store {prefix} not destroyed; keys left: {mine[:10]}"
        assert (config["maxmemory-policy"], users) == (self.policy, ["default"]), (
            f"server config or users changed: {config}, {users}"
        )


@contextlib.contextmanager
def running(**options: Any) -> Iterator[RedisServer]:
    """A started :class:`RedisServer` (``options`` as its arguments), stopped
    when the block ends, whatever happened in it."""
    server = RedisServer(**options)
    server.start()
    try:
        yield server
    finally:
        server.stop()
