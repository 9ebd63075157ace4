"""From the runs of one benchmark point to its JSON-ready figures."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import statistics
from collections.abc import Sequence
from typing import Any

from lmcache_mp.bench._config import BenchConfig
from lmcache_mp.bench._run import PHASES, PhaseFigures, RunFigures

__all__ = ["BASIS_PER_STREAM", "BASIS_SERIAL", "point_figures", "stats"]

#: ``serial_basis`` when the serial executor ran: its wall time per phase.
BASIS_SERIAL = "serial executor wall time"
#: ``serial_basis`` otherwise: the lowest sum of per-stream modify times
#: over the executors. Prefill/decode streams overlap by design (every
#: request in flight), so their per-stream times add up to more than a
#: serial run and give no basis: their efficiency is then null.
BASIS_PER_STREAM = "sum of per-stream modify times (lowest over the executors)"

#: (section, key) of the report entries copied into the figures, per phase.
_REPORTED: dict[str, dict[str, tuple[str, str]]] = {
    "prefill": {
        "throughput_tok_s": ("results", "input_tput"),
        "input_tokens": ("results", "input_tokens"),
        "ttft_p50_ms": ("latency", "p50_ttft_ms"),
        "ttft_p99_ms": ("latency", "p99_ttft_ms"),
        "cache_hit_tokens": ("cache", "cache_hit_tokens"),
    },
    "modify": {
        "tokens_before": ("results", "tokens_before"),
        "tokens_after": ("results", "tokens_after"),
        "stream_p50_ms": ("results", "p50_stream_modify_ms"),
        "stream_max_ms": ("results", "max_stream_modify_ms"),
    },
    "decode": {
        "throughput_tok_s": ("results", "output_tput"),
        "output_tokens": ("results", "output_tokens"),
        "ttft_p50_ms": ("latency", "p50_ttft_ms"),
        "ttft_p99_ms": ("latency", "p99_ttft_ms"),
        "tpot_p50_ms": ("latency", "p50_tpot_ms"),
        "tpot_p99_ms": ("latency", "p99_tpot_ms"),
        "cache_hit_tokens": ("cache", "cache_hit_tokens"),
        # With --every: the compression rounds the decode phase ran.
        "rounds": ("compression", "rounds"),
        "rounds_modify_s": ("compression", "modify_s"),
        "max_kv_tokens": ("compression", "max_kv_tokens"),
    },
}


def stats(values: Sequence[float | None]) -> dict[str, Any] | None:
    """Median and spread of one figure over repeats.

    Args:
        values: The figure in each repeat (``None`` where it does not apply).

    Returns:
        ``{"median", "min", "max", "values"}``, or ``None`` when every value
        is ``None``.
    """
    present = [v for v in values if v is not None]
    if not present:
        return None
    return {
        "median": statistics.median(present),
        "min": min(present),
        "max": max(present),
        "values": list(values),
    }


def _ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den <= 0:
        return None
    return num / den


def _basis(runs: dict[str, RunFigures], phase: str) -> float | None:
    """The serial time of a phase in one repeat (see ``BASIS_*``)."""
    if "serial" in runs:
        return runs["serial"].phases[phase].wall_s
    if phase != "modify":
        return None
    return min(run.phases[phase].per_stream_s for run in runs.values())


def _phase_values(
    phase: str,
    fig: PhaseFigures,
    runs: dict[str, RunFigures],
    ideal: int,
    memcpy_gb_s: float | None,
) -> dict[str, float | None]:
    """One executor's figures for one phase in one repeat."""
    thread = runs.get("thread")
    serial_s = _basis(runs, phase)
    values: dict[str, float | None] = {
        "wall_s": fig.wall_s,
        "serial_s": serial_s,
        "speedup_vs_thread": (
            None if thread is None else _ratio(thread.phases[phase].wall_s, fig.wall_s)
        ),
        "efficiency": _ratio(serial_s, fig.wall_s * ideal),
        "per_stream_sum_s": fig.per_stream_s,
        "pickled_bytes": fig.pickled_bytes,
        "kv_bytes": None,
        "kv_gb_s": None,
        "kv_vs_memcpy": None,
        "peak_rss_bytes": fig.peak_rss_bytes,
        "failed_streams": len(fig.failures),
        "pool_start_s": fig.metric("transport", "pool_start_s"),
        "pool_rebuilds": fig.metric("transport", "pool_rebuilds"),
    }
    for name, (section, key) in _REPORTED[phase].items():
        values[name] = fig.metric(section, key)
    if phase == "modify":
        kv_in = fig.metric("results", "kv_bytes_in") or 0
        values["kv_bytes"] = kv_in + (fig.metric("results", "kv_bytes_out") or 0)
        # KV moved per second of the phase, against one core's memcpy
        # measured in the same run (how far from memory speed).
        values["kv_gb_s"] = _ratio(values["kv_bytes"], fig.wall_s * 1e9)
        values["kv_vs_memcpy"] = _ratio(values["kv_gb_s"], memcpy_gb_s)
        values["throughput_tok_s"] = _ratio(values["tokens_before"], fig.wall_s)
    return values


