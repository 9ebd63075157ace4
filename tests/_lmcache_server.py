"""Upstream LMCache's multiprocess server (``lmcache==0.5.6``), run for real on
loopback, with a KV layout registered the way an engine (vLLM) would.

The server runs on the CPU (no GPU needed). The SDK's ``register_caches``
needs a layout some engine registered first (``REGISTER_KV_CACHE``); the
seed here does that from a short-lived process with CPU KV tensors, through
upstream's own worker transfer context, as vLLM's CPU worker would.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from typing import Any

import requests

from tests._redis_server import free_port

#: The seeded model's layout: 2 layers, 1 KV head, 16-token blocks, width 8.
MODEL = "tiny"
LAYERS, HEADS, BLOCK, HEAD_DIM = 2, 1, 16, 8
CHUNK = 16
#: The KV width lmcache_mp sees (``D`` of ``[2, L, T, D]``).
WIDTH = HEADS * HEAD_DIM

_SEED = textwrap.dedent(
    """
    import sys, torch, zmq
    from lmcache.v1.gpu_connector.utils import LayoutHints
    from lmcache.v1.multiprocess.transfer_context.worker_transfer import (
        create_transfer_context,
    )
    from lmcache.v1.multiprocess.transport.factory import RequestClientFactory

    url, model, layers, heads, block, dim = sys.argv[1:7]
    layers, heads, block, dim = int(layers), int(heads), int(block), int(dim)
    client = RequestClientFactory.create(url, context=zmq.Context())
    caches = {
        f"layer.{i}": torch.zeros((4, 2, heads, block, dim)) for i in range(layers)
    }
    ctx = create_transfer_context(
        caches, instance_id=7, req_client=client, mode="lmcache_driven"
    )
    hints = LayoutHints(
        kv_layout="HND", num_kv_heads=heads, tokens_per_block=block, head_dim=dim
    )
    ctx.register(caches, model, 1, 1, 30.0, layout_hints=hints)
    client.close()
    """
)


class LMCacheServer:
    """One ``lmcache.v1.multiprocess.http_server`` on free loopback ports."""

    def __init__(self) -> None:
        self.port = free_port()
        self.http_port = free_port()
        self.url = f"tcp://127.0.0.1:{self.port}"
        self.http_url = f"http://127.0.0.1:{self.http_port}"
        self._log = tempfile.NamedTemporaryFile(  # noqa: SIM115
            prefix="lmcache-server-", suffix=".log", delete=False
        )
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self, wait: float = 90.0) -> None:
        """Start the server, wait for its HTTP API, and seed the layout."""
        cmd = [
            sys.executable,
            "-m",
            "lmcache.v1.multiprocess.http_server",
            *("--host", "127.0.0.1", "--port", str(self.port)),
            *("--http-host", "127.0.0.1", "--http-port", str(self.http_port)),
            *("--chunk-size", str(CHUNK), "--l1-size-gb", "0.0625"),
            *("--eviction-policy", "LRU", "--supported-transfer-mode", "auto"),
            # Only a context's close may drop its registration in these tests.
            *("--worker-reap-timeout-seconds", "3600"),
            "--disable-observability",
        ]
        self._proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + wait
        while True:
            if self._proc.poll() is not None:
                raise RuntimeError(f"LMCache server exited:\n{self.log()}")
            try:
                requests.get(f"{self.http_url}/config", timeout=1).raise_for_status()
                break
            except requests.RequestException:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"LMCache server not up after {wait}s:\n{self.log()}"
                    ) from None
                time.sleep(0.2)
        seed = [str(v) for v in (self.url, MODEL, LAYERS, HEADS, BLOCK, HEAD_DIM)]
        done = subprocess.run(
            [sys.executable, "-c", _SEED, *seed],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if done.returncode or MODEL not in str(self.status()["cache_context_meta"]):
            raise RuntimeError(f"seeding the layout failed:\n{done.stderr[-3000:]}")

    def status(self) -> dict[str, Any]:
        """The server's ``/status``."""
        response = requests.get(f"{self.http_url}/status", timeout=10)
        response.raise_for_status()
        status: dict[str, Any] = response.json()
        return status

    def registered(self) -> set[int]:
        """Instance ids of the SDK (engine-driven) contexts registered now."""
        return set(self.status().get("registered_non_cuda_instance_ids", []))

    def log(self) -> str:
        """The server's output so far (its tail)."""
        with open(self._log.name, errors="replace") as f:
            return f.read()[-5000:]

    def stop(self) -> None:
        """Stop the server (its whole process group) and remove its log."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=15)
        if proc is not None:
            # Whatever it started in its group goes too.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        self._log.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._log.name)


@contextlib.contextmanager
def running() -> Iterator[LMCacheServer]:
    """A started, seeded server, stopped afterwards."""
    server = LMCacheServer()
    try:
        server.start()
        yield server
    finally:
        server.stop()
