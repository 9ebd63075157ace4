"""How a phase's outcomes land in the parent's streams (only on success),
and the one error that names the streams that failed."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

from lmcache_mp._core.records import StreamModifyMetrics, StreamPerfMetrics
from lmcache_mp._core.streambase import StreamBase
from lmcache_mp.errors import (
    LMCacheBatchedStreamError,
    LMCacheStreamError,
    PhaseTimeoutError,
    TerminatedWorkerError,
)
from lmcache_mp.executors import PhaseRun
from lmcache_mp.kv import PinOwner
from lmcache_mp.metrics import Metrics

__all__ = ["commit", "drop_staged", "raise_failures"]

#: Failures whose worker was killed: it may have left temp files behind.
_DEAD_WORKER = (TerminatedWorkerError, PhaseTimeoutError)


def commit(
    streams: Sequence[StreamBase],
    run: PhaseRun,
    perf_metrics: dict[str, StreamPerfMetrics],
    modify_metrics: dict[str, StreamModifyMetrics],
    owner: PinOwner,
) -> dict[str, BaseException]:
    """Commit each stream whose job succeeded; return the others' errors.

    A stream commits its staged edit (a same-token edit), then its state and
    figures; a failed stream's staged edit is discarded, so it keeps its
    previous state and KV. Staged chunks are leased to the batch's process,
    not to the worker that wrote them, so that an edit whose outcome came
    back is still there to commit after its worker died or the pool was
    torn down. When a worker was killed, the stores are swept of what it
    left half-written and of the batch's staging that no outcome claimed
    (the stream was run again, or failed with its worker).

    Args:
        streams: The phase's streams.
        run: What the executor produced.
        perf_metrics: Where generate figures go, by stream id.
        modify_metrics: Where modify figures go, by stream id.
        owner: The batch, whose staged chunks these are.

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
    if run.pool_rebuilds or any(isinstance(e, _DEAD_WORKER) for e in failures.values()):
        drop_staged(streams, owner)
    return failures


def drop_staged(streams: Sequence[StreamBase], owner: PinOwner) -> None:
    """Remove from the streams' stores what killed workers left
    half-written, and every staged chunk of ``owner`` not committed.

    For a phase that is over: after its commit, or when it was interrupted
    (Ctrl-C) and commits nothing.
    """
    contexts = [c for s in streams for c in s.contexts.values()]
    for ctx in {id(c): c for c in contexts}.values():
        sweep = getattr(ctx, "sweep", None)
        if sweep is None:
            continue
        with contextlib.suppress(Exception):
            if getattr(ctx, "stage", None) is None:
                sweep()
            else:
                sweep(owner)


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
