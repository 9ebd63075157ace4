"""Store and retrieve speed of the shared-memory KV store at real KV sizes,
side by side with a single-core memcpy measured in the same run.

``python scripts/store_speed.py`` stores, retrieves and overwrites (stages)
one stream of Llama-3-8B's KV (bf16, 32 layers x 8 KV heads x 128, 4,096
tokens: 512 MiB) several times, each time with new tokens, and prints the
GB/s of each operation and its ratio to memcpy. Options: ``--tokens``,
``--layers``, ``--width``, ``--dtype``, ``--rounds``, and ``--arena GIB``
(an arena of that size, which the process then keeps mapped: compare
``--arena 0`` with ``--arena 8``), ``--each`` (every round's rates, and
what the store holds by then).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np

import lmcache_mp
from lmcache_mp.kv._layout import resolve_dtype


def _timed(op: Callable[..., object], *args: object) -> float:
    start = time.perf_counter()
    op(*args)
    return time.perf_counter() - start


def _memcpy_gbs(nbytes: int, rounds: int) -> float:
    """Single-core copy rate between two buffers whose pages are touched."""
    src = np.ones(nbytes, np.uint8)
    dst = np.zeros(nbytes, np.uint8)
    best = min(_timed(np.copyto, dst, src) for _ in range(rounds))
    return nbytes / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--width", type=int, default=8 * 128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--arena", type=float, default=0.0, help="GiB")
    parser.add_argument(
        "--each", action="store_true", help="print every round's rates too"
    )
    args = parser.parse_args()
    dtype = resolve_dtype(args.dtype)
    shape = (2, args.layers, args.tokens, args.width)
    kv = np.random.default_rng(0).standard_normal(shape, np.float32).astype(dtype)
    nbytes = kv.nbytes
    memcpy = _memcpy_gbs(nbytes, args.rounds)
    figures: dict[str, list[float]] = {"store": [], "retrieve": [], "overwrite": []}
    layout = {"layers": args.layers, "width": args.width, "dtype": args.dtype}
    arena = int(args.arena * 2**30)
    with lmcache_mp.connect(arena_bytes=arena, **layout) as store:
        for index in range(args.rounds):
            tokens = list(range(index * args.tokens, (index + 1) * args.tokens))
            figures["store"].append(_timed(store.store, kv, tokens))
            figures["retrieve"].append(_timed(store.retrieve, tokens))
            start = time.perf_counter()
            staged = store.stage(kv, tokens)
            figures["overwrite"].append(time.perf_counter() - start)
            staged.discard()
            if args.each:
                rates = "  ".join(
                    f"{name} {nbytes / times[-1] / 1e9:5.2f}"
                    for name, times in figures.items()
                )
                used = store.stats().bytes / 2**30
                print(f"round {index + 1}: GB/s {rates}; store holds {used:.2f} GiB")
        capacity = store.capacity_bytes
    print(
        f"KV per stream: {nbytes / 2**20:.0f} MiB ({args.dtype}, {shape}); "
        f"store capacity {capacity / 2**30:.1f} GiB, arena {arena / 2**30:.1f} GiB; "
        f"median of {args.rounds} rounds"
    )
    print(f"{'operation':<12}{'ms':>10}{'GB/s':>10}{'x memcpy':>10}")
    print(f"{'memcpy':<12}{nbytes / memcpy / 1e6:>10.1f}{memcpy:>10.2f}{1.0:>10.2f}")
    for name, times in figures.items():
        median = statistics.median(times)
        gbs = nbytes / median / 1e9
        print(f"{name:<12}{median * 1e3:>10.1f}{gbs:>10.2f}{gbs / memcpy:>10.2f}")


if __name__ == "__main__":
    main()
