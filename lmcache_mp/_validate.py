"""Checks of what a caller hands a stream: token ids and ``max_tokens``."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from lmcache_mp.errors import StreamInputError

__all__ = ["check_max_tokens", "check_tokens"]

#: Token ids are keyed as int64 by the store (and by every real tokenizer).
_TOKEN_LIMIT = 2**63


def check_tokens(tokens: Iterable[Any], stream_id: str, what: str) -> list[int]:
    """Return ``tokens`` as a list of ints, or raise naming the bad one."""
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
