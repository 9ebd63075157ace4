"""The toy vocabulary: one made-up word per token id."""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from typing import Any

import numpy as np

from lmcache_mp.errors import StreamInputError

__all__ = ["EOS_WORD", "ToyVocab"]

_SYLLABLES = tuple(c + v for c in "bdfgklmnprstvz" for v in "aeiou")
#: The word of the end-of-sequence token.
EOS_WORD = "<eos>"


def _word(index: int) -> str:
    """The ``index``-th word: syllable strings in bijective base-70 order.

    Bijective numbering makes every index a distinct string: the 70
    one-syllable words come first, then the 4,900 two-syllable ones, ...
    """
    parts: list[str] = []
    n = index
    while n >= 0:
        parts.append(_SYLLABLES[n % len(_SYLLABLES)])
        n = n // len(_SYLLABLES) - 1
    return "".join(reversed(parts))


class ToyVocab:
    """A fixed vocabulary where token ``i`` reads as a space and a word.

    Token ``i`` is ``" " + word`` with ``word`` a made-up lowercase word of
    syllables (``" ba"``, ``" be"``, ..., ``" baba"``, ...), and the EOS token is
    ``" <eos>"``. Words contain no whitespace, so text made of vocabulary
    words tokenizes back to the same ids.

    Args:
        vocab_size: Number of tokens.
        eos_token_id: The id of the end-of-sequence token.
    """

    def __init__(self, vocab_size: int, eos_token_id: int) -> None:
        self._eos = int(eos_token_id)
        self._words = [_word(i) for i in range(int(vocab_size))]
        self._words[self._eos] = EOS_WORD
        self._ids = {word: i for i, word in enumerate(self._words)}

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (len(self._words), self._eos))

    def __repr__(self) -> str:
        return f"ToyVocab(vocab_size={len(self._words)}, eos_token_id={self._eos})"

    @property
    def size(self) -> int:
        """Number of tokens."""
        return len(self._words)

    @property
    def eos_token_id(self) -> int:
        """The id of the end-of-sequence token."""
        return self._eos

    def piece(self, token_id: int) -> str:
        """Return the text of one token: a space, then its word.

        Args:
            token_id: A token id in ``[0, size)``.

        Returns:
            The token's text.

        Raises:
            StreamInputError: If the id is not in the vocabulary.
        """
        if isinstance(token_id, bool) or not isinstance(token_id, (int, np.integer)):
            raise StreamInputError(f"token id {token_id!r} is not an int")
        if not 0 <= token_id < len(self._words):
            raise StreamInputError(
                f"token id {token_id} is outside the vocabulary [0, {self.size})"
            )
        return " " + self._words[token_id]

    def detokenize(self, token_ids: Iterable[int]) -> str:
        """Return the text of a sequence of token ids.

        Args:
            token_ids: Token ids in ``[0, size)``.

        Returns:
            The concatenated token texts.

        Raises:
            StreamInputError: If an id is not in the vocabulary.
        """
        return "".join(self.piece(t) for t in token_ids)

    def tokenize(self, text: str) -> list[int]:
        """Return the token ids of a text, one per whitespace-separated word.

        A vocabulary word maps to its id, so ``tokenize(detokenize(ids)) ==
        ids``. Any other word maps to a fixed non-EOS id derived from its
        CRC-32, so that arbitrary text still gets a deterministic prompt.

        Args:
            text: The text.

        Returns:
            The token ids.
        """
        return [self._id_of(word) for word in text.split()]

    def _id_of(self, word: str) -> int:
        """The id of a word; unknown words hash onto the non-EOS ids."""
        known = self._ids.get(word)
        if known is not None:
            return known
        slot = zlib.crc32(word.encode("utf-8")) % (self.size - 1)
        return slot + 1 if slot >= self._eos else slot
