"""The machinery under :class:`~lmcache_mp.batch.LMCacheBatchedStream`:
selecting streams, running one phase on the executor, committing what
succeeded and re-pinning the committed KV, and the modify phase's report.

The public class keeps the API (registry, upstream's phases, lifecycle);
this base holds the private steps they share, so each module stays small.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

from lmcache_mp._core.commit import commit, drop_staged, raise_failures
from lmcache_mp._core.memory import modify_bound
from lmcache_mp._core.phase import build_phase, check_stores
from lmcache_mp._core.pinning import pin_stream
from lmcache_mp._core.records import ModifyFn, StreamModifyMetrics, StreamPerfMetrics
from lmcache_mp._core.reports import ExecutorInfo, modify_report
from lmcache_mp._core.streambase import StreamBase
from lmcache_mp._core.validate import select_streams
from lmcache_mp.errors import LMCacheBatchedStreamError
from lmcache_mp.executors import PhaseExecutor, PhaseRun
from lmcache_mp.kv._pins import PinOwner
from lmcache_mp.metrics import Metrics, get_formatter

__all__ = ["BatchCore"]


class BatchCore:
    """The state a batch keeps and the steps every phase takes.

    Attributes:
        streams: Member streams keyed by stream id.
        perf_metrics: Latest prefill/decode figures per stream id.
        modify_metrics: Latest modify figures per stream id.
    """

    streams: dict[str, StreamBase]
    perf_metrics: dict[str, StreamPerfMetrics]
    modify_metrics: dict[str, StreamModifyMetrics]
    _array: str | None
    _executor: PhaseExecutor
    _max_in_flight: int | None
    _phase_timeout: float | None
    _last_run: PhaseRun | None
    _lock: threading.Lock
    _closed: bool
    _pins: PinOwner
    _pinned: dict[int, Any]

    def _select(self, stream_ids: Sequence[str] | None) -> list[str]:
        if self._closed:
            raise LMCacheBatchedStreamError("the batch is closed")
        return select_streams(self.streams, stream_ids)

    # -- running a phase ---------------------------------------------------------

    def _run(
        self, ids: list[str], phase_timeout: float | None, **spec_args: Any
    ) -> tuple[float, dict[str, BaseException]]:
        """Run a phase over ``ids``; commit the successes; return failures."""
        for sid in ids:
            self.streams[sid].state.pin = self._pins
        spec, jobs = build_phase([self.streams[sid] for sid in ids], **spec_args)
        check_stores(spec, jobs)
        max_in_flight = self._modify_bound(ids) if spec.kind == "modify" else None
        streams = [self.streams[sid] for sid in ids]
        with self._lock:
            start = time.perf_counter()
            try:
                run = self._executor.run(
                    spec,
                    jobs,
                    timeout=self._phase_timeout
                    if phase_timeout is None
                    else phase_timeout,
                    max_in_flight=max_in_flight,
                )
            except BaseException:
                # Interrupted (Ctrl-C): nothing commits, so no edit staged
                # for this phase may stay behind in the stores.
                drop_staged(streams, self._pins)
                raise
            duration = time.perf_counter() - start
            # Under the lock: another phase of this batch stages under the
            # same lease, and the commit sweeps the lease's leftovers.
            self._last_run = run
            failures = commit(
                streams, run, self.perf_metrics, self.modify_metrics, self._pins
            )
        for sid in ids:
            # Exactly the committed tokens' KV: what a phase wrote for a
            # stream that failed, or for tokens it no longer has, is let go.
            pin_stream(self.streams[sid], self._pins, self._pinned)
        return duration, failures

    def _modify_bound(self, ids: list[str]) -> int | None:
        """How many streams may hold their KV in memory at once."""
        if self._max_in_flight is not None:
            return self._max_in_flight
        return modify_bound([self.streams[sid] for sid in ids])

    def _info(self) -> ExecutorInfo:
        run = self._last_run
        if run is not None and run.executor:
            return ExecutorInfo(
                self._executor.name, run.workers, run.executor, run.reason
            )
        return ExecutorInfo(self._executor.name, self._executor.workers)

    def _modify(
        self,
        fn: ModifyFn,
        stream_ids: list[str] | None,
        timeout: float,
        poll_interval: float,
        phase_timeout: float | None,
        fmt: str = "terminal",
        width: int = 80,
        array: str | None = None,
    ) -> tuple[float, Metrics]:
        if not callable(fn):
            raise TypeError(f"modify fn must be callable, got {type(fn).__name__}")
        get_formatter(fmt, width=width)  # a bad fmt/width fails before any run
        ids = self._select(stream_ids)
        self.modify_metrics.clear()
        duration, failures = 0.0, dict[str, BaseException]()
        if ids:
            duration, failures = self._run(
                ids,
                phase_timeout,
                kind="modify",
                fn=fn,
                retrieve_timeout=timeout,
                poll_interval=poll_interval,
                array=self._array if array is None else array,
            )
        metrics = modify_report(
            duration,
            [self.modify_metrics[s] for s in ids if s in self.modify_metrics],
            fmt=fmt,
            width=width,
            info=self._info(),
            num_streams=len(ids),
            failed=len(failures),
            run=self._last_run if ids else None,
        )
        raise_failures("modify", ids, failures, metrics)
        return duration, metrics
