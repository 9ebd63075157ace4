"""Helpers for tests that run a batch in a child interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterable
from pathlib import Path

import psutil


def prefilled_batch_script(pidfile: Path, then: str = "") -> str:
    """Python source that prefills a 4-stream process batch (2 workers),
    writes the worker pids to ``pidfile``, prints "ready", then runs ``then``
    (which may use ``batch``)."""
    return textwrap.dedent(
        f"""
        import sys, time
        sys.path.insert(0, {os.getcwd()!r})
        import lmcache_mp.batch as lmc_batch, lmcache_mp.stream as lmc_stream
        from lmcache_mp.kv import connect
        from tests._fakes import FakeEngine
        ctx = connect(chunk_size=4)
        batch = lmc_batch.LMCacheBatchedStream("process", max_workers=2)
        for i in range(4):
            batch.add(lmc_stream.create_request(ctx, FakeEngine(ctx), list(range(i, i + 8))))
        batch.prefill({{}})
        open({str(pidfile)!r}, "w").write(" ".join(map(str, batch.executor.pids())))
        print("ready", flush=True)
        """
    ) + textwrap.dedent(then)


def all_gone(pids: Iterable[int], timeout: float = 10.0) -> bool:
    """Wait up to ``timeout`` seconds for every pid to exit; return whether they did."""
    pids = list(pids)
    deadline = time.monotonic() + timeout
    while any(psutil.pid_exists(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(psutil.pid_exists(p) for p in pids)


def run_python(script: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    """Run ``script`` in a fresh interpreter (this one's executable) and
    return it finished, with its stdout and stderr as text; bounded by
    ``timeout`` seconds (``subprocess.TimeoutExpired`` past it)."""
    return subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout
    )
