"""One benchmark run: one executor, prefill -> modify -> decode, on a fresh store."""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lmcache_mp import request
from lmcache_mp._harness.agreement import Reference, agreement, greedy_reference
from lmcache_mp._harness.progress import ProgressLine
from lmcache_mp._util.paths import shm_root
from lmcache_mp.batch import LMCacheBatchedStream
from lmcache_mp.bench._config import AUTO_UNHINTED, BenchConfig
from lmcache_mp.bench._engines import executor_for, fresh_store_url
from lmcache_mp.bench._monitor import PeakMemory
from lmcache_mp.bench._unhinted import Unhinted
from lmcache_mp.cache_kind import LMCacheSDKCacheKind
from lmcache_mp.edits import KIND_EDITS, Edit
from lmcache_mp.errors import LMCacheBatchedStreamError
from lmcache_mp.executors import (
    AutoExecutor,
    ProcessExecutor,
    limit_blas_while,
    physical_cores,
)
from lmcache_mp.kv import SharedMemoryKVStore, connect, default_capacity
from lmcache_mp.metrics import Metrics
from lmcache_mp.stream import create_request

__all__ = ["PHASES", "PhaseFigures", "RunFigures", "run_once"]

#: The phases, in the order they run.
PHASES = ("prefill", "modify", "decode")
#: Modules each worker imports while the pool starts, so that the first
#: phase does not pay for them (they are what the phases unpickle: the
#: engines, the edits, and the synthetic engine's and auto-unhinted's
#: wrappers, whose package import would otherwise weigh on a short first
#: phase).
_PRELOAD = (
    "lmcache_mp.engine",
    "lmcache_mp.edits",
    "lmcache_mp.bench._synthetic",
    "lmcache_mp.bench._unhinted",
)
#: What a bfloat16 KV adds: ml_dtypes, imported by the first phase that
#: unpickles the store or the synthetic engine in a worker (a noticeable
#: part of a short phase). Under ``auto`` that is the modify phase, the
#: prefill having run on threads, where it would count as auto's overhead.
_PRELOAD_BF16 = ("ml_dtypes",)


@dataclass
class PhaseFigures:
    """What one phase of one run measured.

    Args:
        wall_s: Wall-clock seconds of the phase.
        per_stream_s: Sum of the streams' own durations.
        pickled_bytes: Bytes pickled to and from workers.
        peak_rss_bytes: Peak RSS of the parent plus its descendants.
        report: The phase's report, ``Metrics.to_dict()`` (of the streams
            that succeeded, when some failed).
        failures: Stream id to the error of each stream that failed.
    """

    wall_s: float
    per_stream_s: float
    pickled_bytes: int
    peak_rss_bytes: int
    report: dict[str, Any]
    failures: dict[str, str] = field(default_factory=dict)

    def metric(self, section: str, key: str) -> Any:
        """A value of the report, ``None`` when it has no such entry."""
        return self.report.get("metrics", {}).get(section, {}).get(key)


@dataclass
class RunFigures:
    """What one run of one executor measured.

    Args:
        executor: The executor's name.
        workers: Worker processes or threads it used.
        pool_start_s: Seconds to start the worker pool, before the phases
            (0 for in-process executors).
        phases: Figures per phase name.
        outputs: Each stream's generated token ids, in prompt order.
        agreement: The edit's agreement with the uncompressed run
            (:func:`~lmcache_mp._harness.agreement.agreement`), where it was
            measured.
        arena_bytes: Bytes of the store's arena.
        arena_fill_s: Seconds to connect the store and write its arena,
            before the phases.
    """

    executor: str
    workers: int
    pool_start_s: float
    phases: dict[str, PhaseFigures] = field(default_factory=dict)
    outputs: list[list[int]] = field(default_factory=list)
    agreement: dict[str, float] | None = None
    arena_bytes: int = 0
    arena_fill_s: float = 0.0

    @property
    def peak_rss_bytes(self) -> int:
        """The largest phase peak (the pool start included)."""
        return max((p.peak_rss_bytes for p in self.phases.values()), default=0)


