"""The checks every embedded engine makes of a prompt before it runs."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from lmcache_mp.errors import StreamInputError

__all__ = ["check_prompt"]


def check_prompt(
    prompt: Sequence[int], max_tokens: int, vocab_size: int, max_position: int
) -> list[int]:
    """Return the prompt as ints, or raise naming what is wrong.

    Args:
        prompt: The prompt's token ids.
        max_tokens: Tokens the call may generate.
        vocab_size: Ids must be in ``[0, vocab_size)``.
        max_position: Longest sequence (prompt + generated) the model takes.

    Returns:
        The prompt as a list of Python ints.

    Raises:
        StreamInputError: If the prompt is empty, holds something other than
            an int id or an id outside the vocabulary, or does not fit
            ``max_position`` with ``max_tokens``.
    """
    tokens: list[int] = []
    for i, tok in enumerate(prompt):
        if isinstance(tok, (bool, np.bool_)) or not isinstance(tok, (int, np.integer)):
            raise StreamInputError(
                f"prompt token {i} is {tok!r}, expected an int token id"
            )
        if not 0 <= tok < vocab_size:
            raise StreamInputError(
                f"prompt token {i} is {tok}, outside the vocabulary [0, {vocab_size})"
            )
        tokens.append(int(tok))
    if not tokens:
        raise StreamInputError("the prompt is empty")
    # The last generated token is never fed back, so it needs no position.
    needed = len(tokens) + max_tokens - 1
    if needed > max_position:
        raise StreamInputError(
            f"the prompt has {len(tokens)} tokens and max_tokens is "
            f"{max_tokens}: {needed} positions, but max_position is {max_position}"
        )
    return tokens
