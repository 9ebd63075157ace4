"""``lmcache-mp bench --compare``: one modify, lmcache_mp against its peers.

Every runner edits the same streams' KV (``streams`` x ``[2, layers,
prompt_tokens, width]``, random values from ``seed``) in a fresh embedded
store per repeat, so every repeat writes its chunks anew; only the modify
call is timed (pools and runtimes start before). The runners are
lmcache_mp's executors and the peers of :mod:`lmcache_mp.bench._peers`,
one after the other, each with the machine to itself.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from tabulate import tabulate

from lmcache_mp._core.records import StreamState
from lmcache_mp.batch import LMCacheBatchedStream
from lmcache_mp.bench._config import AUTO_UNHINTED, BenchConfig
from lmcache_mp.bench._monitor import PeakMemory
from lmcache_mp.bench._peers import (
    Item,
    Peer,
    PeerUnavailable,
    make_peer,
    no_engine,
)
from lmcache_mp.bench._unhinted import Unhinted
from lmcache_mp.edits import Edit
from lmcache_mp.executors import AutoExecutor, ProcessExecutor
from lmcache_mp.kv import SharedMemoryKVStore, connect, resolve_dtype
from lmcache_mp.metrics import Metrics
from lmcache_mp.stream import LMCacheStream, create_request

__all__ = ["format_compare", "pool_starts", "run_compare"]

#: The parts of a stream's modify time that lmcache_mp reports.
_PARTS = ("retrieve", "fn", "store")


def pool_starts(preload: Sequence[str] = ("lmcache_mp.edits",)) -> dict[str, float]:
    """Time a forkserver pool's start for a first batch and for the next one.

    The forkserver process outlives the first pool and holds the preloaded
    modules, so a later batch's workers fork from it ready to run. Run
    before any other forkserver pool starts.

    Args:
        preload: Modules the workers preload.

    Returns:
        ``first_s`` and ``next_s``.
    """
    times = []
    for _ in range(2):
        pool = ProcessExecutor(None, "forkserver", preload)
        try:
            times.append(pool.start())
        finally:
            pool.close()
    return {"first_s": times[0], "next_s": times[1]}


def _fill(config: BenchConfig) -> tuple[SharedMemoryKVStore, list[list[int]]]:
    """A fresh store holding every stream's KV."""
    store = connect(
        chunk_size=config.chunk_size,
        layers=config.layers,
        width=config.width,
        dtype=config.dtype,
        capacity_bytes=8 * config.streams * config.prompt_kv_bytes + 2**20,
    )
    rng = np.random.default_rng(config.seed)
    prompts = config.prompts()
    shape = (2, config.layers, config.prompt_tokens, config.width)
    dtype = resolve_dtype(config.dtype)
    for prompt in prompts:
        store.store(rng.standard_normal(shape, np.float32).astype(dtype), prompt)
    return store, prompts


class _Ours(Peer):
    """An lmcache_mp executor as a runner: one batch and pool for every repeat."""

    def __init__(self, name: str, config: BenchConfig) -> None:
        super().__init__(name, 0)
        self._config = config
        self._streams: list[LMCacheStream] = []
        self._reports: list[Metrics] = []

    def start(self) -> None:
        config = self._config
        self._batch = LMCacheBatchedStream(
            "auto" if self.name == AUTO_UNHINTED else self.name,
            max_workers=config.workers,
            mp_context=config.start_method,
            # The unhinted wrapper's package too (as the bench's preload).
            preload=("lmcache_mp.edits", "lmcache_mp.bench._unhinted"),
        )
        executor = self._batch.executor
        pool = executor.process if isinstance(executor, AutoExecutor) else executor
        if isinstance(pool, ProcessExecutor):
            pool.start(config.streams)

    def prepare(self, store: SharedMemoryKVStore, items: Sequence[Item]) -> None:
        if not self._streams:
            self._streams = [create_request(store, no_engine, t) for t, _ in items]
            for stream in self._streams:
                self._batch.add(stream)
        for stream, (tokens, _) in zip(self._streams, items, strict=True):
            stream.ctx, stream.state = store, StreamState(tokens=list(tokens))

    def modify(
        self, store: SharedMemoryKVStore, items: Sequence[Item], edit: Edit
    ) -> list[list[int]]:
        fn: Any = Unhinted(edit) if self.name == AUTO_UNHINTED else edit
        self._reports.append(self._batch.modify(fn))
        return [s.tokens for s in self._streams]

    def close(self) -> None:
        self._batch.close()

    def _metrics(self) -> list[dict[str, Any]]:
        return [report.to_dict()["metrics"] for report in self._reports]

    @property
    def label(self) -> str:
        chosen = self._metrics()[-1]["config"].get("executor_chosen", "")
        return f"lmcache_mp {self.name}" + (f" -> {chosen}" if chosen else "")

    def figures(self) -> dict[str, Any]:
        metrics = self._metrics()
        pickled = [
            m.get("transport", {}).get("pickled_bytes_sent", 0)
            + m.get("transport", {}).get("pickled_bytes_received", 0)
            for m in metrics
        ]
        split = {
            part: statistics.median(
                m["results"][f"p50_stream_{part}_ms"] for m in metrics
            )
            for part in _PARTS
        }
        threads = self.name == "thread"
        return {
            "workers": self._config.streams
            if threads
            else self._batch.executor.workers,
            "pickled_bytes": statistics.median(pickled),
            "stream_p50_ms": split,
        }


