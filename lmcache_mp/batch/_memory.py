"""How many streams a modify phase may edit at once, given free memory."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import psutil

from lmcache_mp._core.streambase import StreamBase

__all__ = ["modify_bound"]

#: Share of available memory the KV of concurrently modified streams may use.
_MEMORY_SHARE = 0.5
#: Copies of a stream's KV alive during an edit: retrieved, fn's working
#: copy, result.
_KV_COPIES_PER_EDIT = 3


def modify_bound(streams: Sequence[StreamBase]) -> int | None:
    """Return how many of ``streams`` may hold their KV in memory at once.

    Each edit holds about three copies of its stream's KV; together they may
    use half the available memory. A context that does not say
    its ``layout`` (layers, width, dtype) gives no bound.

    Args:
        streams: The streams of the phase (at least one).

    Returns:
        The bound (at least 1), or ``None`` when no context gives a layout.
    """
    per_token = 0
    for stream in streams:
        layout = getattr(stream.ctx, "layout", None)
        if layout is not None:
            layers, width, dtype = layout[:3]
            planes = getattr(layout, "planes", 2)
            size = planes * layers * width * np.dtype(dtype).itemsize
            per_token = max(per_token, size)
    if per_token == 0:
        return None
    longest = max(len(s.tokens) for s in streams)
    need = _KV_COPIES_PER_EDIT * per_token * max(1, longest)
    budget = psutil.virtual_memory().available * _MEMORY_SHARE
    return max(1, int(budget // need))
