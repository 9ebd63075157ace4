"""EmbeddedEngine.score: HFEngine.score's contract on the toy model
(teacher-forced log-probabilities over the cached prefix)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from lmcache_mp.engine import EmbeddedEngine
from lmcache_mp.errors import StreamInputError
from tests._fakes import InMemoryKV

CHUNK = 16
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 10, "ignore_eos": True}
PROMPT = list(range(5, 60))


def greedy(engine: EmbeddedEngine, prompt: list[int]) -> list[int]:
    return [event.token_id for event in engine(prompt, GREEDY)]


def test_score_rows_are_log_probabilities_whose_argmax_is_the_greedy_decode() -> None:
    """One row per continuation token, each a log-softmax over the vocabulary; its argmax is the token greedy decoding chose there."""
    engine = EmbeddedEngine(InMemoryKV(CHUNK))
    reply = greedy(engine, PROMPT)
    scored = engine.score(PROMPT, reply)
    assert scored.shape == (len(reply), engine.config.vocab_size)
    assert scored.dtype == np.float32
    np.testing.assert_allclose(np.exp(scored).sum(axis=1), 1.0, rtol=1e-5)
    assert scored.argmax(axis=1).tolist() == reply


def test_score_reuses_the_cached_prefix_exactly() -> None:
    """Scoring over a cached prefix gives the rows of scoring with nothing cached (the toy model is exact)."""
    cached = EmbeddedEngine(InMemoryKV(CHUNK))
    reply = greedy(cached, PROMPT)  # caches the prompt's full chunks
    cold = EmbeddedEngine(InMemoryKV(CHUNK))
    np.testing.assert_array_equal(
        cached.score(PROMPT, reply), cold.score(PROMPT, reply)
    )


def test_score_reads_an_edited_cache() -> None:
    """An edited cached KV (here zeroed values) changes the scores, as it changes what a decode after it sees."""
    ctx = InMemoryKV(CHUNK)
    engine = EmbeddedEngine(ctx)
    reply = greedy(engine, PROMPT)
    before = engine.score(PROMPT, reply)
    kv = ctx.retrieve(PROMPT)
    assert kv is not None
    edited = kv.copy()
    edited[1] = 0
    ctx.store(edited, PROMPT[: kv.shape[2]], "zeroed")
    assert not np.allclose(engine.score(PROMPT, reply, "zeroed"), before)


@pytest.mark.parametrize(("prompt", "continuation"), [([], [1]), ([1, 2], [])])
def test_score_refuses_an_empty_prompt_or_continuation(
    prompt: list[int], continuation: list[int]
) -> None:
    """An empty prompt or continuation raises StreamInputError."""
    with pytest.raises(StreamInputError, match="non-empty"):
        EmbeddedEngine(InMemoryKV(CHUNK)).score(prompt, continuation)
