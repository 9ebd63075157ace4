"""Checks of what a caller hands a stream (token ids, ``max_tokens``) or a
batch (the streams a phase selects)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from lmcache_mp.errors import LMCacheBatchedStreamError, StreamInputError

__all__ = ["check_max_tokens", "check_tokens", "select_streams"]

#: Token ids are keyed as int64 by the store (and by every real tokenizer).
_TOKEN_LIMIT = 2**63


def check_tokens(tokens: Iterable[Any], stream_id: str, what: str) -> list[int]:
    """Return ``tokens`` as a list of ints, or raise naming the bad one.

    Raises:
        StreamInputError: If ``tokens`` is not a sequence of token ids (a
            string, ``None`` or any other non-iterable included).
    """
    if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Iterable):
        raise StreamInputError(
            f"stream {stream_id}: {what} is {type(tokens).__name__}, expected "
            "a sequence of token ids",
            stream_id,
        )
    out: list[int] = []
    for i, tok in enumerate(tokens):
        # bool is an int subclass but never a token id; numpy ints are fine.
        if isinstance(tok, (bool, np.bool_)) or not isinstance(tok, (int, np.integer)):
            raise StreamInputError(
                f"stream {stream_id}: {what}[{i}] is {tok!r} "
                f"({type(tok).__name__}), expected a non-negative int",
                stream_id,
            )
        if not 0 <= tok < _TOKEN_LIMIT:
            raise StreamInputError(
                f"stream {stream_id}: {what}[{i}] is {tok}, token ids are >= 0 "
                "and < 2**63",
                stream_id,
            )
        out.append(int(tok))
    return out


def check_max_tokens(sampling_params: Mapping[str, Any], stream_id: str) -> int:
    """Return ``max_tokens`` (upstream's default: 1), checking it is >= 1."""
    value = sampling_params.get("max_tokens", 1)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise StreamInputError(
            f"stream {stream_id}: max_tokens is {value!r}, expected an int >= 1",
            stream_id,
        )
    if value < 1:
        raise StreamInputError(
            f"stream {stream_id}: max_tokens is {value}, expected >= 1", stream_id
        )
    return int(value)


def select_streams(
    streams: Mapping[str, Any], stream_ids: Sequence[str] | None
) -> list[str]:
    """Return the ids a phase runs: every stream for ``None``, else
    ``stream_ids`` checked.

    Raises:
        LMCacheBatchedStreamError: For a string instead of a list, an id
            not in ``streams``, or one selected twice.
    """
    if stream_ids is None:
        return list(streams)
    if isinstance(stream_ids, str):
        raise LMCacheBatchedStreamError(
            f"stream_ids must be a list of ids, got the string {stream_ids!r}"
        )
    seen: set[str] = set()
    for sid in stream_ids:
        if sid not in streams:
            raise LMCacheBatchedStreamError(f"stream {sid} is not in the batch")
        if sid in seen:
            raise LMCacheBatchedStreamError(f"stream {sid} is selected twice")
        seen.add(sid)
    return list(stream_ids)