def _collect(
    per_repeat: Sequence[dict[str, Any]],
) -> dict[str, dict[str, Any] | None]:
    """Turn one dict of values per repeat into one stats dict per figure."""
    return {name: stats([r[name] for r in per_repeat]) for name in per_repeat[0]}


def _digest(outputs: list[list[int]]) -> str:
    text = json.dumps(outputs, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _mismatches(repeats: Sequence[dict[str, RunFigures]]) -> int:
    """Streams whose decoded tokens differ between any two runs."""
    runs = [run for runs in repeats for run in runs.values()]
    reference = runs[0].outputs
    return sum(
        1
        for i, tokens in enumerate(reference)
        if any(run.outputs[i] != tokens for run in runs[1:])
    )


def point_figures(
    config: BenchConfig,
    edit: str,
    sweep_value: int | None,
    repeats: Sequence[dict[str, RunFigures]],
    cores: int,
    memcpy_gb_s: float | None = None,
) -> dict[str, Any]:
    """The JSON-ready figures of one benchmark point.

    Args:
        config: The point's config (sweep value applied).
        edit: The edit's name.
        sweep_value: The swept parameter's value, or ``None``.
        repeats: For each repeat, executor name -> its run.
        cores: Cores a run can use.
        memcpy_gb_s: The run's single-core memcpy rate, the reference of
            ``kv_vs_memcpy`` (``None``: no ratio).

    Returns:
        One element of the ``points`` list of the JSON schema.
    """
    ideal = min(cores, config.streams)
    executors: dict[str, Any] = {}
    for name in config.runs:
        runs = [r[name] for r in repeats]
        phases: dict[str, Any] = {}
        for phase in PHASES:
            per_repeat = [
                _phase_values(
                    phase, runs_[name].phases[phase], runs_, ideal, memcpy_gb_s
                )
                for runs_ in repeats
            ]
            phases[phase] = _collect(per_repeat)
            phases[phase]["reports"] = [run.phases[phase].report for run in runs]
            phases[phase]["failures"] = [run.phases[phase].failures for run in runs]
        executors[name] = {
            "workers": runs[0].workers,
            "pool_start_s": stats([run.pool_start_s for run in runs]),
            "arena_bytes": runs[0].arena_bytes,
            "arena_fill_s": stats([run.arena_fill_s for run in runs]),
            "total_s": stats([_total(run) for run in runs]),
            "peak_rss_bytes": stats([run.peak_rss_bytes for run in runs]),
            "outputs_digest": _digest(runs[0].outputs),
            "phases": phases,
        }
    mismatched = _mismatches(repeats)
    measured = [r.agreement for runs in repeats for r in runs.values() if r.agreement]
    return {
        "edit": edit,
        "edit_params": _edit_params(config, edit),
        "sweep_value": sweep_value,
        "config": config.to_dict(),
        "ideal_parallelism": ideal,
        "serial_basis": (
            BASIS_SERIAL if "serial" in config.executors else BASIS_PER_STREAM
        ),
        "outputs_agree": mismatched == 0,
        "mismatched_streams": mismatched,
        "agreement": measured[0] if measured else None,
        "executors": executors,
    }


def _total(run: RunFigures) -> float:
    return run.pool_start_s + sum(p.wall_s for p in run.phases.values())


def _edit_params(config: BenchConfig, edit: str) -> dict[str, Any]:
    """The edit's fields as JSON data (its attention config a mapping)."""
    params = _plain(config.edit(edit))
    assert isinstance(params, dict)
    return params


def _plain(value: Any) -> Any:
    """``value`` as JSON data: a dataclass as a mapping of its fields, a
    tuple as a list (an edit's ``AttentionConfig`` broke ``--json``)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)
        }
    if isinstance(value, (tuple, list)):
        return [_plain(item) for item in value]
    return value
