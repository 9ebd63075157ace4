"""The shared-memory store's pins and eviction marks, as files in its
directory (issue #20).

A pin is ``.pin-<pid>-<started>-<batch>-<stream digest>``: the names of the
chunks one stream of one batch depends on, a line each, replaced
atomically. A pin whose process is gone (or whose pid now belongs to a
process started at another time) is removed by the next scan, so a batch
killed by SIGKILL does not keep its KV pinned. An eviction leaves
``.gone-<chunk name>``, empty, until the chunk is stored again: how a
retrieve tells KV that was evicted (fail at once) from KV not stored yet
(worth waiting for). Marks beyond :data:`_MAX_MARKS` are pruned, oldest
first.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable

from lmcache_mp.kv._files import open_temp, scan_dir
from lmcache_mp.kv._pins import PinOwner, same_process

__all__ = [
    "clear_evicted",
    "is_evicted",
    "live_pins",
    "mark_evicted",
    "remove_pins",
    "write_pin",
]

_PIN = ".pin-"
_GONE = ".gone-"
# Eviction marks kept at most; the oldest go first (inodes cost memory).
_MAX_MARKS = 65536


def write_pin(
    dir_fd: int, owner: PinOwner, stream_id: str, names: Iterable[str], add: bool
) -> None:
    """Pin ``names`` (chunk file names) for one stream of ``owner``.

    Args:
        dir_fd: The store directory.
        owner: The batch.
        stream_id: The stream.
        names: Its chunks.
        add: Keep the chunks already pinned for it too; else replace them.
    """
    pin = _PIN + owner.tag(stream_id)
    wanted = set(names)
    if add:
        wanted |= _read(dir_fd, pin)
    if not wanted:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(pin, dir_fd=dir_fd)
        return
    tmp, fd = open_temp(dir_fd)
    try:
        with os.fdopen(fd, "w", closefd=False) as fh:
            fh.write("\n".join(sorted(wanted)))
    finally:
        os.close(fd)
    os.replace(tmp, pin, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)


def remove_pins(dir_fd: int, owner: PinOwner, stream_id: str | None = None) -> None:
    """Release the pins of one stream of ``owner``, or all of its pins."""
    if stream_id is not None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(_PIN + owner.tag(stream_id), dir_fd=dir_fd)
        return
    prefix = f"{_PIN}{owner.tag()}-"
    with scan_dir(dir_fd) as entries:
        names = [e.name for e in entries if e.name.startswith(prefix)]
    for name in names:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=dir_fd)


def live_pins(dir_fd: int) -> set[str]:
    """The chunk names pinned by live batches; remove dead batches' pins."""
    pinned: set[str] = set()
    alive: dict[tuple[int, int], bool] = {}
    with scan_dir(dir_fd) as entries:
        pins = [e.name for e in entries if e.name.startswith(_PIN)]
    for pin in pins:
        owner = _owner_of(pin)
        if owner is not None and owner not in alive:
            alive[owner] = same_process(*owner)
        if owner is None or not alive[owner]:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(pin, dir_fd=dir_fd)
            continue
        pinned |= _read(dir_fd, pin)
    return pinned


def _owner_of(pin: str) -> tuple[int, int] | None:
    """``(pid, started)`` from a pin's name, or ``None`` if malformed."""
    parts = pin[len(_PIN) :].split("-")
    if len(parts) != 4 or not (parts[0].isdigit() and parts[1].isdigit()):
        return None
    return int(parts[0]), int(parts[1])


def _read(dir_fd: int, pin: str) -> set[str]:
    try:
        fd = os.open(pin, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        return set()
    with os.fdopen(fd, "r") as fh:
        return set(fh.read().split())


def mark_evicted(dir_fd: int, names: Iterable[str]) -> None:
    """Record that chunks were evicted; prune the oldest marks past the cap."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    for name in names:
        os.close(os.open(_GONE + name, flags, 0o600, dir_fd=dir_fd))
    with scan_dir(dir_fd) as entries:
        marks = [e for e in entries if e.name.startswith(_GONE)]
        if len(marks) <= _MAX_MARKS:
            return
        oldest = sorted(marks, key=_mtime)[: len(marks) - _MAX_MARKS // 2]
    for entry in oldest:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(entry.name, dir_fd=dir_fd)


def _mtime(entry: os.DirEntry[str]) -> int:
    try:
        return entry.stat(follow_symlinks=False).st_mtime_ns
    except FileNotFoundError:
        return 0


def clear_evicted(dir_fd: int, name: str) -> None:
    """Forget that chunk ``name`` was evicted (it is being stored again)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(_GONE + name, dir_fd=dir_fd)


def is_evicted(dir_fd: int, name: str) -> bool:
    """Whether chunk ``name`` was evicted and not stored since."""
    try:
        os.stat(_GONE + name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True
