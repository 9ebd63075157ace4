"""Removal of an owner's temporary directories when the owner dies.

A process that dies by SIGKILL, the OOM killer or ``os._exit`` runs no
``atexit`` hook and no finalizer, so a temporary store or a pool's spec
directory it created would stay in ``/dev/shm`` for good. CPython solves
the same problem for ``multiprocessing.shared_memory`` segments and named
semaphores with ``multiprocessing.resource_tracker``: a process that
outlives its owner and unlinks what the owner registered once the owner's
end of a pipe closes. This is that design, for directories::

    owner process                            tracker (python -I -S this file)
    register(path)   -- "ADD <hex path>" -->  paths.add(path)
    unregister(path) -- "DEL <hex path>" -->  paths.discard(path)
    dies, by any cause: the pipe closes -->  EOF: remove every path left

The tracker is detached (its own session, reparented away from the owner,
SIGINT and SIGTERM ignored), so that the signal that kills the owner or
its process group does not kill it first. A forked child does not inherit
its parent's tracker: what it registers goes to a tracker of its own, and
the parent's registrations stay the parent's. The file runs as a script
with the standard library only, so starting a tracker imports nothing of
lmcache_mp.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading

__all__ = ["register", "tracked", "unregister"]

_lock = threading.Lock()
#: The process whose tracker ``_fd`` writes to (``None``: none started).
_pid: int | None = None
#: The write end of the pipe to this process's tracker.
_fd: int | None = None
#: What this process registered, to register again with a new tracker
#: should its tracker have died.
_paths: set[str] = set()


def register(path: str) -> None:
    """Have ``path`` (a directory tree) removed when this process dies,
    whatever the cause, unless :func:`unregister` is called first.

    Args:
        path: An absolute path; it need not exist yet.
    """
    with _lock:
        _paths.add(path)
        _send(f"ADD {_hex(path)}\n")


def unregister(path: str) -> None:
    """Stop tracking ``path`` (once the owner removed it, or keeps it on
    purpose); safe to call for a path never registered, or twice."""
    with _lock:
        if path in _paths:
            _paths.discard(path)
            _send(f"DEL {_hex(path)}\n")


def tracked() -> frozenset[str]:
    """The paths this process has registered and not unregistered."""
    with _lock:
        return frozenset(_paths)


def _hex(path: str) -> str:
    # Hex keeps any byte of a path (a newline included) on one line.
    return os.fsencode(path).hex()


def _send(line: str) -> None:
    global _fd
    for _ in range(2):
        if _pid != os.getpid() or _fd is None:
            _start()
        assert _fd is not None
        try:
            os.write(_fd, line.encode())
            return
        except OSError:
            # The tracker died (killed on its own): start another and give
            # it every path still registered, this one included.
            os.close(_fd)
            _fd = None
    raise RuntimeError("lmcache_mp: the cleanup tracker cannot be started")


def _start() -> None:
    global _pid, _fd
    read, write = os.pipe()
    try:
        # The script forks and its parent exits at once: the tracker is
        # nobody's child here, so it leaves no zombie and no child process
        # for the owner to wait for.
        subprocess.run(
            [sys.executable, "-I", "-S", os.path.abspath(__file__)],
            stdin=read,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            check=True,
        )
    except BaseException:
        os.close(write)
        raise
    finally:
        os.close(read)
    _pid, _fd = os.getpid(), write
    for path in _paths:
        os.write(write, f"ADD {_hex(path)}\n".encode())


def _forget_in_child() -> None:
    # A forked child holds a copy of the parent's pipe end: closing it lets
    # the parent's tracker see EOF when the parent dies, not when the last
    # forked worker does; the child's own paths go to its own tracker.
    global _pid, _fd, _lock
    fd, _fd, _pid = _fd, None, None
    # Another thread may have held the lock at the fork.
    _lock = threading.Lock()
    _paths.clear()
    if fd is not None:
        os.close(fd)


os.register_at_fork(after_in_child=_forget_in_child)


def _serve() -> None:
    """The tracker: read registrations until EOF, then remove what is left."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    paths: set[str] = set()
    with open(sys.stdin.fileno(), "rb", closefd=False) as pipe:
        for raw in pipe:
            verb, _, arg = raw.strip().partition(b" ")
            try:
                path = os.fsdecode(bytes.fromhex(arg.decode("ascii")))
            except ValueError:
                continue
            if verb == b"ADD":
                paths.add(path)
            elif verb == b"DEL":
                paths.discard(path)
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    if os.fork() == 0:
        _serve()
    os._exit(0)
