"""One logical request, with upstream ``lmcache==0.5.6``'s names
(``lmcache.sdk.request``): a stream over several contexts, one per cache
kind (KV, QUERY), whose modify fn takes ``{kind: tensor}``.

``import lmcache_mp.request as lmc_request`` in place of
``import lmcache.sdk.request as lmc_request`` runs 0.5.6 code unchanged on
lmcache_mp's executors. The implementation is the one every stream shares
(:class:`~lmcache_mp._core.streambase.StreamBase`); only the accessors differ
from :mod:`lmcache_mp.stream`'s (properties here, as 0.5.6 has them).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence
from typing import Any

from lmcache_mp._core.kinds import by_kind
from lmcache_mp._core.records import (
    ModifyFn,
    PostCompletion,
    StreamModifyMetrics,
    StreamPerfMetrics,
    StreamState,
    TokenEvent,
)
from lmcache_mp._core.streambase import StreamBase
from lmcache_mp._util.arrays import as_type, fn_array
from lmcache_mp.cache_kind import LMCacheSDKCacheKind, as_kind
from lmcache_mp.errors import LMCacheStreamError, StreamInputError
from lmcache_mp.kv import KVContext

__all__ = [
    "LMCacheRequestStream",
    "LMCacheRequestStreamError",
    "LMCacheSDKCacheKind",
    "ModifyFn",
    "PostCompletion",
    "StreamModifyMetrics",
    "StreamPerfMetrics",
    "TokenEvent",
    "create_request",
]

#: Upstream 0.5.6's name for a stream's error: the same class as
#: :class:`~lmcache_mp.errors.LMCacheStreamError` (a ``RuntimeError``).
LMCacheRequestStreamError = LMCacheStreamError


class LMCacheRequestStream(StreamBase):
    """Handle for one logical request spanning several inference passes,
    over one context per cache kind (upstream 0.5.6).

    Args:
        contexts: The stream's contexts; each has a ``.kind`` (one without
            is KV). It may be empty, as upstream allows: such a stream only
            generates, and a retrieve or modify of a kind it lacks fails
            with :class:`~lmcache_mp.errors.CacheKindError` naming it.
        post_completion: Callable that submits a prompt to the engine.
        prompt_token_ids: Initial prompt token ids (non-empty, ints >= 0).
        cache_salt: Per-user isolation salt, or ``""``.
        stream_id: Id to use instead of a fresh UUID.
        state: Start from this state instead of the prompt.

    Raises:
        StreamInputError: If the prompt is empty or not token ids, or
            ``contexts`` is a single context rather than an iterable.
        CacheKindError: If a context's kind is unknown, or two share a
            kind.
    """

    def __init__(
        self,
        contexts: Iterable[KVContext],
        post_completion: PostCompletion,
        prompt_token_ids: Sequence[int],
        cache_salt: str = "",
        *,
        stream_id: str | None = None,
        state: StreamState | None = None,
    ) -> None:
        sid = stream_id if stream_id is not None else str(uuid.uuid4())
        if hasattr(contexts, "retrieve") or not isinstance(contexts, Iterable):
            raise StreamInputError(
                f"stream {sid}: contexts must be an iterable of contexts (0.5.6's "
                "create_request([ctx, ...], ...)), got one "
                f"{type(contexts).__name__}; lmcache_mp.stream.create_request "
                "takes a single context",
                sid,
            )
        found = by_kind(contexts, sid)
        kv = found.pop(LMCacheSDKCacheKind.KV, None)
        super().__init__(
            kv,
            post_completion,
            prompt_token_ids,
            cache_salt,
            stream_id=sid,
            state=state,
            others=found,
            kinds=True,
        )

    # -- upstream 0.5.6's accessors (properties) ----------------------------

    @property
    def request_stream_id(self) -> str:
        """The unique stream id."""
        return self._stream_id

    @property
    def suffix_tokens(self) -> list[int]:
        """Tokens to be sent before the next prompt's new tokens."""
        return self._state.suffix

    @property
    def decoded_tokens(self) -> int:
        """Tokens generated across all calls."""
        return self._state.decoded

    @property
    def output_text(self) -> str:
        """The generated text across all calls."""
        return "".join(self._state.text_parts)

    @property
    def output_tokens(self) -> list[int]:
        """The generated token ids across all calls (0.5.6 returned
        ``tokens``, the prompt too, contrary to its docstring; this returns
        what the docstring promises, as :mod:`lmcache_mp.stream` does)."""
        return list(self._state.output_ids)

    @property
    def is_done(self) -> bool:
        """Whether the stream has finished generating (a property in 0.5.6,
        a method in the seed's ``LMCacheStream``)."""
        return self._state.done

    # -- upstream 0.5.6's by-kind cache access --------------------------------

    def retrieve(
        self,
        kind: LMCacheSDKCacheKind,
        timeout: float = 30.0,
        poll_interval: float = 0.2,
    ) -> Any:
        """Return the cached tensor of ``kind`` for ``tokens``, polling until
        it appears.

        Args:
            kind: The cache kind (lmcache_mp's or upstream's enum).
            timeout: Seconds to wait for a cached prefix to appear.
            poll_interval: Seconds between retrieve attempts.

        Returns:
            The longest cached chunk-aligned prefix: KV ``[2, L, T, D]``,
            QUERY ``[1, L, T, D]``; a CPU torch tensor sharing the store's
            buffer where torch is installed (as upstream), else numpy.

        Raises:
            CacheKindError: If ``kind`` is unknown or the stream has no
                context of that kind.
            LMCacheStreamError: If nothing is cached within ``timeout``.
        """
        found = self._retrieve(as_kind(kind, self._stream_id), timeout, poll_interval)
        return as_type(found, fn_array(None, kinds=True))

    def update(self, kind: LMCacheSDKCacheKind, kv: Any, tokens: Sequence[int]) -> None:
        """Store an edited tensor of ``kind`` and make ``tokens`` back the
        stream (``done`` is cleared), as 0.5.6's ``update``.

        Args:
            kind: The cache kind of ``kv``.
            kv: The tensor, ``[2, L, T, D]`` (KV) or ``[1, L, T, D]``
                (QUERY): torch, numpy, or anything ``np.asarray`` takes.
            tokens: The ``T`` token ids it belongs to.

        Raises:
            CacheKindError: If ``kind`` is unknown or the stream has no
                context of that kind.
            StreamInputError: If the tensor's shape does not fit its kind or
                ``T != len(tokens)``.
        """
        self._update(as_kind(kind, self._stream_id), kv, tokens)


def create_request(
    contexts: Iterable[KVContext],
    post_completion: PostCompletion,
    prompt_token_ids: Sequence[int],
    cache_salt: str = "",
) -> LMCacheRequestStream:
    """Create an :class:`LMCacheRequestStream` for a new request (0.5.6).

    Args:
        contexts: The stream's contexts, one per cache kind (may be empty:
            a stream that only generates).
        post_completion: Callable that submits a prompt to the engine.
        prompt_token_ids: Initial prompt token ids.
        cache_salt: Per-user isolation salt, or ``""``.

    Returns:
        A new stream.

    Raises:
        StreamInputError: If the prompt is empty or not token ids.
        CacheKindError: If the contexts' kinds are unknown or repeated.
    """
    return LMCacheRequestStream(contexts, post_completion, prompt_token_ids, cache_salt)
