"""What the machine lets a store's copies reach, on one core and on two at
once, side by side in one run (issue #20).

``python scripts/copy_ceiling.py`` runs, for a few seconds each, in one
process and then in ``--procs`` processes at once: a user-space copy
(``np.copyto``, the one-core memcpy the bench compares with) and the
kernel's copy out of a tmpfs file already written (``preadv`` of 32 MiB
pieces, what a retrieve of chunk files does), each into memory already
touched. It prints each process's GB/s and the total. A modify phase on
the pool moves KV at most at the total of the second on as many processes
as it has workers.
"""

from __future__ import annotations

import argparse
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


def _tmpfs_read(nbytes: int, folder: str) -> Callable[[], None]:
    path = os.path.join(folder, f"copy-ceiling-{os.getpid()}")
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    os.unlink(path)  # the descriptor keeps the file while it is read
    os.write(fd, np.ones(nbytes, np.uint8))
    dst = np.ones(nbytes, np.uint8)
    pieces = [dst[i : i + _PIECE] for i in range(0, nbytes, _PIECE)]

    def read() -> None:
        for index, piece in enumerate(pieces):
            os.preadv(fd, [piece], index * _PIECE)

    return read


def _rate(kind: str, nbytes: int, seconds: float, folder: str, out: Queue) -> None:
    op = _copy(nbytes) if kind == "memcpy" else _tmpfs_read(nbytes, folder)
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
    print(f"{'copy':<12}{'procs':>6}  per process GB/s{'total':>16}")
    for kind in ("memcpy", "tmpfs read"):
        for procs in sorted({1, args.procs}):
            out: Queue = ctx.Queue()
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
            print(f"{kind:<12}{procs:>6}  {each:<22}{sum(rates):>8.2f}")


if __name__ == "__main__":
    main()
