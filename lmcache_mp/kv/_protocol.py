"""The interface every KV context implements."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

__all__ = ["KVContext"]


@runtime_checkable
class KVContext(Protocol):
    """A KV cache addressed by token prefixes, in chunks of ``chunk_size``.

    This is what ``create_request(ctx, ...)`` takes: upstream's
    ``LMCacheKVCacheContext`` and lmcache_mp's embedded store both fit it.
    A context used with the process executor must also pickle by location
    and reconnect in the worker that unpickles it.
    """

    @property
    def chunk_size(self) -> int:
        """Tokens per chunk; retrieved prefixes are multiples of it."""
        ...

    def retrieve(
        self, tokens: Sequence[int], cache_salt: str = ""
    ) -> npt.NDArray[Any] | None:
        """Return the KV of the longest cached chunk-aligned prefix.

        Args:
            tokens: The token ids whose KV is wanted.
            cache_salt: Isolation salt; KV stored under another salt is
                never returned.

        Returns:
            A new ``[2, L, T, D]`` array with ``T`` a multiple of
            ``chunk_size``, or ``None`` when the first chunk is not cached.
        """
        ...

    def store(
        self, kv: np.ndarray[Any, Any], tokens: Sequence[int], cache_salt: str = ""
    ) -> bool:
        """Store the full chunks of ``kv`` (``[2, L, len(tokens), D]``).

        Args:
            kv: The KV to store; a sub-chunk tail is not stored.
            tokens: The token ids the KV belongs to.
            cache_salt: Isolation salt.

        Returns:
            Whether any chunk was written (``False`` when all were cached).
        """
        ...