def _time(config: BenchConfig, runner: Peer, edit: Edit) -> dict[str, Any]:
    """Time one runner's modify over ``repeat`` fresh stores (start excluded)."""
    walls: list[float] = []
    outputs: list[list[int]] = []
    with PeakMemory() as memory:
        runner.start()
        try:
            for _ in range(config.repeat):
                store, prompts = _fill(config)
                items: list[Item] = [(p, "") for p in prompts]
                try:
                    runner.prepare(store, items)
                    start = time.perf_counter()
                    outputs = runner.modify(store, items, edit)
                    walls.append(time.perf_counter() - start)
                finally:
                    store.destroy()
        finally:
            runner.close()
        peak = memory.reset()
    return {
        "runner": runner.label,
        "wall_s": {
            "median": statistics.median(walls),
            "min": min(walls),
            "max": max(walls),
            "values": walls,
        },
        "peak_rss_bytes": peak,
        "outputs": outputs,
        **runner.figures(),
    }


def run_compare(
    config: BenchConfig, peers: Sequence[str], workers: int
) -> list[dict[str, Any]]:
    """Run every edit of ``config`` on lmcache_mp's executors and the peers.

    Args:
        config: Sizes, edits, executors, repeats.
        peers: Peer names (:data:`~lmcache_mp.bench._peers.PEERS`).
        workers: Worker processes the peers get (lmcache_mp's own default
            is the same: physical cores, at most the streams).

    Returns:
        One JSON-ready dict per edit: ``edit``, ``rows`` (one per runner,
        fastest first, with ``x_fastest`` and ``x_thread``),
        ``outputs_agree`` and ``unavailable`` (peer -> why).
    """
    config = config.with_model_dims()
    points = []
    for name in config.edits:
        edit = config.edit(name)
        rows = [_time(config, _Ours(ex, config), edit) for ex in config.runs]
        unavailable = {}
        for peer in peers:
            try:
                rows.append(_time(config, make_peer(peer, workers), edit))
            except PeerUnavailable as exc:
                unavailable[peer] = str(exc)
        outputs = [row.pop("outputs") for row in rows]
        fastest = min(row["wall_s"]["median"] for row in rows)
        thread = next(
            (r["wall_s"]["median"] for r in rows if r["runner"] == "lmcache_mp thread"),
            None,
        )
        for row in rows:
            wall = row["wall_s"]["median"]
            row["x_fastest"] = wall / fastest
            row["x_thread"] = None if thread is None else thread / wall
        rows.sort(key=lambda r: float(r["wall_s"]["median"]))
        points.append(
            {
                "edit": name,
                "rows": rows,
                "outputs_agree": all(o == outputs[0] for o in outputs),
                "unavailable": unavailable,
            }
        )
    return points


def format_compare(
    config: BenchConfig,
    points: list[dict[str, Any]],
    refs: dict[str, float],
    starts: dict[str, float] | None = None,
) -> str:
    """The comparison as text: the references, then one table per edit."""
    mib = config.prompt_kv_bytes / 2**20
    parts = [
        f"modify only: {config.streams} streams x KV [2, {config.layers}, "
        f"{config.prompt_tokens}, {config.width}] {config.dtype} ({mib:.0f} MiB "
        f"each), median of {config.repeat}, pool/runtime start excluded; "
        f"memcpy {refs['memcpy_gb_s']:.1f} GB/s, pickle {refs['pickle_gb_s']:.1f} GB/s"
    ]
    if starts is not None:
        parts[0] += (
            f"; forkserver pool start {starts['first_s']:.3f} s for a first "
            f"batch, {starts['next_s']:.3f} s for the next"
        )
    for point in points:
        table = [
            [
                row["runner"],
                row["workers"],
                f"{row['wall_s']['median']:.3f}",
                f"{row['wall_s']['min']:.3f}-{row['wall_s']['max']:.3f}",
                f"{row['wall_s']['median'] / config.streams * 1e3:.1f}",
                f"{row['x_fastest']:.2f}",
                "-" if row["x_thread"] is None else f"{row['x_thread']:.2f}x",
                _kib_per_stream(row["pickled_bytes"], config.streams, mib),
                f"{row['peak_rss_bytes'] / 2**20:.0f} MiB",
                _split(row["stream_p50_ms"]),
            ]
            for row in point["rows"]
        ]
        headers = [
            "runner",
            "workers",
            "wall s",
            "min-max",
            "ms/stream",
            "/ fastest",
            "x thread",
            "pickled/stream",
            "peak RSS",
            "retrieve/fn/store ms",
        ]
        lines = [f"edit {point['edit']}", tabulate(table, headers=headers)]
        if not point["outputs_agree"]:
            lines.append("WARNING: the runners' edited tokens differ")
        lines += [
            f"  not run: {peer}: {why}" for peer, why in point["unavailable"].items()
        ]
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


def _kib_per_stream(pickled: float | None, streams: int, kv_mib: float) -> str:
    if pickled is None:
        return f"~{2 * kv_mib:.0f} MiB (KV)"
    return f"{pickled / streams / 1024:.1f} KiB"


def _split(parts: dict[str, float] | None) -> str:
    if parts is None:
        return "-"
    return "/".join(f"{parts[p]:.1f}" for p in _PARTS)
