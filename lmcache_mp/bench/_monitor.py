"""The benchmark's peak-memory monitor."""

from __future__ import annotations

import os
import threading
from types import TracebackType

import psutil

from lmcache_mp._util.paths import shm_root

__all__ = ["PeakMemory"]

#: Seconds between two memory samples.
_SAMPLE_INTERVAL = 0.02
#: Samples between two scans for child processes: listing children walks
#: all of /proc, reading one process's RSS is a single small read.
_RESCAN_EVERY = 50


def _shmem_kib(pid: int) -> int:
    """The ``RssShmem`` of a process (KiB); 0 where the kernel has none."""
    try:
        with open(f"/proc/{pid}/status", "rb") as status:
            for line in status:
                if line.startswith(b"RssShmem:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _shm_used() -> int:
    """Bytes in use on the shared-memory filesystem the KV store lives on."""
    try:
        st = os.statvfs(shm_root())
    except OSError:
        return 0
    return (st.f_blocks - st.f_bfree) * st.f_frsize


class PeakMemory:
    """Peak resident memory of this process plus all its descendants.

    A daemon thread sums the RSS of the process and of every descendant
    (worker processes, multiprocessing helpers) every ~20 ms, and keeps the
    largest sum since the last :meth:`reset`. Shared-memory pages (the KV
    store's chunk files, which every process with a store arena keeps
    mapped: :mod:`lmcache_mp.kv._arena`) are counted once, not once per
    process: their sum over the processes, capped at what the
    shared-memory filesystem holds. Other shared pages (copy-on-write
    pages, libraries) are counted once per process, so this is an upper
    bound.
    """

    def __init__(self) -> None:
        self._me = psutil.Process(os.getpid())
        self._procs: list[psutil.Process] = []
        self._peak = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._loop, name="lmcache-mp-bench-memory", daemon=True
        )

    def __enter__(self) -> PeakMemory:
        self._rescan()
        self.sample()
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)

    def _rescan(self) -> None:
        try:
            children = self._me.children(recursive=True)
        except psutil.Error:
            children = []
        self._procs = [self._me, *children]

    def sample(self) -> int:
        """Take one sample now and return it (bytes).

        Returns:
            The summed RSS of the process and its known descendants, their
            shared-memory pages counted once.
        """
        total = shared = 0
        for proc in self._procs:
            try:
                rss = proc.memory_info().rss
            except psutil.Error:
                # A worker that exited between the scan and the read.
                continue
            shmem = min(rss, _shmem_kib(proc.pid) << 10)
            total += rss - shmem
            shared += shmem
        if shared:
            total += min(shared, _shm_used())
        with self._lock:
            self._peak = max(self._peak, total)
        return total

    def _loop(self) -> None:
        count = 0
        while not self._stop.wait(_SAMPLE_INTERVAL):
            count += 1
            if count % _RESCAN_EVERY == 0:
                self._rescan()
            self.sample()

    def reset(self) -> int:
        """Rescan the descendants, restart the peak from a fresh sample.

        Returns:
            The peak (bytes) since the previous reset, including the
            fresh sample (so a phase's peak covers its last moment).
        """
        self._rescan()
        last = self.sample()
        with self._lock:
            peak, self._peak = self._peak, last
        return peak
