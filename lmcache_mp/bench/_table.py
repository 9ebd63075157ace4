"""The benchmark's text report: one comparison table per point, and notes."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from tabulate import tabulate

from lmcache_mp._harness.options import TOY
from lmcache_mp.bench._config import SYNTHETIC
from lmcache_mp.bench._figures import BASIS_SERIAL
from lmcache_mp.kv import resolve_dtype

__all__ = ["format_header", "format_point"]

# Lists in an edit's parameters longer than this show as their length.
_LIST_SHOWN = 4

_HEADERS = [
    "phase",
    "executor",
    "workers",
    "wall s",
    "x thread",
    "efficiency",
    "tok/s",
    "p50 ms",
    "p99 ms",
    "pickled",
    "KV via store",
    "KV GB/s",
    "x memcpy",
    "peak RSS",
]
#: The p50/p99 columns' figures per phase (modify has a max, not a p99).
_LATENCY = {
    "prefill": ("ttft_p50_ms", "ttft_p99_ms"),
    "modify": ("stream_p50_ms", "stream_max_ms"),
    "decode": ("tpot_p50_ms", "tpot_p99_ms"),
}


def _bytes(value: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value >= size:
            return f"{value / size:.1f} {unit}"
    return f"{value:.0f} B"


def _cell(fig: dict[str, Any] | None, fmt: Callable[[float], str]) -> str:
    """``median``, then ``(min-max)`` when repeats differ at this precision."""
    if fig is None:
        return "-"
    low, high = fmt(fig["min"]), fmt(fig["max"])
    text = fmt(fig["median"])
    return text if low == high else f"{text} ({low}-{high})"


def _fixed(digits: int) -> Callable[[float], str]:
    return lambda v: f"{v:.{digits}f}"


def _speedup(v: float) -> str:
    return f"{v:.2f}x"


def _percent(v: float) -> str:
    return f"{100 * v:.0f}%"


def _rows(point: dict[str, Any]) -> list[list[str]]:
    rows = []
    executors: dict[str, Any] = point["executors"]
    for name, ex in executors.items():
        # Executors with workers to start: the pool, a Dask cluster, Ray.
        # auto's pool is started before the phases too.
        if name in ("process", "dask", "ray") or ex["pool_start_s"]["median"] > 0:
            start = _cell(ex["pool_start_s"], _fixed(3))
            rows.append(
                ["pool start", name, str(ex["workers"]), start]
                + ["-"] * (len(_HEADERS) - 4)
            )
    for phase, (p50, p99) in _LATENCY.items():
        for name, ex in executors.items():
            fig = ex["phases"][phase]
            rows.append(
                [
                    phase,
                    name,
                    str(ex["workers"]),
                    _cell(fig["wall_s"], _fixed(3)),
                    _cell(fig["speedup_vs_thread"], _speedup),
                    _cell(fig["efficiency"], _percent),
                    _cell(fig["throughput_tok_s"], _fixed(0)),
                    _cell(fig[p50], _fixed(2)),
                    _cell(fig[p99], _fixed(2)),
                    _cell(fig["pickled_bytes"], _bytes),
                    _cell(fig["kv_bytes"], _bytes),
                    _cell(fig["kv_gb_s"], _fixed(2)),
                    _cell(fig["kv_vs_memcpy"], _speedup),
                    _cell(fig["peak_rss_bytes"], _bytes),
                ]
            )
    return rows


def _kv_per_token(cfg: dict[str, Any]) -> int:
    """Bytes of one token's KV (K and V of every layer) in a run's config."""
    itemsize = resolve_dtype(cfg["dtype"]).itemsize
    return int(2 * cfg["layers"] * cfg["kv_heads"] * cfg["head_dim"] * itemsize)


def _every(cfg: dict[str, Any]) -> str:
    """The header's words for a decode compressed every N tokens."""
    every = cfg.get("every")
    return "" if every is None else f" compressed every {every}"


