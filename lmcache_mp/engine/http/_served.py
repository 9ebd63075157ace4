"""What ``lmcache-mp serve`` needs of the engine it serves: the toy model
or a trained one, its vocabulary, and the scores of a prompt."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from lmcache_mp.engine._embedded import EmbeddedEngine
from lmcache_mp.engine._hf import HFEngine
from lmcache_mp.kv import KVContext
from lmcache_mp.stream import TokenEvent

__all__ = ["ServedEngine", "ServedVocab", "score_prompt", "served_vocab"]


class ServedEngine(Protocol):
    """A caching engine the server can run: generate and score."""

    @property
    def ctx(self) -> KVContext:
        """The KV context the engine reads and writes."""
        ...

    def __call__(
        self,
        prompt_token_ids: Sequence[int],
        sampling_params: Mapping[str, Any],
        cache_salt: str = "",
    ) -> Iterator[TokenEvent]:
        """Generate a completion of the prompt."""
        ...

    def score(
        self,
        prompt: Sequence[int],
        continuation: Sequence[int],
        cache_salt: str = "",
    ) -> npt.NDArray[np.float32]:
        """Teacher-force ``continuation`` after ``prompt``."""
        ...


@dataclass(frozen=True)
class ServedVocab:
    """The served model's tokens, as the API shows them.

    Args:
        tokenize: Text prompt to token ids.
        detokenize: Token ids to text.
        decode_one: One token's text.
        size: Vocabulary size (reported by ``GET /v1/models``).
        max_model_len: Longest prompt + completion.
        eos: The ids that end a reply.
    """

    tokenize: Callable[[str], list[int]]
    detokenize: Callable[[Sequence[int]], str]
    decode_one: Callable[[int], str]
    size: int
    max_model_len: int
    eos: frozenset[int]
    _pieces: dict[int, str] = field(default_factory=dict, repr=False, compare=False)

    def piece(self, token: int) -> str:
        """One token's text, decoded once (a scored prompt lists thousands)."""
        text = self._pieces.get(token)
        if text is None:
            text = self._pieces[token] = self.decode_one(token)
        return text


def served_vocab(engine: EmbeddedEngine | HFEngine) -> ServedVocab:
    """The vocabulary of the toy model or of a trained one.

    Args:
        engine: The engine served.

    Returns:
        Its vocabulary; a trained model tokenizes text prompts as vLLM's
        completions do (special tokens added, no chat template).
    """
    if isinstance(engine, EmbeddedEngine):
        cfg = engine.config
        return ServedVocab(
            engine.tokenize,
            engine.detokenize,
            engine.vocab.piece,
            cfg.vocab_size,
            cfg.max_position,
            frozenset({cfg.eos_token_id}),
        )
    model_cfg = engine.model.config

    def tokenize(text: str) -> list[int]:
        return engine.encode(text, chat=False)

    return ServedVocab(
        tokenize,
        engine.decode,
        lambda token: str(engine.tokenizer.decode([token])),
        int(model_cfg.vocab_size),
        int(model_cfg.max_position_embeddings),
        engine.eos_token_ids,
    )


def score_prompt(
    engine: ServedEngine,
    prompt: list[int],
    salt: str,
    next_token: bool,
    start: int | None = None,
) -> tuple[int, int, npt.NDArray[np.float32]]:
    """The log-probabilities of a prompt's tokens, over its cached prefix.

    ``engine.score(prompt[:start], prompt[start:])``: the cached prefix of
    ``prompt[:start]`` (edited or not) is read, not recomputed, except
    ``prompt[start - 1]``, which is computed as a decode computes a prompt's
    last token; positions before ``start`` get no row; nothing is stored.

    Args:
        engine: The engine.
        prompt: The prompt's token ids.
        salt: The cache salt.
        next_token: Add the distribution after the prompt (a generated
            token's) as the last row.
        start: The first position to score, where the client says where
            its context ends (``prompt_logprobs_from``); ``None`` scores
            from the end of the prompt's cached prefix (at least 1: nothing
            predicts the first token).

    Returns:
        ``start``, the prompt tokens whose KV came from the cache, and the
        rows of ``prompt[start:]`` (then the next token's).
    """
    if start is None:
        cached = engine.ctx.retrieve(prompt, salt)
        stored = 0 if cached is None else int(cached.shape[2])
        start = max(1, min(stored, len(prompt) - 1))
    else:
        cached = engine.ctx.retrieve(prompt[:start], salt)
        stored = 0 if cached is None else int(cached.shape[2])
    reused = min(stored, start - 1)
    # Any id stands in for the token after the prompt: only the row
    # predicting it is kept, and it does not depend on it.
    tail = prompt[start:] + ([0] if next_token else [])
    if not tail:
        return start, reused, np.zeros((0, 0), dtype=np.float32)
    return start, reused, engine.score(prompt[:start], tail, salt)
