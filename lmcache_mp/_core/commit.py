"""How a phase's outcomes land in the parent's streams (only on success),
and the one error that names the streams that failed."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

from lmcache_mp._core.streambase import StreamBase
from lmcache_mp.errors import (
    LMCacheBatchedStreamError,
    LMCacheStreamError,
    PhaseTimeoutError,
    TerminatedWorkerError,
)
from lmcache_mp.executors import PhaseRun
from lmcache_mp.metrics import Metrics
from lmcache_mp.stream import StreamModifyMetrics, StreamPerfMetrics

__all__ = ["commit", "raise_failures"]

#: Failures whose worker was killed: it may have left temp files behind.
_DEAD_WORKER = (TerminatedWorkerError, PhaseTimeoutError)


def commit(
    streams: Sequence[StreamBase],
    run: PhaseRun,
    perf_metrics: dict[str, StreamPerfMetrics],
    modify_metrics: dict[str, StreamModifyMetrics],
) -> dict[str, BaseException]:
    """Commit each stream whose job succeeded; return the others' errors.

    A stream commits its staged edit (a same-token edit), then its state and
    figures; a failed stream's staged edit is discarded, so it keeps its
    previous state and KV. When a worker was killed, the stores are swept of
    what it left half-written.

    Args:
        streams: The phase's streams.
        run: What the executor produced.
        perf_metrics: Where generate figures go, by stream id.
        modify_metrics: Where modify figures go, by stream id.

    Returns:
        Stream id to the exception of each stream that failed.
    """
    failures: dict[str, BaseException] = {}
    for stream in streams:
        sid = stream._stream_id
        outcome = run.outcomes[sid]
        if outcome.error is not None or outcome.state is None:
            outcome.discard_staged()
            failures[sid] = outcome.error or RuntimeError("no state came back")
            continue
        if outcome.staged is not None:
            try:
                outcome.staged.commit()
            except Exception as exc:
                outcome.discard_staged()
                failures[sid] = LMCacheStreamError(
                    f"stream {sid}: its edit could not be committed to the "
                    f"store: {type(exc).__name__}: {exc}",
                    sid,
                )
                failures[sid].__cause__ = exc
                continue
        stream.state = outcome.state
        if outcome.perf is not None:
            perf_metrics[sid] = outcome.perf
        if outcome.modify is not None:
            modify_metrics[sid] = outcome.modify
    if any(isinstance(e, _DEAD_WORKER) for e in failures.values()):
        _sweep([c for s in streams for c in s.contexts.values()])
    return failures


def _sweep(contexts: list[Any]) -> None:
    """Remove what killed workers left half-written in the stores."""
    for ctx in {id(c): c for c in contexts}.values():
        sweep = getattr(ctx, "sweep", None)
        if sweep is not None:
            with contextlib.suppress(Exception):
                sweep()


def raise_failures(
    phase: str,
    ids: list[str],
    failures: dict[str, BaseException],
    metrics: Metrics,
) -> None:
    """Raise one error naming every stream of ``failures``, if any.

    Raises:
        LMCacheBatchedStreamError: With ``.failures`` and the phase's
            ``.metrics`` (of the streams that committed).
    """
    if not failures:
        return
    details = "; ".join(
        f"{sid}: {type(exc).__name__}: {exc}" for sid, exc in failures.items()
    )
    raise LMCacheBatchedStreamError(
        f"{len(failures)} of {len(ids)} streams failed in {phase} "
        f"(the others committed): {details}",
        failures,
        metrics,
    )