def _rounds_note(point: dict[str, Any]) -> list[str]:
    """The compression rounds of the decode phase, per executor, if any."""
    executors: dict[str, Any] = point["executors"]
    decode = {name: ex["phases"]["decode"] for name, ex in executors.items()}
    if all(fig.get("rounds") is None for fig in decode.values()):
        return []
    thread = decode.get("thread", {}).get("rounds_modify_s")
    times = []
    for name, fig in decode.items():
        seconds = fig["rounds_modify_s"]["median"]
        text = f"{name} {seconds:.3f} s"
        if thread is not None and name != "thread" and seconds > 0:
            text += f" ({_speedup(thread['median'] / seconds)} thread)"
        times.append(text)
    return [
        f"compression rounds in decode: {_first(point, 'decode', 'rounds')}, "
        f"the last leaving at most {_first(point, 'decode', 'max_kv_tokens')} KV "
        f"tokens per stream; their modify time (in decode's wall s): "
        f"{', '.join(times)}."
    ]


def format_header(result: dict[str, Any]) -> str:
    """The lines describing the run: config and machine.

    Args:
        result: The benchmark's JSON-ready result.

    Returns:
        The text, without a trailing newline.
    """
    cfg, machine = result["config"], result["machine"]
    kv_per_stream = _kv_per_token(cfg) * cfg["prompt_tokens"]
    shape = cfg.get("shape")
    model = f"{shape} shape" if shape else "model"
    engine = cfg.get("engine", TOY)
    lines = [
        f"lmcache-mp bench: {cfg['streams']} streams x {cfg['prompt_tokens']} "
        f"prompt tokens, decode {cfg['max_tokens']} tokens{_every(cfg)}; {model} "
        f"{cfg['layers']} layers x {cfg['kv_heads']} KV heads x "
        f"{cfg['head_dim']} dims, {cfg['dtype']} KV ({_bytes(kv_per_stream)} "
        f"per prompt, {_bytes(kv_per_stream * cfg['streams'])} in all), "
        f"{engine} engine; chunk "
        f"{cfg['chunk_size']}; start method {cfg['start_method']}; "
        f"repeat {cfg['repeat']}; seed {cfg['seed']}",
        f"machine: {machine['cores_physical']} physical / "
        f"{machine['cores_logical']} logical cores ({machine['cpu_model']}), "
        f"{_bytes(machine['memory_total_bytes'])} RAM, Python "
        f"{machine['python']}, numpy {machine['numpy']}, load average "
        f"{machine['load_average_1m']} at start",
    ]
    if "memcpy_gb_s" in machine:
        lines.append(
            f"references: memcpy {machine['memcpy_gb_s']:.1f} GB/s, pickle "
            f"{machine['pickle_gb_s']:.1f} GB/s (256 MiB, one core, best of 5)"
        )
    if engine == SYNTHETIC:
        lines.append(
            "engine: synthetic (a real shape's KV without a model: prefill "
            "gathers each token's KV from a seeded table and stores it, decode "
            "retrieves the edited KV and draws tokens from its bits); modify is "
            "the real workload"
        )
    if machine["blas"] is None and "thread" in cfg["executors"]:
        lines.append(
            "note: threadpoolctl is not installed, so the thread executor cannot "
            "cap BLAS threads and oversubscribes the cores (an unfair baseline): "
            "pip install 'lmcache-mp[blas]'"
        )
    return "\n".join(lines)


def _edit_line(point: dict[str, Any]) -> str:
    text = f"edit {point['edit']}{_params_text(point['edit_params'])}"
    if point["sweep_value"] is not None:
        sweep = point["config"]["sweep"]
        text = f"{sweep} = {point['sweep_value']}: {text}"
    return text


def _params_text(params: dict[str, Any]) -> str:
    """``(name=value, ...)``; a nested mapping likewise, a long list as its
    length (a model's 32 RoPE frequencies filled a screen)."""
    items = []
    for name, value in params.items():
        if isinstance(value, dict):
            shown = _params_text(value)
        elif isinstance(value, list) and len(value) > _LIST_SHOWN:
            shown = f"[{len(value)} values]"
        else:
            shown = str(value)
        items.append(f"{name}={shown}")
    return f"({', '.join(items)})"


