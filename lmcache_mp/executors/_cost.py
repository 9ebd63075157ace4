"""``executor="auto"``'s cost model: threads or processes for a phase's
other streams, from one stream's measurement."""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["ROUND_TRIP_S", "THREAD_EFFICIENCY", "Choice", "weigh"]

#: Parent-side cost of one stream on the pool (task pickling, the result
#: queue, the outcome), a bound on what ``bench`` measures.
ROUND_TRIP_S = 1e-3
#: Share of the cores threads reach on CPU work that releases the GIL:
#: ``bench --compare`` finds threads running the redundancy and stride
#: edits little faster than one core (the GIL convoy on every store call),
#: where processes scale with the cores; see docs/benchmarks/.
THREAD_EFFICIENCY = 0.5


@dataclass(frozen=True)
class Choice:
    """The executor that runs a phase, and why.

    Args:
        executor: ``"thread"`` or ``"process"``.
        reason: One sentence for the report.
        threads_s: The cost model's estimate on threads (0: not weighed).
        processes_s: Its estimate on processes (0: not weighed).
    """

    executor: str
    reason: str
    threads_s: float = 0.0
    processes_s: float = 0.0


def weigh(
    seconds: float,
    held: float,
    rest: int,
    cores: int,
    start_s: float,
    cpu: float = 1.0,
) -> Choice:
    """Pick the cheaper executor for ``rest`` streams like the measured one.

    The GIL-held share is a share of the stream's *wall* time (what the
    watch measures): that much of every stream runs one at a time on
    threads, whatever the cores and whatever its CPU share (the holder may
    be waiting for a core on a busy machine: the GIL stays held), which
    estimates a fn that holds the GIL nearly all the time closely on both
    threads and processes. Of the rest, the
    CPU work runs on the cores at ``THREAD_EFFICIENCY``, and the waits
    (I/O, sleeps) overlap. Processes run whole streams on ``min(cores,
    rest)`` workers, in rounds, plus a round trip per stream and the pool
    start.

    Args:
        seconds: One stream's measured wall seconds on one core.
        held: Its GIL-held share of ``seconds``, in ``[0, 1]``.
        rest: Streams still to run.
        cores: Cores available.
        start_s: Seconds to start the pool first (0 when it runs or is
            paid for by the batch's other phases).
        cpu: Its CPU seconds over ``seconds`` (the rest it waited), in
            ``[0, 1]``.

    Returns:
        The choice, with the estimates in its reason.
    """
    k = max(1, min(cores, rest))
    held_s = seconds * held
    # CPU work done without the GIL (numpy, BLAS, the store's copies).
    free_cpu_s = min(seconds - held_s, max(0.0, seconds * cpu - held_s))
    threads = max(
        seconds,
        rest * held_s + rest * free_cpu_s / max(1.0, k * THREAD_EFFICIENCY),
    )
    processes = math.ceil(rest / k) * seconds + rest * ROUND_TRIP_S + start_s
    executor = "process" if processes < threads else "thread"
    return Choice(
        executor,
        f"a stream took {seconds * 1e3:.1f} ms ({cpu:.0%} CPU) holding the "
        f"GIL {held:.0%} of it: est. {threads * 1e3:.0f} ms on threads vs "
        f"{processes * 1e3:.0f} ms on processes for the other {rest}"
        + (f" (pool start {start_s:.2f} s)" if start_s else ""),
        threads,
        processes,
    )
