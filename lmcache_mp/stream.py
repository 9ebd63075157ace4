"""One logical request across prefill, KV edits and decode.

The public names follow upstream ``lmcache.sdk.stream`` (the seed's API);
the implementation every stream shares is :class:`StreamBase`
(``lmcache_mp._core.streambase``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy.typing as npt

from lmcache_mp._core.records import (
    ModifyFn,
    PostCompletion,
    StreamModifyMetrics,
    StreamPerfMetrics,
    StreamState,
    TokenEvent,
)
from lmcache_mp._core.streambase import StreamBase
from lmcache_mp.errors import LMCacheStreamError
from lmcache_mp.kv import KVContext

__all__ = [
    "LMCacheStream",
    "LMCacheStreamError",
    "ModifyFn",
    "PostCompletion",
    "StreamModifyMetrics",
    "StreamPerfMetrics",
    "StreamState",
    "TokenEvent",
    "create_request",
    "generate",
    "get",
    "update",
]


class LMCacheStream(StreamBase):
    """Handle for one logical request spanning several inference passes.

    Args:
        ctx: The KV context used for retrieve/store.
        post_completion: Callable that submits a prompt to the engine.
        prompt_token_ids: Initial prompt token ids (non-empty, ints >= 0).
        cache_salt: Per-user isolation salt, or ``""``.
        stream_id: Id to use instead of a fresh UUID.
        state: Start from this state instead of the prompt (used by workers
            to rebuild a stream; ``prompt_token_ids`` is then ignored).

    Raises:
        StreamInputError: If the prompt is empty or not token ids.
    """

    # -- upstream's accessors ------------------------------------------------

    def stream_id(self) -> str:
        """Return the unique stream id."""
        return self._stream_id

    def suffix_tokens(self) -> list[int]:
        """Return the tokens to be sent before the next prompt's new tokens."""
        return self._state.suffix

    def decoded_tokens(self) -> int:
        """Return the number of tokens generated across all calls."""
        return self._state.decoded

    def output_text(self) -> str:
        """Return the generated text across all calls."""
        return "".join(self._state.text_parts)

    def output_tokens(self) -> list[int]:
        """Return the generated token ids across all calls.

        Upstream returned ``tokens`` (the prompt too), contrary to its own
        docstring; this returns what the docstring promises.
        """
        return list(self._state.output_ids)

    def is_done(self) -> bool:
        """Return True if the stream has finished generating."""
        return self._state.done


def create_request(
    ctx: KVContext,
    post_completion: PostCompletion,
    prompt_token_ids: Sequence[int],
    cache_salt: str = "",
) -> LMCacheStream:
    """Create an :class:`LMCacheStream` for a new request.

    Args:
        ctx: The KV context used for retrieve/store.
        post_completion: Callable that submits a prompt to the engine.
        prompt_token_ids: Initial prompt token ids.
        cache_salt: Per-user isolation salt, or ``""``.

    Returns:
        A new stream.

    Raises:
        StreamInputError: If the prompt is empty or not token ids.
    """
    return LMCacheStream(ctx, post_completion, prompt_token_ids, cache_salt)


def generate(
    stream: LMCacheStream,
    sampling_params: Mapping[str, Any],
    suffix_tokens: Sequence[int] = (),
) -> StreamPerfMetrics:
    """Run one inference pass of ``stream``; see :meth:`LMCacheStream.generate`."""
    return stream.generate(sampling_params, suffix_tokens)


def get(
    stream: LMCacheStream, timeout: float = 30.0, poll_interval: float = 0.2
) -> npt.NDArray[Any]:
    """Retrieve a stream's cached KV; see :meth:`LMCacheStream.retrieve_kv`."""
    return stream.retrieve_kv(timeout=timeout, poll_interval=poll_interval)


def update(stream: LMCacheStream, kv: Any, tokens: Sequence[int]) -> None:
    """Store an edited KV into a stream; see :meth:`LMCacheStream.update_kv`."""
    stream.update_kv(kv, tokens)
