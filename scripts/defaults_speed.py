"""A user's own script at a real model's KV size, with the library's defaults.

``python scripts/defaults_speed.py`` does what a researcher's first script
does, with no tuning argument (no arena, no reserve, no capacity):
``lmcache_mp.connect()``, ``LMCacheBatchedStream(executor)``, an engine
that stores each prompt's KV chunk by chunk as LMCache offloads after a
prefill, one warm-up modify on streams of their own, then the timed modify
of ``--streams`` streams of ``--tokens`` tokens each with the ``stride``
edit (every other token kept). The KV has Llama-3-8B's shape: 32 layers,
8 KV heads x 128, bfloat16, 128 KiB per token.

Threads and the process pool run side by side, ``--repeat`` times each,
alternating; the script prints each run's modify seconds and KV rate (bytes
read plus bytes written, over the wall time), the median per executor, and
its ratio to this run's one-core memcpy (``lmcache-mp bench``'s reference)
and to threads. Needs ml_dtypes (``pip install -e '.[bfloat16]'``) and
about 6 GiB of /dev/shm at the default size.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import ml_dtypes
import numpy as np
import psutil

import lmcache_mp
from lmcache_mp import TokenEvent
from lmcache_mp.edits import make_edit
from lmcache_mp.kv import KVStore

LAYERS, WIDTH = 32, 8 * 128  # Llama-3-8B: 32 layers, 8 KV heads x 128
_ROWS = 4096  # distinct KV rows of the engine's table
_REF_BYTES = 256 << 20


class OffloadingEngine:
    """A ``post_completion`` that stores the prompt's KV as LMCache offloads
    it after a prefill, a chunk at a time, and replies with one token.

    Args:
        ctx: The store.
    """

    def __init__(self, ctx: KVStore) -> None:
        self._ctx = ctx
        rng = np.random.default_rng(0)
        table = rng.standard_normal((2, LAYERS, _ROWS, WIDTH), np.float32)
        self._table = table.astype(ml_dtypes.bfloat16)

    def __reduce__(self) -> tuple[Any, ...]:
        # A worker rebuilds the table from the seed.
        return (type(self), (self._ctx,))

    def __call__(
        self,
        prompt_token_ids: Sequence[int],
        sampling_params: Mapping[str, Any],
        cache_salt: str = "",
    ) -> Iterator[TokenEvent]:
        """Store the prompt's full chunks and yield one token."""
        toks = [int(t) for t in prompt_token_ids]
        size = self._ctx.chunk_size
        for begin in range(0, len(toks) - size + 1, size):
            rows = np.asarray(toks[begin : begin + size]) % _ROWS
            kv = np.take(self._table, rows, axis=2)
            self._ctx.store(kv, toks[: begin + size], cache_salt, start=begin)
        yield TokenEvent(1, "<1>", 0)


def memcpy_gb_s() -> float:
    """One core's copy between two buffers already touched (best of 5)."""
    src = np.ones(_REF_BYTES, np.uint8)
    dst = np.zeros_like(src)
    dst.fill(1)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - start)
    return _REF_BYTES / min(times) / 1e9


def one_run(executor: str, streams: int, tokens: int, seed: int) -> float:
    """Seconds of the timed modify of one batch with the defaults."""
    rng = np.random.default_rng(seed)
    ctx = lmcache_mp.connect()
    try:
        engine = OffloadingEngine(ctx)
        batch = lmcache_mp.LMCacheBatchedStream(executor)
        try:
            ids: dict[str, list[str]] = {"warm": [], "timed": []}
            # One warm-up stream per worker the pool starts by default.
            warm = min(streams, psutil.cpu_count(logical=False) or 1)
            for role, count in (("warm", warm), ("timed", streams)):
                for _ in range(count):
                    prompt = rng.integers(1, 1 << 20, tokens).tolist()
                    stream = lmcache_mp.create_request(ctx, engine, prompt)
                    batch.add(stream)
                    ids[role].append(stream.stream_id())
            batch.prefill({"max_tokens": 1})
            stride = make_edit("stride")
            batch.modify(stride, stream_ids=ids["warm"])
            start = time.perf_counter()
            metrics = batch.modify(stride, stream_ids=ids["timed"])
            wall = time.perf_counter() - start
            failed = metrics.to_dict().get("failures")
            if failed:
                raise SystemExit(f"{executor}: streams failed: {failed}")
            return wall
        finally:
            batch.close()
    finally:
        ctx.close()


def main() -> None:
    """Run threads and the pool side by side; print rates and ratios."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    per_token = 2 * LAYERS * WIDTH * 2
    moved = args.streams * args.tokens * per_token * 3 // 2  # read + half written
    memcpy = memcpy_gb_s()
    print(
        f"{args.streams} streams x {args.tokens} tokens, Llama-3-8B KV "
        f"({args.tokens * per_token / 2**20:.0f} MiB per stream), stride; "
        f"KV moved per modify {moved / 2**30:.2f} GiB; memcpy {memcpy:.1f} GB/s"
    )
    walls: dict[str, list[float]] = {"thread": [], "process": []}
    for rep in range(args.repeat):
        for executor in walls:
            wall = one_run(executor, args.streams, args.tokens, rep)
            walls[executor].append(wall)
            rate = moved / wall / 1e9
            print(f"  run {rep + 1} {executor:<8} {wall:7.3f} s  {rate:5.2f} GB/s")
    medians = {name: statistics.median(w) for name, w in walls.items()}
    for name, wall in medians.items():
        rate = moved / wall / 1e9
        print(
            f"median {name:<8} {wall:7.3f} s  {rate:5.2f} GB/s  "
            f"{rate / memcpy:.2f}x memcpy  {medians['thread'] / wall:.2f}x thread"
        )


if __name__ == "__main__":
    main()