def _transport_bytes(report: dict[str, Any]) -> int:
    transport = report.get("metrics", {}).get("transport", {})
    return int(transport.get("pickled_bytes_sent", 0)) + int(
        transport.get("pickled_bytes_received", 0)
    )


def _workers(batch: LMCacheBatchedStream, config: BenchConfig) -> int:
    if batch.executor.name == "thread":
        return config.workers or config.streams
    return batch.executor.workers


def run_once(
    config: BenchConfig,
    executor: str,
    edit: Edit,
    *,
    progress: bool | None = None,
    measure_agreement: bool = False,
) -> RunFigures:
    """Run prefill -> modify -> decode on one executor, on a fresh store.

    The store is new, so the prefill computes every prompt token; the
    engine's weights depend only on the config, so every executor decodes
    the same model. Decoding is greedy (temperature 0) and ignores EOS, so
    every stream decodes exactly ``max_tokens`` tokens and the outputs are
    comparable across executors. With ``config.every``, the decode phase
    compresses with ``edit`` every ``every`` tokens, on the same executor,
    and its time includes those rounds.

    Args:
        config: The benchmark (one sweep point of it).
        executor: A name of :data:`BENCH_EXECUTORS` (``auto-unhinted``
            runs ``auto`` on an unhinted copy of ``edit``).
        edit: The modify fn.
        progress: Draw a progress line on stderr (``None``: when it is a
            TTY; ``False``: never).
        measure_agreement: Also measure the edit's agreement with the
            uncompressed run, on an engine that scores (a trained or the
            toy model): between prefill and modify, each prompt's greedy
            continuation of ``max_tokens`` is decoded in this process;
            after modify, it is scored after the edited cache. Neither
            step is in a phase's time.

    Returns:
        The run's figures; a phase in which streams failed has their errors
        in its ``failures`` and the others' figures.

    Raises:
        LMCacheBatchedStreamError: If a phase failed as a whole.
    """
    # An edit scored with queries gets 0.5.6 streams with a
    # QUERY context, whose queries the engine records during the prefill.
    edit_name = getattr(edit, "name", None)
    scored = edit_name in KIND_EDITS
    arena = config.run_arena_bytes(default_capacity(shm_root()), edit_name)
    begin = time.perf_counter()
    store = connect(
        None if config.store is None else fresh_store_url(config.store),
        chunk_size=config.chunk_size,
        layers=config.layers,
        width=config.width,
        dtype=config.dtype,
        arena_bytes=arena,
    )
    arena_fill_s = time.perf_counter() - begin
    query_ctx = store.for_kind(LMCacheSDKCacheKind.QUERY) if scored else None
    fn: Any = edit
    if executor == AUTO_UNHINTED:
        fn = Unhinted(edit)
    try:
        engine = config.make_engine(store, query_ctx)
        # A trained model loads in each worker as the pool starts, not in
        # the first phase.
        load = getattr(engine, "load", None)
        with (
            executor_for(
                "auto" if executor == AUTO_UNHINTED else executor,
                config.workers,
                config.scheduler,
                config.ray_address,
            ) as (arg, start_s),
            LMCacheBatchedStream(
                arg,
                max_workers=config.workers,
                mp_context=config.start_method,
                preload=(
                    *_PRELOAD,
                    *(_PRELOAD_BF16 if config.dtype == "bfloat16" else ()),
                    *(() if load is None else (load,)),
                    # Each worker maps the store's arena and touches its
                    # retrieve buffers as the pool starts, not in its first
                    # phase.
                    *_arena_mapping(store, config.prompt_tokens),
                ),
            ) as batch,
        ):
            for prompt in config.prompts():
                batch.add(
                    create_request(store, engine, prompt)
                    if query_ctx is None
                    else request.create_request([store, query_ctx], engine, prompt)
                )
            # The serial run is the one-core baseline: like every stream of
            # the other executors, it gets one BLAS thread (cores // cores).
            cap: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
            if executor == "serial":
                cap = limit_blas_while(physical_cores())
            scorer = engine if measure_agreement and hasattr(engine, "score") else None
            with cap:
                run = _run_phases(
                    config, batch, executor, fn, progress, start_s, scorer
                )
                run.arena_bytes, run.arena_fill_s = arena, arena_fill_s
                return run
    finally:
        store.destroy()