def _first(point: dict[str, Any], phase: str, key: str) -> str:
    """A token count, as one number when every executor agrees."""
    values = {
        ex["phases"][phase][key]["median"]
        for ex in point["executors"].values()
        if ex["phases"][phase][key] is not None
    }
    return " / ".join(f"{v:,.0f}" for v in sorted(values)) or "-"


def _failures(point: dict[str, Any]) -> list[str]:
    """One line per phase of an executor in which streams failed."""
    lines = []
    streams = point["config"]["streams"]
    for name, ex in point["executors"].items():
        for phase in _LATENCY:
            for repeat, failed in enumerate(ex["phases"][phase]["failures"]):
                if failed:
                    first = next(iter(failed.values()))
                    lines.append(
                        f"FAILED: {phase} on {name} (repeat {repeat + 1}): "
                        f"{len(failed)} of {streams} streams; first: {first}"
                    )
    return lines


def _auto_notes(executors: dict[str, Any]) -> list[str]:
    """auto's modify wall time against the better of threads and processes."""
    walls = {
        name: ex["phases"]["modify"]["wall_s"]["median"]
        for name, ex in executors.items()
    }
    if "thread" not in walls or "process" not in walls:
        return []
    best = min(walls["thread"], walls["process"])
    return [
        f"modify, {name} vs the better of thread and process: "
        f"{best / walls[name]:.2f}x (project goal: >= 0.95x)."
        for name in ("auto", "auto-unhinted")
        if name in walls
    ]


def _memory_note(point: dict[str, Any]) -> list[str]:
    """Each executor's peak RSS against the project's bound: the KV the store
    holds at the end (every prompt token's and every kept token's), plus
    two streams' KV per worker, plus 1 GiB. Only for the synthetic engine
    (``--shape`` runs): a model engine's workers each hold its weights."""
    config, executors = point["config"], point["executors"]
    first = next(iter(executors.values()))["phases"]
    if (
        config.get("engine", TOY) != SYNTHETIC
        or first["modify"]["tokens_after"] is None
    ):
        return []
    per_token = _kv_per_token(config)
    tokens = first["prefill"]["input_tokens"]["median"]
    stored = per_token * (tokens + first["modify"]["tokens_after"]["median"])
    stream_kv = per_token * config["prompt_tokens"]
    parts = []
    for name, ex in executors.items():
        bound = stored + 2 * stream_kv * ex["workers"] + 2**30
        over = [
            f"{phase} {_bytes(ex['phases'][phase]['peak_rss_bytes']['median'])}"
            for phase in _LATENCY
            if ex["phases"][phase]["peak_rss_bytes"]["median"] > bound
        ]
        parts.append(
            f"{name} {_bytes(bound)}"
            + (f" (over it: {', '.join(over)})" if over else "")
        )
    return [
        f"peak RSS bound (the KV the store holds, {_bytes(stored)}, + 2 "
        f"streams' KV, {_bytes(2 * stream_kv)}, per worker + 1 GiB): "
        f"{'; '.join(parts)}."
    ]


