"""Where lmcache_mp keeps its private files."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from lmcache_mp._util import tracker
from lmcache_mp._util.proc import process_started

__all__ = ["atomic_write_text", "private_tempdir", "remove_tree", "shm_root"]


def shm_root() -> str:
    """Return ``/dev/shm`` where it is a writable directory, else the temp dir.

    Files in ``/dev/shm`` live in RAM and every process on the machine can
    map them, which is what makes the KV store zero-copy across processes.
    """
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK | os.X_OK):
        return "/dev/shm"
    return tempfile.gettempdir()


def private_tempdir(prefix: str) -> str:
    """Create a fresh directory only the current user can access (0700),
    removed when this process dies unless :func:`remove_tree` removes it
    first (:mod:`lmcache_mp._util.tracker`).

    Args:
        prefix: Start of the directory's name; it should contain
            ``"lmcache"`` so that leak checks can find it.

    Returns:
        The directory's path.
    """
    # mkdtemp creates the directory with mode 0700 atomically; the tracker
    # removes it should this process die before remove_tree does.
    # The owner's pid and start time follow the prefix, so that a reaper
    # can tell a dead owner's directory from a live one's.
    pid = os.getpid()
    owner = f"{pid}-{process_started(pid) or 0}-"
    path = tempfile.mkdtemp(prefix=prefix + owner, dir=shm_root())
    tracker.register(path)
    return path


def remove_tree(path: str | None) -> None:
    """Remove a directory tree; a missing one is fine (safe to call twice)."""
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)
        tracker.unregister(path)


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` to ``path`` so that readers see the old or new file only.

    The file is created with mode 0600 (``mkstemp``'s), like the rest of
    the files this package writes.
    """
    target = Path(path)
    fd, tmp = tempfile.mkstemp(
        dir=target.parent, prefix=f".{target.name}.", suffix=".tmp"
    )
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
