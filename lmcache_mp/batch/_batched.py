"""The :class:`LMCacheBatchedStream`: its registry, its phases, its lifecycle."""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Sequence
from concurrent.futures import Executor
from types import TracebackType
from typing import Any

from lmcache_mp._core.phase import build_phase, check_stores
from lmcache_mp._core.records import ModifyFn, StreamModifyMetrics, StreamPerfMetrics
from lmcache_mp._core.streambase import StreamBase
from lmcache_mp._core.validate import check_max_tokens, select_streams
from lmcache_mp._util.arrays import check_array_type
from lmcache_mp.batch._commit import commit, drop_staged, raise_failures
from lmcache_mp.batch._memory import modify_bound
from lmcache_mp.batch._pinning import pin_stream, release, unpin_stream
from lmcache_mp.batch._reports import (
    ExecutorInfo,
    Rounds,
    generate_report,
    modify_report,
)
from lmcache_mp.errors import LMCacheBatchedStreamError
from lmcache_mp.executors import PhaseExecutor, PhaseRun, Preload, make_executor
from lmcache_mp.kv import DEFAULT_LEASE_S, PinOwner
from lmcache_mp.metrics import Metrics, get_formatter

__all__ = ["LMCacheBatchedStream"]


class LMCacheBatchedStream:
    """A collection of streams run together, one phase at a time.

    Args:
        executor: ``"process"`` (default: a persistent pool of worker
            processes, so CPU-heavy edits use every core), ``"auto"``
            (threads or that pool, chosen per phase from the engine and
            from the first stream of each new modify fn; the report says
            which and why), ``"thread"`` (one thread per stream,
            upstream's design), ``"serial"``, a
            ``concurrent.futures.Executor`` the caller owns (not shut down
            by :meth:`close`), a ``distributed.Client`` or
            ``"dask://HOST:PORT"`` (Dask tasks), or ``"ray"`` /
            ``"ray://HOST:PORT"`` (Ray tasks, on the runtime this process
            has initialised or a new one); see the README's "Scaling out".
        max_workers: Worker processes (``"process"``; default: physical
            cores, at most the number of streams) or threads (``"thread"``;
            default: one per stream).
        mp_context: Start method for ``"process"``: ``"spawn"`` (default),
            ``"forkserver"`` or ``"fork"``.
        preload: Modules each worker imports once at start, and
            callables each calls then (``"process"``), e.g. an
            :class:`~lmcache_mp.engine.HFEngine`'s ``load`` so that every
            worker loads the model as it starts, once.
        blas_threads: BLAS threads per worker (default: cores // workers).
        max_in_flight: Streams whose KV may be in memory at once during a
            modify (default: as many as fit in half the available memory).
        phase_timeout: Default time limit of a phase in seconds
            (``None``: no limit). ``timeout`` is upstream's name for how
            long a modify waits for each stream's KV.
        array: What modify fns are handed: ``"numpy"`` arrays or
            ``"torch"`` CPU tensors sharing their memory, so that torch fns
            run unchanged; a fn may return either. Default:
            numpy for :mod:`lmcache_mp.stream` streams, torch (where
            installed) for :mod:`lmcache_mp.request` ones, as upstream
            0.5.6 hands its fns torch tensors.
        pin_lease: Seconds the member streams' KV stays pinned in a store
            that expires pins (Redis) if the batch stops renewing them (its
            process died); each phase renews them.

    Upstream 0.5.6's names (``request_streams``, ``get_request_stream``,
    ``run_request_streams``, ``modify_request_streams``) are the same
    registry and phases, under the names ``lmcache==0.5.6`` gave the seed's
    ``streams``/``get_stream``/``run_streams``/``modify_stream``; streams of
    either API can be added.

    Attributes:
        streams: Member streams keyed by stream id.
        perf_metrics: Latest :class:`StreamPerfMetrics` per stream id,
            replaced by every prefill/decode.
        modify_metrics: Latest :class:`StreamModifyMetrics` per stream id,
            replaced by every modify; ``.info`` holds what the fn reported.
        round_metrics: With ``decode(compress=...)``, each compression
            round's :class:`StreamModifyMetrics` per stream id, in order.

    Raises:
        ValueError: For an unknown executor, start method or array type.
        ImportError: For ``array="torch"`` without torch installed.
    """

    def __init__(
        self,
        executor: str | Executor | PhaseExecutor | Any = "process",
        *,
        max_workers: int | None = None,
        mp_context: str = "spawn",
        preload: Sequence[Preload] = (),
        blas_threads: int | None = None,
        max_in_flight: int | None = None,
        phase_timeout: float | None = None,
        array: str | None = None,
        pin_lease: float = DEFAULT_LEASE_S,
    ) -> None:
        if array is not None:
            check_array_type(array)
        self._array = array
        self.streams: dict[str, StreamBase] = {}
        self.perf_metrics: dict[str, StreamPerfMetrics] = {}
        self.modify_metrics: dict[str, StreamModifyMetrics] = {}
        self.round_metrics: list[dict[str, StreamModifyMetrics]] = []
        self._executor = make_executor(
            executor, max_workers, mp_context, preload, blas_threads
        )
        self._max_in_flight = max_in_flight
        self._phase_timeout = phase_timeout
        self._last_run: PhaseRun | None = None
        self._lock = threading.Lock()
        self._closed = False
        # The member streams' KV is pinned in their stores under this owner
        # until the batch closes.
        self._pins = PinOwner.new(pin_lease)
        self._pinned: dict[int, Any] = {}
        # Stops the workers and releases the pins when an unclosed batch is
        # collected or at exit.
        self._finalizer = weakref.finalize(
            self, release, self._executor, self._pinned, self._pins
        )

    # -- running a phase ---------------------------------------------------------

    def _select(self, stream_ids: Sequence[str] | None) -> list[str]:
        if self._closed:
            raise LMCacheBatchedStreamError("the batch is closed")
        return select_streams(self.streams, stream_ids)

    def _run_modify(
        self,
        ids: list[str],
        fn: ModifyFn,
        phase_timeout: float | None,
        timeout: float,
        poll_interval: float,
        array: str | None,
        skip_unchanged: bool = False,
    ) -> tuple[float, dict[str, BaseException]]:
        """Run a modify phase of ``fn`` over ``ids`` (:meth:`_run`)."""
        return self._run(
            ids,
            phase_timeout,
            kind="modify",
            fn=fn,
            retrieve_timeout=timeout,
            poll_interval=poll_interval,
            array=self._array if array is None else array,
            skip_unchanged=skip_unchanged,
        )

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
            for stream in streams:
                # Exactly the committed tokens' KV: what a phase wrote for a
                # stream that failed, or for tokens it no longer has, is let
                # go.
                pin_stream(stream, self._pins, self._pinned)
        return duration, failures

    def _modify_bound(self, ids: list[str]) -> int | None:
        """How many streams may hold their KV in memory at once."""
        if self._max_in_flight is not None:
            return self._max_in_flight
        return modify_bound([self.streams[sid] for sid in ids])

    def _info(self) -> ExecutorInfo:
        run = self._last_run
        if run is None:
            return ExecutorInfo(self._executor.name, self._executor.workers)
        return ExecutorInfo(
            self._executor.name,
            run.workers or self._executor.workers,
            run.executor,
            run.reason,
        )

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
            duration, failures = self._run_modify(
                ids, fn, phase_timeout, timeout, poll_interval, array
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

    # -- registry --------------------------------------------------------------

    def add(self, stream: StreamBase) -> None:
        """Add a stream to the batch, keyed by its stream id.

        Args:
            stream: The stream to add.

        Raises:
            LMCacheBatchedStreamError: If the batch is closed, a stream with
                that id is in the batch, or ``stream`` is not a stream
                (``LMCacheStream`` or ``LMCacheRequestStream``).
        """
        if not isinstance(stream, StreamBase):
            raise LMCacheBatchedStreamError(
                "add() takes an LMCacheStream or LMCacheRequestStream, got "
                f"{type(stream).__name__}"
            )
        sid = stream._stream_id
        if self._closed:
            raise LMCacheBatchedStreamError(
                f"the batch is closed: cannot add stream {sid}"
            )
        if sid in self.streams:
            raise LMCacheBatchedStreamError(f"stream {sid} is already in the batch")
        pin_stream(stream, self._pins, self._pinned)
        self.streams[sid] = stream

    def remove(self, stream_id: str) -> StreamBase:
        """Take a stream out of the batch and return it.

        The batch's pins on its KV are released, so that the store may
        evict it like any chunk no one pins (a batch that keeps adding
        streams, as an eval does, would otherwise hold every one's KV);
        no later phase runs it, and its state is as the last phase left
        it.

        Args:
            stream_id: The stream's id.

        Returns:
            The stream.

        Raises:
            LMCacheBatchedStreamError: If no stream has that id.
            KVStoreError: If a store cannot remove the pin.
        """
        stream = self.get_stream(stream_id)
        # Under the lock: a phase running on another thread snapshots the
        # streams it runs, and commits to them.
        with self._lock:
            del self.streams[stream_id]
            unpin_stream(stream, self._pins)
        return stream

    def get_stream(self, stream_id: str) -> StreamBase:
        """Return the stream registered under ``stream_id``.

        Raises:
            LMCacheBatchedStreamError: If no stream has that id.
        """
        if stream_id not in self.streams:
            raise LMCacheBatchedStreamError(f"stream {stream_id} is not in the batch")
        return self.streams[stream_id]

    @property
    def executor(self) -> PhaseExecutor:
        """The executor that runs the phases."""
        return self._executor

    # -- upstream's lower-level API ----------------------------------------------

    def run_streams(
        self,
        sampling_params: dict[str, Any],
        stream_ids: list[str] | None = None,
        *,
        phase_timeout: float | None = None,
    ) -> float:
        """Run ``generate(sampling_params)`` on every selected stream at once.

        Every request is in flight at the same time, as upstream's thread
        per stream, whatever the executor's worker count. Each stream's
        :class:`StreamPerfMetrics` lands in :attr:`perf_metrics`.

        Args:
            sampling_params: Engine sampling params for every stream.
            stream_ids: Streams to run; ``None`` means all.
            phase_timeout: Time limit of the phase in seconds (default:
                the batch's).

        Returns:
            Wall-clock duration in seconds (0.0 when nothing was selected).

        Raises:
            LMCacheBatchedStreamError: For an unknown stream id, or when
                streams failed (the others committed; ``.failures`` maps
                each failed id to its exception).
        """
        duration, _ = self._generate(
            "decode", sampling_params, stream_ids, phase_timeout
        )
        return duration

    def _generate(
        self,
        mode: str,
        sampling_params: dict[str, Any],
        stream_ids: list[str] | None,
        phase_timeout: float | None,
        fmt: str = "terminal",
        width: int = 80,
    ) -> tuple[float, Metrics]:
        get_formatter(fmt, width=width)  # a bad fmt/width fails before any run
        ids = self._select(stream_ids)
        self.perf_metrics.clear()
        if not ids:
            return 0.0, self.get_perf_metrics(0.0, fmt, width, mode, ids)
        duration, failures = self._run(
            ids,
            phase_timeout,
            kind="generate",
            sampling_params=dict(sampling_params),
        )
        metrics = self.get_perf_metrics(duration, fmt, width, mode, ids)
        raise_failures(mode, ids, failures, metrics)
        return duration, metrics

    def modify_stream(
        self,
        fn: ModifyFn,
        stream_ids: list[str] | None = None,
        timeout: float = 30.0,
        poll_interval: float = 0.2,
        *,
        phase_timeout: float | None = None,
    ) -> float:
        """Apply ``fn`` to every selected stream's KV (``modify_kv``).

        Args:
            fn: ``fn(kv, tokens) -> (new_kv, new_tokens[, info])``.
            stream_ids: Streams to modify; ``None`` means all.
            timeout: Seconds each stream waits for its cached KV (upstream's
                meaning of ``timeout``, here and in :meth:`modify`).
            poll_interval: Seconds between retrieve attempts.
            phase_timeout: Time limit of the phase in seconds (default:
                the batch's).

        Returns:
            Wall-clock duration in seconds (0.0 when nothing was selected).

        Raises:
            LMCachePicklingError: If ``fn`` cannot be sent to the workers;
                no stream is touched.
            LMCacheBatchedStreamError: For an unknown stream id, or when
                streams failed (the others committed).
        """
        duration, _ = self._modify(
            fn, stream_ids, timeout, poll_interval, phase_timeout
        )
        return duration

    def get_perf_metrics(
        self,
        duration: float,
        fmt: str,
        width: int,
        mode: str,
        stream_ids: list[str] | None = None,
    ) -> Metrics:
        """Aggregate the stored per-stream figures into a report.

        Args:
            duration: Phase wall-clock seconds, for throughput.
            fmt: Formatter for ``emit()``: ``"terminal"``, ``"json"`` or
                ``"markdown"``.
            width: Width for the terminal formatter.
            mode: ``"prefill"`` or ``"decode"``.
            stream_ids: Streams to include; ``None`` means all.

        Returns:
            The report.

        Raises:
            LMCacheBatchedStreamError: If ``mode`` is not prefill/decode.
            ValueError: If ``fmt`` is not a known format.
        """
        if mode not in ("prefill", "decode"):
            raise LMCacheBatchedStreamError(
                f"invalid mode {mode!r}; choose 'prefill' or 'decode'"
            )
        ids = list(self.streams) if stream_ids is None else list(stream_ids)
        for sid in ids:
            if sid not in self.streams:
                raise LMCacheBatchedStreamError(f"stream {sid} is not in the batch")
        perf = [self.perf_metrics[s] for s in ids if s in self.perf_metrics]
        return generate_report(
            mode,
            duration,
            perf,
            fmt=fmt,
            width=width,
            info=self._info(),
            num_streams=len(ids),
            failed=len(ids) - len(perf),
            run=self._last_run if ids else None,
        )

    # -- upstream's three phases -------------------------------------------------

    def prefill(
        self,
        sampling_params: dict[str, Any],
        fmt: str = "terminal",
        width: int = 80,
        stream_ids: list[str] | None = None,
        *,
        phase_timeout: float | None = None,
    ) -> Metrics:
        """Prefill every selected stream once (``max_tokens`` forced to 1).

        Args:
            sampling_params: Engine sampling params; not mutated.
            fmt: Formatter for ``emit()``.
            width: Width for the terminal formatter.
            stream_ids: Streams to run; ``None`` means all.
            phase_timeout: Time limit of the phase in seconds (default:
                the batch's).

        Returns:
            The prefill report (input tokens and throughput, TTFT).

        Raises:
            LMCacheBatchedStreamError: As :meth:`run_streams`; its
                ``.metrics`` holds the report of the streams that succeeded.
        """
        params = {**sampling_params, "max_tokens": 1}
        return self._generate("prefill", params, stream_ids, phase_timeout, fmt, width)[
            1
        ]

    def modify(
        self,
        fn: ModifyFn,
        fmt: str = "terminal",
        width: int = 80,
        stream_ids: list[str] | None = None,
        *,
        timeout: float = 30.0,
        poll_interval: float = 0.2,
        phase_timeout: float | None = None,
        array: str | None = None,
    ) -> Metrics:
        """Apply a KV edit to every selected stream and report it.

        Args:
            fn: ``fn(kv, tokens) -> (new_kv, new_tokens[, info])``; any
                callable cloudpickle can ship (lambdas and closures too).
            fmt: Formatter for ``emit()``.
            width: Width for the terminal formatter.
            stream_ids: Streams to modify; ``None`` means all.
            timeout: Seconds each stream waits for its cached KV, as in
                upstream 0.5.6's ``modify`` and every ``modify_*``.
            poll_interval: Seconds between retrieve attempts.
            phase_timeout: Time limit of the phase in seconds (default:
                the batch's).
            array: What the fn is handed for this phase, ``"numpy"`` or
                ``"torch"`` (default: the batch's).

        Returns:
            The modify report (duration, tokens and KV bytes before/after,
            per-stream edit time).

        Raises:
            LMCachePicklingError: If ``fn`` cannot be sent to the workers.
            LMCacheBatchedStreamError: As :meth:`modify_stream`.
        """
        if array is not None:
            check_array_type(array)
        return self._modify(
            fn,
            stream_ids,
            timeout,
            poll_interval,
            phase_timeout,
            fmt,
            width,
            array,
        )[1]

    def decode(
        self,
        sampling_params: dict[str, Any],
        fmt: str = "terminal",
        width: int = 80,
        stream_ids: list[str] | None = None,
        *,
        phase_timeout: float | None = None,
        compress: ModifyFn | None = None,
        every: int | None = None,
        timeout: float = 30.0,
        poll_interval: float = 0.2,
        array: str | None = None,
    ) -> Metrics:
        """Decode every selected stream and report it.

        With ``compress``, the generation runs in rounds, as kvpress's
        ``DecodingPress`` compresses every ``compression_interval`` steps:
        every stream decodes ``every`` tokens; then the streams still
        generating (not at EOS) are modified by ``compress`` on the
        batch's executor (it sees the prompt and the tokens generated so
        far, as any modify fn; the engine keeps generated tokens' KV), and
        decoding resumes over the edited cache, until ``max_tokens`` or
        EOS. It is the loop ``decode(every) -> modify(compress) -> ...``
        over the streams not done, written once, but for one case: a
        stream whose cached KV is still all the last round's own (its
        generated tokens have not completed a chunk since) is left as it
        is that round, ``compress`` not called, as there is nothing new to
        compress (and no queries of new tokens to score with). A stream
        whose round fails leaves the loop with its last committed state;
        the others go on.

        Args:
            sampling_params: Engine sampling params (``max_tokens``, ...).
            fmt: Formatter for ``emit()``.
            width: Width for the terminal formatter.
            stream_ids: Streams to run; ``None`` means all.
            phase_timeout: Time limit of each phase in seconds (default:
                the batch's).
            compress: A modify fn to run between rounds, or ``None``.
            every: Tokens each stream decodes per round (with
                ``compress``).
            timeout: As :meth:`modify`, for the rounds' modifies.
            poll_interval: As :meth:`modify`.
            array: As :meth:`modify`.

        Returns:
            The decode report (output tokens and throughput, TTFT, TPOT,
            per-stream decode speed, cache hits), over the whole
            generation; with ``compress``, a "Compression" section too:
            the rounds, their modify seconds, and the KV tokens the
            streams decoded against after the last one. Each round's
            per-stream figures (``info`` included) are in
            :attr:`round_metrics`.

        Raises:
            TypeError: If ``compress`` is not callable.
            ValueError: If ``every`` is not a positive int, or is given
                without ``compress``.
            LMCacheBatchedStreamError: As :meth:`run_streams`; with
                ``compress``, once the generation is over, naming every
                stream whose decode or round failed.
        """
        if compress is None:
            if every is not None:
                raise ValueError("decode(every=...) needs compress=")
            return self._generate(
                "decode", sampling_params, stream_ids, phase_timeout, fmt, width
            )[1]
        if not callable(compress):
            raise TypeError(f"compress must be callable, got {type(compress).__name__}")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"decode(every=...) must be an int >= 1, got {every!r}")
        get_formatter(fmt, width=width)  # a bad fmt/width fails before any run
        ids = self._select(stream_ids)
        # Every stream gets the same params: the first one names a bad value.
        total = check_max_tokens(sampling_params, ids[0]) if ids else 0
        rounds = Rounds()
        active, left = list(ids), total
        self.round_metrics = []
        while active and left > 0:
            step = min(every, left)
            self.perf_metrics.clear()
            duration, failures = self._run(
                active,
                phase_timeout,
                kind="generate",
                sampling_params={**sampling_params, "max_tokens": step},
            )
            rounds.decoded(duration, self.perf_metrics, failures)
            left -= step
            active = [
                s for s in active if s not in failures and not self.streams[s].done
            ]
            if not active or left <= 0:
                break
            self.modify_metrics.clear()
            duration, failures = self._run_modify(
                active,
                compress,
                phase_timeout,
                timeout,
                poll_interval,
                array,
                skip_unchanged=True,
            )
            rounds.modified(duration, self.modify_metrics, failures)
            self.round_metrics.append(dict(self.modify_metrics))
            active = [s for s in active if s not in failures]
        self.perf_metrics.clear()
        self.perf_metrics.update(rounds.per_stream())
        metrics = self.get_perf_metrics(rounds.decode_s, fmt, width, "decode", ids)
        rounds.report(metrics)
        raise_failures("decode", ids, rounds.failures, metrics)
        return metrics

    # -- upstream 0.5.6's names ---------------------------------------------------

    @property
    def request_streams(self) -> dict[str, StreamBase]:
        """Member streams keyed by id: the same dict as ``streams``."""
        return self.streams

    def get_request_stream(self, stream_id: str) -> StreamBase:
        """Return the stream registered under ``stream_id`` (``get_stream``).

        Raises:
            LMCacheBatchedStreamError: If no stream has that id.
        """
        return self.get_stream(stream_id)

    def run_request_streams(
        self,
        sampling_params: dict[str, Any],
        stream_ids: list[str] | None = None,
        *,
        phase_timeout: float | None = None,
    ) -> float:
        """Run ``generate(sampling_params)`` on every selected stream at once
        (``run_streams``).

        Returns:
            Wall-clock duration in seconds (0.0 when nothing was selected).

        Raises:
            LMCacheBatchedStreamError: For an unknown stream id, or when
                streams failed (the others committed).
        """
        return self.run_streams(
            sampling_params, stream_ids, phase_timeout=phase_timeout
        )

    def modify_request_streams(
        self,
        fn: ModifyFn,
        stream_ids: list[str] | None = None,
        timeout: float = 30.0,
        poll_interval: float = 0.2,
        *,
        phase_timeout: float | None = None,
    ) -> float:
        """Apply ``fn`` to every selected stream (``modify_stream``); a 0.5.6
        stream's fn takes ``{kind: tensor}``.

        Returns:
            Wall-clock duration in seconds (0.0 when nothing was selected).

        Raises:
            LMCachePicklingError: If ``fn`` cannot be sent to the workers.
            LMCacheBatchedStreamError: For an unknown stream id, or when
                streams failed (the others committed).
        """
        return self.modify_stream(
            fn, stream_ids, timeout, poll_interval, phase_timeout=phase_timeout
        )

    # -- lifecycle -----------------------------------------------------------------

    def close(self) -> None:
        """Stop the executor's workers (not a caller-owned executor's) and
        release the pins on the member streams' KV."""
        self._closed = True
        self._finalizer()

    def __enter__(self) -> LMCacheBatchedStream:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
