"""The benchmark behind ``lmcache-mp bench``: executors side by side.

For each executor asked for (``serial``, ``thread``, ``process``), on the
same prompts and the same model, one run does what a user of the SDK does:
**prefill** every stream on the embedded engine, **modify** each stream's
cached KV with a ready-made edit, **decode** greedily. Each run gets a fresh
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
          "executors": {
            "thread" | "process" | "serial": {
              "workers": int,         # processes, or threads
              "pool_start_s": STATS,  # process: start() before the phases
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

from __future__ import annotations

import datetime
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lmcache_mp._bench_config import BenchConfig, at_sweep_value, sweep_values
from lmcache_mp._bench_figures import point_figures
from lmcache_mp._bench_machine import load_average, machine_info, usable_cores
from lmcache_mp._bench_plot import write_plot
from lmcache_mp._bench_run import RunFigures, run_once
from lmcache_mp._bench_table import format_header, format_point
from lmcache_mp._paths import atomic_write_text
from lmcache_mp.engine import EmbeddedEngine
from lmcache_mp.kv import connect

__all__ = ["SCHEMA", "BenchConfig", "BenchResult", "run_bench", "to_json"]

#: The ``schema`` key of the JSON output.
SCHEMA = "lmcache-mp-bench/1"


@dataclass
class BenchResult:
    """Everything a benchmark measured.

    Args:
        config: The benchmark's configuration.
        machine: The machine and software (see the module's schema).
        points: One JSON-ready dict per edit and sweep value.
        created_utc: ISO 8601 time the benchmark started.
        duration_s: Seconds the whole benchmark took.
    """

    config: BenchConfig
    machine: dict[str, Any]
    points: list[dict[str, Any]] = field(default_factory=list)
    created_utc: str = ""
    duration_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """Return the result as JSON-ready data (schema in the module doc)."""
        sweep = None
        if self.config.sweep is not None:
            values = [p["sweep_value"] for p in self.points]
            sweep = {
                "parameter": self.config.sweep,
                "values": list(dict.fromkeys(values)),
            }
        return {
            "schema": SCHEMA,
            "created_utc": self.created_utc,
            "duration_s": self.duration_s,
            "config": self.config.to_dict(),
            "machine": dict(self.machine),
            "sweep": sweep,
            "points": list(self.points),
        }

    def format(self) -> str:
        """Return the text report: header, then a table and notes per point."""
        data = self.to_dict()
        parts = [format_header(data), *(format_point(p) for p in self.points)]
        return "\n\n".join(parts)

    def write_json(self, path: str | os.PathLike[str]) -> None:
        """Write :func:`to_json` of the result to ``path`` (replaced atomically).

        Raises:
            OSError: If the file cannot be written.
        """
        atomic_write_text(path, to_json(self) + "\n")

    def write_plot(self, path: str | os.PathLike[str]) -> None:
        """Draw the modify wall times (and the sweep's speedup curve).

        Raises:
            ImportError: If matplotlib is not installed (the message names
                the ``plot`` extra).
            OSError: If the file cannot be written.
        """
        write_plot(self.to_dict(), path)


def to_json(result: BenchResult) -> str:
    """Return the result as indented JSON text (schema in the module doc).

    Args:
        result: The benchmark's result.

    Returns:
        The JSON text.
    """
    return json.dumps(result.to_dict(), indent=2)


def _warm_up(config: BenchConfig) -> None:
    """Run the engine once in this process before anything is timed.

    In-process executors would otherwise charge the first run with what a
    process does once (building the model's weights, first numpy calls);
    workers do the same at pool start through preloading.
    """
    engine_config = config.engine_config()
    with connect(
        chunk_size=config.chunk_size,
        layers=engine_config.layers,
        width=engine_config.width,
        dtype=engine_config.dtype,
    ) as store:
        engine = EmbeddedEngine(store, engine_config)
        prompt = config.prompts()[0][: config.chunk_size + 1]
        for _ in engine(prompt, {"max_tokens": 2, "temperature": 0.0}):
            pass


def run_bench(
    config: BenchConfig,
    *,
    progress: bool | None = None,
    on_point: Callable[[dict[str, Any]], None] | None = None,
) -> BenchResult:
    """Run the benchmark: every edit x sweep value x repeat x executor.

    Repeats interleave the executors (thread, process, thread, process...)
    so that a slow spell of the machine does not fall on one executor only.

    Args:
        config: What to run.
        progress: Draw a progress line on stderr while a phase runs
            (``None``: only when stderr is a TTY; ``False``: never).
        on_point: Called with each point's JSON-ready figures as soon as
            the point is done (e.g. to print its table during a sweep).

    Returns:
        The figures of every point.

    Raises:
        LMCacheBatchedStreamError: If a stream failed in a phase.
    """
    started = time.perf_counter()
    created = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    cores = usable_cores()
    result = BenchResult(config, machine_info(config.start_method), [], created)
    _warm_up(config)
    values: list[int | None] = [*sweep_values(config, cores)] or [None]
    for edit in config.edits:
        for value in values:
            point_config = at_sweep_value(config, value)
            fn = point_config.edit(edit)
            repeats: list[dict[str, RunFigures]] = []
            for _ in range(config.repeat):
                repeats.append(
                    {
                        name: run_once(point_config, name, fn, progress=progress)
                        for name in config.executors
                    }
                )
            point = point_figures(point_config, edit, value, repeats, cores)
            result.points.append(point)
            if on_point is not None:
                on_point(point)
    result.machine["load_average_1m_end"] = load_average()
    result.duration_s = time.perf_counter() - started
    return result
