"""Upstream 0.5.6's names for a batch's registry and lower-level phases.

``lmcache==0.5.6`` renamed the seed's ``streams``/``get_stream``/
``run_streams``/``modify_stream`` to ``request_streams``/
``get_request_stream``/``run_request_streams``/``modify_request_streams``.
Both sets run the same code: these delegate (issue #11).
"""

from __future__ import annotations

from typing import Any, Protocol

from lmcache_mp._core.records import ModifyFn
from lmcache_mp._core.streambase import StreamBase

__all__ = ["UpstreamNames"]


class _Batch(Protocol):
    """What the names delegate to (the batch's seed-named API)."""

    streams: dict[str, StreamBase]

    def get_stream(self, stream_id: str) -> StreamBase: ...

    def run_streams(
        self,
        sampling_params: dict[str, Any],
        stream_ids: list[str] | None = ...,
        *,
        phase_timeout: float | None = ...,
    ) -> float: ...

    def modify_stream(
        self,
        fn: ModifyFn,
        stream_ids: list[str] | None = ...,
        timeout: float = ...,
        poll_interval: float = ...,
        *,
        phase_timeout: float | None = ...,
    ) -> float: ...


class UpstreamNames:
    """The 0.5.6 names of :class:`~lmcache_mp.batch.LMCacheBatchedStream`."""

    @property
    def request_streams(self: _Batch) -> dict[str, StreamBase]:
        """Member streams keyed by id: the same dict as ``streams``."""
        return self.streams

    def get_request_stream(self: _Batch, stream_id: str) -> StreamBase:
        """Return the stream registered under ``stream_id`` (``get_stream``).

        Raises:
            LMCacheBatchedStreamError: If no stream has that id.
        """
        return self.get_stream(stream_id)

    def run_request_streams(
        self: _Batch,
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
        self: _Batch,
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
