"""What the machine lets a store's copies reach, on one core and on two at
once, side by side in one run.

``python scripts/copy_ceiling.py`` runs, for a few seconds each, in one
process and then in ``--procs`` processes at once, each in 32 MiB pieces
(one chunk of Llama-3-8B's KV) and into or out of memory already touched:

- ``memcpy``: a user-space copy (``np.copyto``), the one-core memcpy the
  bench compares with;
- ``tmpfs read``: the kernel's copy out of a tmpfs file already written
  (``preadv``), what a retrieve of chunk files does;
- ``tmpfs mapped``: the same bytes copied out of a mapping of the file
  (``mmap`` + ``np.copyto``), what a retrieve that mapped chunk pages
  instead of reading them would do;
- ``tmpfs kept map``: the same copy out of one mapping kept from copy to
  copy, what a store whose files each process keeps mapped (Ray plasma's
  design) would pay once its pages are mapped;
- ``tmpfs rewrite``: ``pwritev`` over a file's pages already allocated,
  what a store into recycled chunk files does;
- ``tmpfs new``: writing a new file each time (the last one removed),
  what a store of new chunks does: the kernel allocates every page.

It prints each process's GB/s and the total. A modify phase on the pool
moves KV at most at these rates on as many processes as it has workers.
"""

from __future__ import annotations

import argparse
import mmap
import os
import tempfile
import time
from collections.abc import Callable
from multiprocessing import get_context
from multiprocessing.queues import Queue

import numpy as np

_PIECE = 32 << 20  # one chunk of Llama-3-8B's KV at 256 tokens


def _copy(nbytes: int) -> Callable[[], None]:
    src = np.ones(nbytes, np.uint8)
    dst = np.ones(nbytes, np.uint8)
    return lambda: np.copyto(dst, src)


def _tmpfs_file(folder: str, nbytes: int) -> int:
    """A descriptor of a new tmpfs file of ``nbytes`` written bytes."""
    path = os.path.join(folder, f"copy-ceiling-{os.getpid()}")
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    os.unlink(path)  # the descriptor keeps the file while it is used
    os.write(fd, np.ones(nbytes, np.uint8).data)
    return fd


def _pieces(nbytes: int) -> list[memoryview]:
    buf = np.ones(nbytes, np.uint8)
    return [buf[i : i + _PIECE].data for i in range(0, nbytes, _PIECE)]


def _tmpfs_pieces(
    op: Callable[[int, list[memoryview], int], int],
) -> Callable[[int, str], Callable[[], None]]:
    """A kind that runs ``op`` (``os.preadv`` or ``os.pwritev``) on every
    piece of a tmpfs file already written."""

    def make(nbytes: int, folder: str) -> Callable[[], None]:
        fd, pieces = _tmpfs_file(folder, nbytes), _pieces(nbytes)

        def run() -> None:
            for index, piece in enumerate(pieces):
                op(fd, [piece], index * _PIECE)

        return run

    return make


def _tmpfs_mapped(nbytes: int, folder: str) -> Callable[[], None]:
    fd, pieces = _tmpfs_file(folder, nbytes), _pieces(nbytes)

    def read() -> None:
        for index, piece in enumerate(pieces):
            with mmap.mmap(
                fd, _PIECE, mmap.MAP_SHARED, mmap.PROT_READ, offset=index * _PIECE
            ) as mapped:
                src = np.frombuffer(mapped, np.uint8)
                np.copyto(np.frombuffer(piece, np.uint8), src)
                del src  # the mapping closes only once no array uses it

    return read


def _tmpfs_kept_map(nbytes: int, folder: str) -> Callable[[], None]:
    fd, pieces = _tmpfs_file(folder, nbytes), _pieces(nbytes)
    src = np.frombuffer(
        mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ), np.uint8
    )

    def read() -> None:
        for index, piece in enumerate(pieces):
            start = index * _PIECE
            np.copyto(np.frombuffer(piece, np.uint8), src[start : start + _PIECE])

    return read


def _tmpfs_new(nbytes: int, folder: str) -> Callable[[], None]:
    pieces = _pieces(nbytes)
    path = os.path.join(folder, f"copy-ceiling-new-{os.getpid()}")

    def write() -> None:
        fd = os.open(path, os.O_CREAT | os.O_TRUNC | os.O_WRONLY, 0o600)
        try:
            for index, piece in enumerate(pieces):
                os.pwritev(fd, [piece], index * _PIECE)
        finally:
            os.close(fd)
            os.unlink(path)

    return write


_KINDS: dict[str, Callable[[int, str], Callable[[], None]]] = {
    "memcpy": lambda nbytes, folder: _copy(nbytes),
    "tmpfs read": _tmpfs_pieces(os.preadv),
    "tmpfs mapped": _tmpfs_mapped,
    "tmpfs kept map": _tmpfs_kept_map,
    "tmpfs rewrite": _tmpfs_pieces(os.pwritev),
    "tmpfs new": _tmpfs_new,
}


def _rate(
    kind: str, nbytes: int, seconds: float, folder: str, out: Queue[float]
) -> None:
    op = _KINDS[kind](nbytes, folder)
    op()  # warm: every page touched
    done, begin = 0, time.perf_counter()
    while time.perf_counter() - begin < seconds:
        op()
        done += nbytes
    out.put(done / (time.perf_counter() - begin) / 1e9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=512, help="bytes per copy")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--procs", type=int, default=2)
    args = parser.parse_args()
    ctx = get_context("spawn")
    folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    print(
        f"{args.mib} MiB per copy, {args.seconds:g} s each; load average "
        f"{os.getloadavg()[0]:.2f}"
    )
    print(f"{'copy':<14}{'procs':>6}  per process GB/s{'total':>16}")
    for kind in _KINDS:
        for procs in sorted({1, args.procs}):
            out: Queue[float] = ctx.Queue()
            workers = [
                ctx.Process(
                    target=_rate,
                    args=(kind, args.mib << 20, args.seconds, folder, out),
                )
                for _ in range(procs)
            ]
            for worker in workers:
                worker.start()
            rates = [out.get(timeout=60 + 2 * args.seconds) for _ in workers]
            for worker in workers:
                worker.join(timeout=60)
            each = " ".join(f"{rate:.2f}" for rate in rates)
            print(f"{kind:<14}{procs:>6}  {each:<22}{sum(rates):>8.2f}")


if __name__ == "__main__":
    main()
