"""How a store's arena should prepare its pages, side by side in one run.

An arena (``connect(arena_bytes=...)``) makes chunk files before a phase
so that the phase's writes go over pages already there. This measures,
for a fresh tmpfs file each round, the rate of one pass of writes over
pages prepared each way, and of the preparation itself:

- ``fallocate``: pages reserved with ``posix_fallocate``, never written;
- ``written``: every page written once (zeros), what the arena does;
- ``new``: no preparation: the write allocates every page.

``python scripts/arena_fill.py`` prints GB/s for each, round by round (the
first round may also pay a VM host's backing of memory not used lately).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np

_PIECE = 32 << 20  # one chunk of Llama-3-8B's KV at 256 tokens


def _write_all(fd: int, piece: np.ndarray, nbytes: int) -> None:
    for start in range(0, nbytes, _PIECE):
        os.pwrite(fd, piece.data, start)


def _prepare(how: str, fd: int, nbytes: int) -> None:
    if how == "fallocate":
        os.posix_fallocate(fd, 0, nbytes)
    elif how == "written":
        _write_all(fd, np.zeros(_PIECE, np.uint8), nbytes)


def _round(how: str, folder: str, nbytes: int) -> tuple[float, float]:
    """Seconds of the preparation and of the write after it."""
    path = os.path.join(folder, f"arena-fill-{os.getpid()}")
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.unlink(path)  # the descriptor keeps the file while it is used
    try:
        begin = time.perf_counter()
        _prepare(how, fd, nbytes)
        prepared = time.perf_counter()
        _write_all(fd, np.ones(_PIECE, np.uint8), nbytes)
        done = time.perf_counter()
    finally:
        os.close(fd)
    return prepared - begin, done - prepared


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=2.0, help="file size")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    nbytes = int(args.gib * (1 << 30)) // _PIECE * _PIECE
    print(
        f"{nbytes / (1 << 30):.2f} GiB per file in {folder}; load average "
        f"{os.getloadavg()[0]:.2f}"
    )
    for round_ in range(1, args.rounds + 1):
        for how in ("fallocate", "written", "new"):
            prep, write = _round(how, folder, nbytes)
            prepare = f"{nbytes / prep / 1e9:5.2f} GB/s" if how != "new" else "-"
            print(
                f"round {round_}  {how:9s}  prepare {prepare:>10s}  then write "
                f"{nbytes / write / 1e9:5.2f} GB/s"
            )


if __name__ == "__main__":
    main()
