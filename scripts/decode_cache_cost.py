"""What keeping generated tokens' KV costs a decode at a real model's KV size.

``python scripts/decode_cache_cost.py`` decodes ``--streams`` streams of
``--prompt`` tokens for ``--generate`` tokens each on the embedded toy engine
given Llama-3-8B's KV shape (32 layers, 8 KV heads x 128, 16-bit: 128 KiB
per token), twice per repeat, alternating: with ``save_decode_cache=True``
(each chunk the generated tokens complete is stored, as vLLM + LMCache do)
and with it off (the prompt's chunks only). It prints each run's decode
phase seconds, the store's bytes after it, then the medians and the ratio
of decode time with the cache kept to without.

The toy model computes little per token for its KV size, so the stored
chunks weigh more here than beside a real 8B model's decode step: the
ratio is an upper bound on what the saving costs. Needs about
``streams x (prompt + generate) x 128 KiB`` of /dev/shm per run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import lmcache_mp
from lmcache_mp.engine import EmbeddedEngine, EngineConfig

# Llama-3-8B's KV: 32 layers, 8 KV heads x 128 channels, 2 bytes a value.
SHAPE = EngineConfig(layers=32, kv_heads=8, head_dim=128, d_model=128, dtype="float16")


def one_run(
    executor: str, save: bool, streams: int, prompt: int, generate: int, seed: int
) -> tuple[float, int]:
    """The decode phase's seconds and the store's bytes after it."""
    rng = np.random.default_rng(seed)
    ctx = lmcache_mp.connect()
    try:
        engine = EmbeddedEngine(ctx, SHAPE, save_decode_cache=save)
        with lmcache_mp.LMCacheBatchedStream(executor) as batch:
            for _ in range(streams):
                tokens = rng.integers(1, SHAPE.vocab_size, prompt).tolist()
                batch.add(lmcache_mp.create_request(ctx, engine, tokens))
            greedy = {"temperature": 0.0, "ignore_eos": True}
            batch.prefill({**greedy, "max_tokens": 1})
            begin = time.perf_counter()
            metrics = batch.decode({**greedy, "max_tokens": generate})
            wall = time.perf_counter() - begin
            failed = metrics.to_dict().get("failures")
            if failed:
                raise SystemExit(f"streams failed: {failed}")
            return wall, ctx.stats().bytes
    finally:
        ctx.destroy()


def main() -> None:
    """Alternate the cache kept and not; print the runs and the ratio."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--generate", type=int, default=512)
    parser.add_argument("--executor", default="process")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    per_token = 2 * SHAPE.layers * SHAPE.width * 2
    print(
        f"{args.streams} streams x {args.prompt} prompt tokens, {args.generate} "
        f"generated, {per_token >> 10} KiB of KV per token, {args.executor} executor"
    )
    times: dict[bool, list[float]] = {True: [], False: []}
    for rep in range(args.repeat):
        for save in (True, False):
            wall, stored = one_run(
                args.executor, save, args.streams, args.prompt, args.generate, rep
            )
            times[save].append(wall)
            print(
                f"run {rep + 1} save_decode_cache={save!s:5}: decode {wall:6.2f} s, "
                f"store {stored / 2**20:7.1f} MiB"
            )
    kept, dropped = (statistics.median(times[s]) for s in (True, False))
    print(
        f"median decode: kept {kept:.2f} s, not kept {dropped:.2f} s; "
        f"kept / not kept {kept / dropped:.3f}"
    )


if __name__ == "__main__":
    main()
