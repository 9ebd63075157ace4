"""The reports a batch phase returns, built from per-stream figures.

Keys that upstream code reads are kept: ``config.num_streams``,
``results.duration``, ``results.input_tokens``, ``results.input_tput``,
``results.output_tokens`` and ``results.output_tput``. The rest (latency
percentiles, cache hits, transport) are what upstream's docstrings promise
but never report.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lmcache_mp._core.records import StreamModifyMetrics, StreamPerfMetrics
from lmcache_mp.executors import PhaseRun
from lmcache_mp.metrics import Metrics, StreamHandler, get_formatter, summarize

__all__ = ["ExecutorInfo", "Rounds", "generate_report", "modify_report"]


@dataclass(frozen=True)
class ExecutorInfo:
    """Which executor ran a phase, for the report's config section.

    Args:
        name: The batch's executor.
        workers: Workers or threads that ran the phase.
        chosen: What ``"auto"`` chose for the phase (``""`` otherwise).
        reason: Why it chose it.
    """

    name: str
    workers: int
    chosen: str = ""
    reason: str = ""


def _new_report(
    title: str, fmt: str, width: int, info: ExecutorInfo, num_streams: int
) -> Metrics:
    metrics = Metrics(title=title)
    metrics.add_handler(StreamHandler(get_formatter(fmt, width=width)))
    config = metrics.add_section("config", "Configuration")
    config.add("num_streams", "Number of Streams", num_streams)
    config.add("executor", "Executor", info.name)
    config.add("workers", "Workers", info.workers)
    if info.chosen:
        config.add("executor_chosen", "Chosen Executor", info.chosen)
        config.add("executor_reason", "Chosen Because", info.reason)
    return metrics


def _ms(values: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    return {k: v * 1000.0 for k, v in summarize(values, percentiles).items()}


def _add_transport(metrics: Metrics, run: PhaseRun | None) -> None:
    if run is None:
        return
    section = metrics.add_section("transport", "Transport")
    section.add("pickled_bytes_sent", "Bytes Pickled to Workers", run.bytes_sent)
    section.add("pickled_bytes_received", "Bytes Pickled Back", run.bytes_received)
    section.add("pool_start_s", "Pool Start-up (s)", run.pool_start_s)
    section.add("pool_rebuilds", "Pool Rebuilds", run.pool_rebuilds)


def generate_report(
    mode: str,
    duration: float,
    perf: Sequence[StreamPerfMetrics],
    *,
    fmt: str,
    width: int,
    info: ExecutorInfo,
    num_streams: int,
    failed: int,
    run: PhaseRun | None,
) -> Metrics:
    """Build the report of a prefill or decode phase.

    Args:
        mode: ``"prefill"`` (input tokens, TTFT) or ``"decode"`` (output
            tokens, TTFT, TPOT, per-stream decode speed).
        duration: Wall-clock seconds of the phase.
        perf: The figures of the streams that succeeded.
        fmt: Formatter name for ``emit()``.
        width: Width for the terminal formatter.
        info: The executor that ran it.
        num_streams: Streams the phase ran.
        failed: Streams that failed.
        run: Transport figures, when a phase just ran.

    Returns:
        The report.
    """
    metrics = _new_report(
        f"Batched Stream Metrics ({mode})", fmt, width, info, num_streams
    )
    results = metrics.add_section("results", "Results")
    results.add("duration", "Total Duration (s)", duration)
    input_tokens = sum(p.input_tokens for p in perf)
    output_tokens = sum(p.output_tokens for p in perf)
    ttft = [p.ttft for p in perf]
    latency = metrics.add_section("latency", "Latency")
    if mode == "prefill":
        results.add("input_tokens", "Total Input Tokens", input_tokens)
        results.add(
            "input_tput",
            "Input Throughput (tokens/s)",
            input_tokens / duration if duration > 0 else 0.0,
        )
        for key, value in _ms(ttft, (50, 90, 99)).items():
            latency.add(f"{key}_ttft_ms", f"{key.capitalize()} TTFT (ms)", value)
    else:
        results.add("output_tokens", "Total Output Tokens", output_tokens)
        results.add(
            "output_tput",
            "Decode Throughput (tokens/s)",
            output_tokens / duration if duration > 0 else 0.0,
        )
        tpot = [t for p in perf for t in p.tpot]
        for key, value in _ms(ttft, (50, 99)).items():
            latency.add(f"{key}_ttft_ms", f"{key.capitalize()} TTFT (ms)", value)
        for key, value in _ms(tpot, (50, 99)).items():
            latency.add(f"{key}_tpot_ms", f"{key.capitalize()} TPOT (ms)", value)
        speeds = [p.output_tput for p in perf]
        for key, value in summarize(speeds, (50,)).items():
            label = f"{key.capitalize()} Per-Stream Decode Speed (tokens/s)"
            latency.add(f"{key}_stream_tput", label, value)
        latency.add(
            "min_stream_tput",
            "Slowest Stream Decode Speed (tokens/s)",
            min(speeds, default=0.0),
        )
    results.add("failed_streams", "Failed Streams", failed)
    reported = [p.cached_tokens for p in perf if p.cached_tokens is not None]
    if reported:
        cache = metrics.add_section("cache", "Prompt Cache")
        cache.add("cache_hit_tokens", "Cache-Hit Tokens", sum(reported))
        cache.add(
            "computed_tokens", "Computed Prompt Tokens", input_tokens - sum(reported)
        )
    _add_transport(metrics, run)
    return metrics


def modify_report(
    duration: float,
    figures: Sequence[StreamModifyMetrics],
    *,
    fmt: str,
    width: int,
    info: ExecutorInfo,
    num_streams: int,
    failed: int,
    run: PhaseRun | None,
) -> Metrics:
    """Build the report of a modify phase.

    Args:
        duration: Wall-clock seconds of the phase.
        figures: The figures of the streams that were modified.
        fmt: Formatter name for ``emit()``.
        width: Width for the terminal formatter.
        info: The executor that ran it.
        num_streams: Streams the phase ran.
        failed: Streams that failed.
        run: Transport figures.

    Returns:
        The report.
    """
    metrics = _new_report(
        "Batched Stream Modify Metrics", fmt, width, info, num_streams
    )
    results = metrics.add_section("results", "Results")
    results.add("duration", "Total Duration (s)", duration)
    results.add("streams_modified", "Streams Modified", len(figures))
    results.add("failed_streams", "Failed Streams", failed)
    results.add("tokens_before", "Tokens Before", sum(f.tokens_before for f in figures))
    results.add("tokens_after", "Tokens After", sum(f.tokens_after for f in figures))
    results.add("kv_bytes_in", "KV Bytes In", sum(f.kv_bytes_in for f in figures))
    results.add("kv_bytes_out", "KV Bytes Out", sum(f.kv_bytes_out for f in figures))
    times = [f.duration for f in figures]
    results.add(
        "p50_stream_modify_ms", "P50 Per-Stream Modify (ms)", _ms(times, (50,))["p50"]
    )
    results.add(
        "max_stream_modify_ms",
        "Max Per-Stream Modify (ms)",
        max(times, default=0.0) * 1000.0,
    )
    # Where a stream's time goes: the store's share is the
    # fixed cost every executor pays; the fn's is the work.
    for key, label in (("retrieve", "Retrieve"), ("fn", "Fn"), ("store", "Store")):
        parts = [getattr(f, f"{key}_s") for f in figures]
        results.add(
            f"p50_stream_{key}_ms",
            f"P50 Per-Stream {label} (ms)",
            _ms(parts, (50,))["p50"],
        )
    _add_transport(metrics, run)
    return metrics


class Rounds:
    """What the rounds of a compressed decode did, summed as one decode.

    Each stream's rounds make one generation: its duration and tokens
    add up, its TTFT is the first round's, and its TPOT takes every gap
    between two tokens, a later round's first token included (the time
    from its request to that token: re-reading the cache and computing
    the uncached tail, not the modify before it).
    """

    def __init__(self) -> None:
        self.decode_s = 0.0
        self.modify_s: list[float] = []
        self.failures: dict[str, BaseException] = {}
        self._perf: dict[str, list[StreamPerfMetrics]] = {}
        self._kv_tokens: dict[str, int] = {}

    def decoded(
        self,
        duration: float,
        perf: dict[str, StreamPerfMetrics],
        failures: dict[str, BaseException],
    ) -> None:
        """Count a decode round: its wall time, each stream's figures."""
        self.decode_s += duration
        for sid, figures in perf.items():
            self._perf.setdefault(sid, []).append(figures)
        self.failures.update(failures)

    def modified(
        self,
        duration: float,
        figures: dict[str, StreamModifyMetrics],
        failures: dict[str, BaseException],
    ) -> None:
        """Count a compression round: its wall time, the KV it left."""
        self.modify_s.append(duration)
        for sid, modified in figures.items():
            self._kv_tokens[sid] = modified.tokens_after
        self.failures.update(failures)

    def per_stream(self) -> dict[str, StreamPerfMetrics]:
        """Each stream's rounds as one generation's figures."""
        merged = {}
        for sid, parts in self._perf.items():
            duration = sum(p.duration for p in parts)
            output = sum(p.output_tokens for p in parts)
            tpot = list(parts[0].tpot)
            for later in parts[1:]:
                # A later round's first token is one more gap between tokens.
                tpot += [later.ttft, *later.tpot]
            first = parts[0]
            merged[sid] = StreamPerfMetrics(
                duration=duration,
                input_tokens=first.input_tokens,
                output_tokens=output,
                input_tput=first.input_tput,
                output_tput=output / duration if duration > 0 else 0.0,
                tpot=tpot,
                ttft=first.ttft,
                cached_tokens=first.cached_tokens,
            )
        return merged

    def report(self, metrics: Metrics) -> None:
        """Add the "Compression" section to a decode report."""
        section = metrics.add_section("compression", "Compression")
        section.add("rounds", "Compression Rounds", len(self.modify_s))
        section.add("modify_s", "Modify Time, All Rounds (s)", sum(self.modify_s))
        for index, seconds in enumerate(self.modify_s, 1):
            section.add(f"round_{index}_modify_s", f"Round {index} Modify (s)", seconds)
        kv = list(self._kv_tokens.values())
        section.add(
            "p50_kv_tokens",
            "P50 KV Tokens After Compression",
            summarize(kv, (50,))["p50"],
        )
        section.add(
            "max_kv_tokens", "Max KV Tokens After Compression", max(kv, default=0)
        )
