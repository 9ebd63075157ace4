"""Running the benchmark and its result: :func:`run_bench`, :class:`BenchResult`."""

from __future__ import annotations

import datetime
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lmcache_mp._util.paths import atomic_write_text
from lmcache_mp.bench._config import BenchConfig, at_sweep_value, sweep_values
from lmcache_mp.bench._figures import point_figures
from lmcache_mp.bench._machine import (
    load_average,
    machine_info,
    references,
    usable_cores,
)
from lmcache_mp.bench._plot import write_plot
from lmcache_mp.bench._run import RunFigures, run_once
from lmcache_mp.bench._table import format_header, format_point
from lmcache_mp.kv import connect

__all__ = ["SCHEMA", "BenchResult", "run_bench", "to_json"]

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

    @property
    def failed_streams(self) -> int:
        """Stream failures over every point, executor, phase and repeat."""
        return sum(
            len(failed)
            for point in self.points
            for ex in point["executors"].values()
            for phase in ex["phases"].values()
            for failed in phase["failures"]
        )

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
    with connect(
        chunk_size=config.chunk_size,
        layers=config.layers,
        width=config.width,
        dtype=config.dtype,
    ) as store:
        engine = config.make_engine(store)
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
        LMCacheBatchedStreamError: If a phase failed as a whole (streams
            that fail are in the figures: ``failures`` per phase).
        ModelLoadError: If the config's trained model cannot be loaded.
        ImportError: Without the ``model`` extra, for a trained model.
    """
    started = time.perf_counter()
    config = config.with_model_dims()
    created = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    cores = usable_cores()
    result = BenchResult(config, machine_info(config.start_method), [], created)
    # How close a phase is to the machine's limits.
    result.machine.update(references())
    _warm_up(config)
    values: list[int | None] = [*sweep_values(config, cores)] or [None]
    for edit in config.edits:
        for value in values:
            point_config = at_sweep_value(config, value)
            fn = point_config.edit(edit)
            repeats: list[dict[str, RunFigures]] = []
            for repeat in range(config.repeat):
                repeats.append(
                    {
                        name: run_once(
                            point_config,
                            name,
                            fn,
                            progress=progress,
                            # Once a point: the same edit keeps the same
                            # tokens on every executor (their decode
                            # outputs are checked equal).
                            measure_agreement=repeat == 0 and name == config.runs[0],
                        )
                        for name in config.runs
                    }
                )
            point = point_figures(
                point_config,
                edit,
                value,
                repeats,
                cores,
                result.machine["memcpy_gb_s"],
            )
            result.points.append(point)
            if on_point is not None:
                on_point(point)
    result.machine["load_average_1m_end"] = load_average()
    result.duration_s = time.perf_counter() - started
    return result
