"""Whether a process still runs: its pid and start time, which a reused
pid does not share."""

from __future__ import annotations

import psutil

__all__ = ["process_started", "same_process"]

# Hundredths of a second a wall-clock start time may drift as read (where
# there is no /proc to give the clock ticks since boot).
_START_SLACK = 200


def same_process(pid: int, started: int) -> bool:
    """Whether process ``pid`` runs and started at ``started``.

    A reused pid starts later. On Linux the start time is the kernel's
    clock ticks since boot, which no clock step moves; elsewhere it is wall
    clock time, compared with some slack.
    """
    now = process_started(pid)
    return now is not None and abs(now - started) <= _START_SLACK


def process_started(pid: int) -> int | None:
    """The start time of process ``pid`` as :attr:`PinOwner.started` holds
    it, or ``None`` when there is no such process.

    On Linux, ``starttime`` of ``/proc/PID/stat``: clock ticks from boot to
    the process's start. psutil's ``create_time`` adds the boot time, which
    moves with every step of the wall clock: a pin read after a step of
    more than the slack would make a live batch's pin look orphaned, and
    drop it.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            line = stat.read()
    except FileNotFoundError:
        return None
    except OSError:
        line = b""
    if line:
        # The command name may hold spaces and parentheses: fields start
        # after its last ')'; starttime is field 22, the 20th after it.
        return int(line[line.rindex(b")") + 2 :].split()[19])
    try:
        return round(psutil.Process(pid).create_time() * 100)
    except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
        return None