def _notes(point: dict[str, Any]) -> list[str]:
    ideal = point["ideal_parallelism"]
    notes = [
        *_failures(point),
        "x thread: the thread executor's wall time / this one's (above 1: faster).",
        f"efficiency: serial time / (wall x min(cores, streams) = {ideal}); "
        f"serial time = {point['serial_basis']}.",
    ]
    if point["serial_basis"] != BASIS_SERIAL:
        notes.append(
            "  (prefill/decode efficiency needs a serial run: --executors "
            "serial,thread,process)"
        )
    notes += [
        "p50/p99 ms: TTFT for prefill, TPOT for decode; for modify, the "
        "per-stream edit time p50/max.",
        "pickled: bytes pickled to and from workers (pipes, or Dask's/Ray's "
        "data plane); KV via store: KV bytes the edit read + wrote through "
        "the KV store (shared memory, or --store); KV GB/s: those bytes / the "
        "modify wall time; x memcpy: that rate / the one-core memcpy above.",
        "peak RSS: parent + all child processes, sampled every 20 ms "
        "(shared-memory pages, such as the store's mapped chunk files, "
        "counted once).",
        f"tokens: prefill {_first(point, 'prefill', 'input_tokens')} prompt "
        f"tokens computed; modify {_first(point, 'modify', 'tokens_before')} -> "
        f"{_first(point, 'modify', 'tokens_after')}; decode "
        f"{_first(point, 'decode', 'cache_hit_tokens')} cache-hit tokens, "
        f"{_first(point, 'decode', 'output_tokens')} generated.",
    ]
    streams = point["config"]["streams"]
    if point["outputs_agree"]:
        notes.append(
            f"decode outputs: identical across executors and repeats "
            f"({streams} streams, greedy)."
        )
    else:
        notes.append(
            f"decode outputs: DIFFER in {point['mismatched_streams']} of "
            f"{streams} streams across executors/repeats."
        )
    executors = point["executors"]
    if "serial" in executors:
        notes.append("serial: one stream at a time, one BLAS thread (one core).")
    process = executors.get("process")
    if process is not None and "thread" in executors:
        speedup = process["phases"]["modify"]["speedup_vs_thread"]["median"]
        notes.append(
            f"modify, process vs thread: {speedup:.2f}x (project goals: >= "
            f"{0.9 * ideal:.2f}x on a GIL-bound edit such as pyscore; >= "
            f"{1 / 1.2:.2f}x, i.e. within 1.2x, on overhead-dominated edits)."
        )
    notes += _rounds_note(point)
    notes += _auto_notes(executors)
    notes += _memory_note(point)
    for name, ex in executors.items():
        config = (
            ex["phases"]["modify"]["reports"][0].get("metrics", {}).get("config", {})
        )
        if "executor_chosen" in config:
            notes.append(
                f"{name} modify ran on {config['executor_chosen']}: "
                f"{config['executor_reason']}."
            )
    arena = next(iter(executors.values())).get("arena_bytes", 0)
    if arena:
        fill = statistics.median(
            ex["arena_fill_s"]["median"] for ex in executors.values()
        )
        notes.append(
            f"store arena: {_bytes(arena)} of chunk files written in {fill:.1f} s "
            "per run before the phases (not in their wall time), for the "
            "phases' writes to reuse; each process keeps them mapped, a "
            "worker from the pool's start (in its time) (--arena GIB; 0: none)."
        )
    if process is not None:
        during = sum(
            (process["phases"][p]["pool_start_s"] or {"median": 0.0})["median"]
            for p in _LATENCY
        )
        notes.append(
            f"pool start: {process['pool_start_s']['median']:.3f} s before the "
            f"phases (not in their wall time); {during:.3f} s of restarts "
            "during the phases."
        )
    return notes


def _agreement(point: dict[str, Any]) -> list[str]:
    """The edit's agreement with the uncompressed run, where measured."""
    measured = point.get("agreement")
    if not measured:
        return []
    cfg = point["config"]
    engine = cfg.get("engine", TOY)
    model = (
        "the toy model: random weights, so it says little of a trained one"
        if engine == TOY
        else engine
    )
    return [
        f"AGREEMENT with the uncompressed run ({model}): top-1 "
        f"{measured['top1']:.3f}, KL {measured['kl']:.3f} nats over "
        f"{measured['positions']:.0f} positions ({cfg['streams']} streams x "
        f"{cfg['max_tokens']} tokens of its greedy continuation, "
        "teacher-forced after the edited cache; 1 and 0 would mean the edit "
        "changed nothing the model predicts)."
    ]


def format_point(point: dict[str, Any]) -> str:
    """Render one point: the edit, the comparison table, the notes.

    Args:
        point: One element of the result's ``points``.

    Returns:
        The text, without a trailing newline.
    """
    table = tabulate(
        _rows(point), headers=_HEADERS, tablefmt="simple", disable_numparse=True
    )
    notes = [*_agreement(point), *_notes(point)]
    before = _first(point, "modify", "tokens_before")
    if before == _first(point, "modify", "tokens_after"):
        notes.append(
            f"note: {point['edit']} keeps the token ids: its KV replaces the "
            "cached chunks of the same tokens (store(..., overwrite=True)), so "
            "decode reads the edited KV."
        )
    return "\n".join([_edit_line(point), table, *notes])
