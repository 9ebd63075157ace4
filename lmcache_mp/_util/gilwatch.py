"""How much a block of code holds the GIL, and how long it waited for a core.

What ``executor="auto"`` measures of a modify stream to weigh threads
against processes; a leaf helper, so that a worker can
measure the stream it runs as well as the caller can.
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass
from types import TracebackType

__all__ = ["GilProbe", "GilWatch", "queued_s"]


@dataclass(frozen=True)
class GilProbe:
    """What a :class:`GilWatch` measured of a block: plain, picklable
    figures, so that a worker can send back the measurement of the stream
    it ran.

    Args:
        wall_s: Seconds the block took.
        cpu_s: CPU seconds the watched thread used in it.
        queued_s: Seconds it waited for a core, runnable (0 where the OS
            does not say).
        held: GIL-held share of ``wall_s``, in ``[0, 1]``.
    """

    wall_s: float
    cpu_s: float
    queued_s: float
    held: float

    @property
    def cpu(self) -> float:
        """CPU share of the wall time, in ``[0, 1]``; time queued for a
        core counts as CPU the block needed."""
        if self.wall_s <= 0.0:
            return 1.0
        return min(1.0, (self.cpu_s + self.queued_s) / self.wall_s)


def queued_s() -> float:
    """Seconds the calling thread has waited, runnable, for a core.

    Read from ``/proc/thread-self/schedstat`` (its second field, ns; Linux
    with schedstats); 0.0 where there is no such file, so that the callers'
    differences are 0.

    Returns:
        The thread's run-queue wait since it started.
    """
    try:
        with open("/proc/thread-self/schedstat", encoding="ascii") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


class GilWatch:
    """Measure how much a block of code holds the GIL.

    A watcher thread naps in a loop; each time it wakes it needs the GIL.
    While the watched thread runs bytecode, the watcher waits until the
    interpreter forces a switch (``sys.getswitchinterval()``, 5 ms); while
    it runs C code that released the GIL, the watcher gets it within the
    timer's slack. The time spent in waits of over half a switch
    interval, over the most it can be (a switch interval per nap), is the
    GIL-held share; bytecode run in bursts shorter than that counts as
    released.

    On a machine busy with other processes the watched thread also waits
    for a core (load 5 on 2 cores); where Linux reports that
    wait (``/proc/thread-self/schedstat``) it is ``queued_s``: CPU the
    block wanted but did not get, not a wait that threads would overlap.
    (The watcher's own core waits are not taken out of its delays: that
    takes out GIL handoffs too, and reads a pure-Python loop as partly
    released.)
    """

    _NAP_S = 1e-3

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._blocked = 0.0
        self._begin = 0.0
        self._cpu_begin = 0.0
        #: Seconds the block took (set on exit).
        self.wall_s = 0.0
        #: CPU seconds the watched thread used in it (set on exit).
        self.cpu_s = 0.0
        #: Seconds it waited for a core, runnable (set on exit; 0 where the
        #: OS does not say).
        self.queued_s = 0.0
        self._queued_begin = 0.0

    def _watch(self) -> None:
        while not self._stop.is_set():
            start = time.perf_counter()
            time.sleep(self._NAP_S)
            late = time.perf_counter() - start - self._NAP_S
            # Half a switch interval late: it waited for the GIL. Less is
            # the timer's slack or a busy core, not the watched thread.
            if late > sys.getswitchinterval() / 2:
                self._blocked += late

    @property
    def held(self) -> float:
        """GIL-held share in ``[0, 1]``."""
        if self.wall_s <= 0.0:
            return 0.0
        # Held throughout, the watcher waits a switch interval per nap.
        switch = sys.getswitchinterval()
        most = self.wall_s * switch / (switch + self._NAP_S)
        return min(1.0, self._blocked / most)

    def probe(self) -> GilProbe:
        """The figures of the block (once it has exited)."""
        return GilProbe(self.wall_s, self.cpu_s, self.queued_s, self.held)

    def __enter__(self) -> GilWatch:
        self._begin = time.perf_counter()
        self._cpu_begin = time.thread_time()
        self._queued_begin = queued_s()
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.wall_s = time.perf_counter() - self._begin
        self.cpu_s = time.thread_time() - self._cpu_begin
        self.queued_s = queued_s() - self._queued_begin
        self._stop.set()
        self._thread.join()
