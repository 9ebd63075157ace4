"""The plain picklable data that crosses between the parent and a worker.

A phase is one ``PhaseSpec`` (what every stream runs) and one ``StreamJob``
per stream (that stream's state); each job comes back as a
``StreamOutcome``. None of these ever holds a KV array: workers read and
write KV through the context, which pickles by location.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from lmcache_mp._core.records import (
    ModifyFn,
    PostCompletion,
    StreamModifyMetrics,
    StreamPerfMetrics,
    StreamState,
)
from lmcache_mp._core.streambase import StreamBase
from lmcache_mp._util.gilwatch import GilProbe
from lmcache_mp.cache_kind import LMCacheSDKCacheKind
from lmcache_mp.errors import KVStoreError, LMCacheBatchedStreamError
from lmcache_mp.kv import KVContext

__all__ = [
    "PhaseKind",
    "PhaseSpec",
    "StreamJob",
    "StreamOutcome",
    "build_phase",
    "check_stores",
]

PhaseKind = Literal["generate", "modify"]


@dataclass(frozen=True)
class PhaseSpec:
    """What every stream of one phase runs.

    Contexts and engines are deduplicated into tables that jobs index, so a
    batch whose streams share one context and one engine ships each once.

    Args:
        kind: ``"generate"`` (prefill/decode) or ``"modify"``.
        contexts: The KV contexts of the phase's streams (``None`` for a
            stream without one, which only generates).
        engines: The ``post_completion`` callables of the phase's streams.
        sampling_params: For ``generate``.
        fn: For ``modify``: the KV editor.
        retrieve_timeout: For ``modify``: seconds to wait for cached KV.
        poll_interval: For ``modify``: seconds between retrieve attempts.
        array: For ``modify``: what the fn is handed, ``"numpy"`` or
            ``"torch"``; ``None``: each stream's default.
        skip_unchanged: For ``modify``: leave a stream whose cached KV is
            all the last modify's own as it is (a compression round).
    """

    kind: PhaseKind
    contexts: tuple[KVContext | None, ...]
    engines: tuple[PostCompletion, ...]
    sampling_params: dict[str, Any] = field(default_factory=dict)
    fn: ModifyFn | None = None
    retrieve_timeout: float = 30.0
    poll_interval: float = 0.2
    array: str | None = None
    skip_unchanged: bool = False


@dataclass
class StreamJob:
    """One stream's share of a phase.

    Args:
        stream_id: The stream's id.
        cache_salt: The stream's salt.
        ctx_index: Index of its context in ``PhaseSpec.contexts``.
        engine_index: Index of its engine in ``PhaseSpec.engines``.
        state: A copy of its state before the phase.
        others: Its other kinds' contexts: ``(kind, index)`` pairs.
        kinds: Whether its modify fn takes ``{kind: tensor}`` (0.5.6).
        measure: Run it under a GIL watch and send the figures back in
            ``StreamOutcome.probe`` (the stream ``executor="auto"``
            measures, wherever it runs).
    """

    stream_id: str
    cache_salt: str
    ctx_index: int
    engine_index: int
    state: StreamState
    others: tuple[tuple[LMCacheSDKCacheKind, int], ...] = ()
    kinds: bool = False
    measure: bool = False

    def context_indices(self) -> tuple[int, ...]:
        """Indices of every context the stream uses, KV first."""
        return (self.ctx_index, *(index for _, index in self.others))


@dataclass
class StreamOutcome:
    """What one job produced: a new state and figures, or an error.

    Args:
        stream_id: The stream's id.
        state: The state to commit, when the job succeeded.
        perf: ``generate`` figures, when it succeeded.
        modify: ``modify`` figures, when it succeeded.
        error: The exception, when it failed.
        traceback: The formatted traceback of ``error`` in the process that
            raised it, when that was a worker.
        staged: A same-token edit staged in the store, to commit with the
            state (``.commit()``) or drop (``.discard()``).
        probe: How the job ran (wall, CPU, GIL-held share), when it was
            measured (``StreamJob.measure``), success or not.
    """

    stream_id: str
    state: StreamState | None = None
    perf: StreamPerfMetrics | None = None
    modify: StreamModifyMetrics | None = None
    error: BaseException | None = None
    traceback: str | None = None
    staged: Any = None
    probe: GilProbe | None = None

    def discard_staged(self) -> None:
        """Drop the staged edit, if any; the cached KV stays as it was."""
        if self.staged is not None:
            with contextlib.suppress(Exception):
                self.staged.discard()
            self.staged = None


def build_phase(
    streams: Sequence[StreamBase], **spec_args: Any
) -> tuple[PhaseSpec, list[StreamJob]]:
    """Snapshot ``streams`` into a phase: one job each, with a state copy.

    Args:
        streams: The streams the phase runs.
        **spec_args: The other :class:`PhaseSpec` fields (``kind``, ...).

    Returns:
        The spec (each distinct context and engine once) and the jobs.
    """
    contexts: dict[int, tuple[int, KVContext | None]] = {}
    engines: dict[int, tuple[int, PostCompletion]] = {}
    jobs = []

    def index(ctx: KVContext | None) -> int:
        return contexts.setdefault(id(ctx), (len(contexts), ctx))[0]

    for s in streams:
        ci = index(s.ctx)
        others = tuple((kind, index(c)) for kind, c in s._others.items())
        pc = s.post_completion
        ei = engines.setdefault(id(pc), (len(engines), pc))[0]
        jobs.append(
            StreamJob(
                s._stream_id,
                s.cache_salt,
                ci,
                ei,
                s.state.copy(),
                others,
                s._kinds,
            )
        )
    spec = PhaseSpec(
        contexts=tuple(c for _, c in contexts.values()),
        engines=tuple(e for _, e in engines.values()),
        **spec_args,
    )
    return spec, jobs


def check_stores(spec: PhaseSpec, jobs: list[StreamJob]) -> None:
    """Fail fast when a networked store is down: ping each
    context that can be pinged before any stream runs, so that a Redis that
    is down or refuses the password is one clear error, not one timeout per
    stream on every worker.

    Raises:
        LMCacheBatchedStreamError: Naming every stream of an unreachable
            store; nothing has run or been committed.
    """
    for index, ctx in enumerate(spec.contexts):
        ping = getattr(ctx, "ping", None)
        if not callable(ping):
            continue
        try:
            ping()
        except KVStoreError as exc:
            sids = [job.stream_id for job in jobs if index in job.context_indices()]
            raise LMCacheBatchedStreamError(
                f"the phase did not start: the KV store of streams "
                f"{', '.join(sids)} is unavailable: {exc}",
                dict.fromkeys(sids, exc),
            ) from exc