def _arena_mapping(store: object, tokens: int) -> tuple[Callable[[], int], ...]:
    """What a worker calls at start to map ``store``'s arena, if it has one,
    and touch its buffers for retrieving a prompt of ``tokens``."""
    if not isinstance(store, SharedMemoryKVStore):
        return ()
    return (functools.partial(store.map_arena, reserve_tokens=tokens),)


def _run_phases(
    config: BenchConfig,
    batch: LMCacheBatchedStream,
    name: str,
    edit: Any,
    progress: bool | None,
    start_s: float,
    scorer: Any,
) -> RunFigures:
    greedy = {"temperature": 0.0}
    decode_params = {"max_tokens": config.max_tokens, "ignore_eos": True, **greedy}
    calls: dict[str, Callable[[], Metrics]] = {
        "prefill": lambda: batch.prefill(greedy),
        # numpy for every stream: the ready-made edits compute in numpy, and
        # a 0.5.6 stream's default (torch) would time torch's import.
        "modify": lambda: batch.modify(edit, array="numpy"),
        "decode": lambda: (
            batch.decode(decode_params)
            if config.every is None
            else batch.decode(
                decode_params, compress=edit, every=config.every, array="numpy"
            )
        ),
    }
    reference: Reference | None = None
    with PeakMemory() as memory:
        executor = batch.executor
        pool = executor.process if isinstance(executor, AutoExecutor) else executor
        if isinstance(pool, ProcessExecutor):
            with ProgressLine(f"[{name}] pool start", enabled=progress):
                start_s = pool.start(config.streams)
        memory.reset()
        run = RunFigures(name, _workers(batch, config), start_s)
        for phase in PHASES:
            with ProgressLine(f"[{name}] {phase}", enabled=progress):
                begin = time.perf_counter()
                failures: dict[str, str] = {}
                try:
                    metrics = calls[phase]()
                except LMCacheBatchedStreamError as exc:
                    # Streams that failed (KV evicted from a full
                    # store) are reported with the figures of the others;
                    # the run goes on, so the table shows what happened.
                    if exc.metrics is None:
                        raise
                    metrics = exc.metrics
                    failures = {sid: str(err) for sid, err in exc.failures.items()}
                wall = time.perf_counter() - begin
            if scorer is not None and phase == "prefill":
                with ProgressLine(f"[{name}] reference", enabled=progress):
                    # Each stream's sequence now: its prompt and first token.
                    sequences = [list(s.state.tokens) for s in batch.streams.values()]
                    reference = greedy_reference(scorer, sequences, config.max_tokens)
            if reference is not None and phase == "modify":
                with ProgressLine(f"[{name}] agreement", enabled=progress):
                    run.agreement = agreement(scorer, _contexts(batch), reference)
            report = metrics.to_dict()
            if phase == "modify":
                per_stream = sum(m.duration for m in batch.modify_metrics.values())
            else:
                per_stream = sum(p.duration for p in batch.perf_metrics.values())
            run.phases[phase] = PhaseFigures(
                wall,
                per_stream,
                _transport_bytes(report),
                memory.reset(),
                report,
                failures,
            )
    run.outputs = [list(s.state.output_ids) for s in batch.streams.values()]
    return run


def _contexts(batch: LMCacheBatchedStream) -> list[list[int]]:
    """What each stream sends next: its tokens, then its pending suffix."""
    return [list(s.state.tokens) + list(s.state.suffix) for s in batch.streams.values()]
