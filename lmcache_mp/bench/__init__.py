"""The benchmark behind ``lmcache-mp bench``: executors side by side.

For each executor asked for (``serial``, ``thread``, ``process``), on the
same prompts and the same model, one run does what a user of the SDK does:
**prefill** every stream on the embedded engine (by default SmolLM2-135M,
a trained model, on prose prompts; ``engine="toy"`` for the exact toy
model), **modify** each stream's cached KV with a ready-made edit,
**decode** greedily. On an engine that scores (a trained or the toy
model), each point also gives the edit's **agreement** with the
uncompressed run: each stream's greedy continuation, decoded before the
edit, is scored teacher-forced after it (top-1 agreement, KL). Each run gets a fresh
shared-memory store, so the prefill computes every prompt token; the
process pool is started (and timed) before the phases, so they do not
include it. The figures of every executor are then compared in one table::

    from lmcache_mp.bench import BenchConfig, run_bench

    result = run_bench(BenchConfig(edits=("pyscore",), repeat=3))
    print(result.format())
    result.write_json("bench.json")

JSON schema ``lmcache-mp-bench/1`` (:meth:`BenchResult.to_dict`)::

    {
      "schema": "lmcache-mp-bench/1",
      "created_utc": "2024-01-01T00:00:00+00:00",   # when the run started
      "duration_s": 61.2,                           # whole benchmark
      "config": {...},        # BenchConfig fields (lists for tuples)
      "machine": {
        "cores_physical": 2, "cores_logical": 2,
        "cores_used": 2,      # min(physical cores, CPU affinity)
        "cpu_model": str, "memory_total_bytes": int,
        "memory_available_bytes": int,
        "load_average_1m": float | null,      # at the start
        "load_average_1m_end": float | null,  # at the end
        "memcpy_gb_s": float, "pickle_gb_s": float,  # measured references
            # (256 MiB, one core, into touched pages, best of 5)
        "python": "3.11.4", "python_implementation": "CPython",
        "numpy": "1.26.4", "lmcache_mp": "0.1.0",
        "platform": str, "machine": "x86_64", "start_method": "spawn",
        "blas": [{"user_api", "internal_api", "prefix", "version",
                  "num_threads"}, ...] | null   # null: no threadpoolctl
      },
      "sweep": null | {"parameter": "workers", "values": [1, 2]},
      "points": [             # one per edit x sweep value, in run order
        {
          "edit": "random", "edit_params": {"keep": 0.5, ...},
          "sweep_value": null | int,
          "config": {...},    # this point's config (sweep value applied)
          "ideal_parallelism": int,   # min(cores_used, streams)
          "serial_basis": str,        # what "serial time" is (see below)
          "outputs_agree": bool,      # decoded tokens equal in every run
          "mismatched_streams": int,
          "agreement": null | {   # measured once a point, on the first run
            "top1": float,        # positions whose argmax is the reference's
            "kl": float,          # mean KL(p_ref || p_edit), nats
            "positions": float,   # streams x max_tokens
          },
          "executors": {
            "thread" | "process" | "serial" | "auto" | "auto-unhinted": {
              "workers": int,         # processes, or threads
              "pool_start_s": STATS,  # process: start() before the phases
              "arena_bytes": int,     # the store's arena (BenchConfig)
              "arena_fill_s": STATS,  # connecting the store, its arena
                                      # written: before the phases
              "total_s": STATS,       # pool start + the three phases
              "peak_rss_bytes": STATS,
              "outputs_digest": str,  # sha256 prefix of decoded token ids
              "phases": {
                "prefill" | "modify" | "decode": {
                  "wall_s": STATS,
                  "serial_s": STATS | null,
                  "speedup_vs_thread": STATS | null,  # thread wall / wall
                  "efficiency": STATS | null,
                      # serial_s / (wall_s * ideal_parallelism)
                  "per_stream_sum_s": STATS,
                  "pickled_bytes": STATS,    # through pipes, both ways
                  "kv_bytes": STATS | null,  # modify: KV read + written
                  "kv_gb_s": STATS | null,   # modify: kv_bytes / wall_s
                  "kv_vs_memcpy": STATS | null,  # kv_gb_s / memcpy_gb_s
                  "failed_streams": STATS,   # streams that failed
                  "failures": [{stream_id: error}, ...],  # per repeat
                  "peak_rss_bytes": STATS,   # parent + all children
                  "pool_start_s": STATS,     # pool (re)starts in the phase
                  "pool_rebuilds": STATS,
                  "throughput_tok_s": STATS, # prefill: prompt tokens/s,
                      # decode: generated tokens/s, modify: tokens edited/s
                  # prefill: input_tokens, ttft_p50_ms, ttft_p99_ms,
                  #   cache_hit_tokens
                  # modify: tokens_before, tokens_after, stream_p50_ms,
                  #   stream_max_ms
                  # decode: output_tokens, ttft_p50_ms, ttft_p99_ms,
                  #   tpot_p50_ms, tpot_p99_ms, cache_hit_tokens
                  "reports": [Metrics.to_dict(), ...]  # one per repeat
                }
              }
            }
          }
        }
      ]
    }

where ``STATS`` is ``{"median": x, "min": x, "max": x, "values": [x per
repeat]}`` (``null`` when the figure does not apply). Serial time is the
serial executor's wall time when it ran; otherwise, for modify only, the
lowest sum of per-stream edit times over the executors (prefill/decode
streams overlap by design, so theirs is no serial time and their
efficiency is ``null``).
"""

from lmcache_mp.bench._cli import add_bench_parser, run_bench_command
from lmcache_mp.bench._config import BenchConfig
from lmcache_mp.bench._result import SCHEMA, BenchResult, run_bench, to_json

__all__ = [
    "SCHEMA",
    "BenchConfig",
    "BenchResult",
    "add_bench_parser",
    "run_bench",
    "run_bench_command",
    "to_json",
]
