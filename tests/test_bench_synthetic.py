"""The real-shape bench's stand-in engine moves its KV a chunk at a time
(a prefill holding each in-flight stream's whole KV put every
worker 2 GiB over the memory bound at Llama-3-8B's shape)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from lmcache_mp.bench._synthetic import SYNTHETIC_VOCAB, SyntheticEngine
from lmcache_mp.kv import KVStore

C = 4  # the store fixture's chunk size
PROMPT = list(range(1, 3 * C + 3))  # three full chunks and a 2-token tail


def _tokens_moved(
    store: KVStore, monkeypatch: pytest.MonkeyPatch
) -> dict[str, list[int]]:
    """Record the tokens each store and retrieve call of ``store`` moves."""
    moved: dict[str, list[int]] = {"store": [], "retrieve": []}

    def spy(name: str, tokens_of: Callable[[Any, Any], int]) -> None:
        real = getattr(store, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            out = real(*args, **kwargs)
            moved[name].append(tokens_of(args, out))
            return out

        monkeypatch.setattr(store, name, call)

    spy("store", lambda args, out: args[0].shape[2])
    spy("retrieve", lambda args, out: 0 if out is None else out.shape[2])
    return moved


def test_a_prefill_stores_one_chunk_per_call(
    store: KVStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cold prefill writes each full chunk in its own store call and
    never the tail; the whole prompt's chunks are then cached."""
    engine = SyntheticEngine(store, layers=2, width=8, dtype="float32")
    moved = _tokens_moved(store, monkeypatch)
    list(engine(PROMPT, {"max_tokens": 1}))
    assert moved["store"] == [C, C, C]
    cached = store.retrieve(PROMPT)
    assert cached is not None and cached.shape[2] == 3 * C


def test_a_cached_prefix_is_read_one_chunk_per_call(
    store: KVStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A warm call reads the cached prefix a chunk per retrieve, reports
    it as cached, and stores nothing."""
    engine = SyntheticEngine(store, layers=2, width=8, dtype="float32")
    list(engine(PROMPT, {"max_tokens": 1}))
    moved = _tokens_moved(store, monkeypatch)
    events = list(engine(PROMPT, {"max_tokens": 1}))
    assert events[0].cached_tokens == 3 * C
    assert moved["retrieve"] == [C, C, C]
    assert moved["store"] == []


def test_replies_sum_the_whole_kv_as_one_array_would(store: KVStore) -> None:
    """The chunk-wise sums give the reply the class docstring defines over
    the prompt's whole KV: the cached prefix, read at once, and the tail's
    table rows."""
    engine = SyntheticEngine(store, layers=2, width=8, dtype="float32", seed=3)
    list(engine(PROMPT, {"max_tokens": 1}))
    events = list(engine(PROMPT, {"max_tokens": 2}))
    cached = store.retrieve(PROMPT)
    assert cached is not None
    tail_ids = np.asarray(PROMPT[3 * C :]) % 64
    table = np.random.default_rng(3).standard_normal((2, 2, 64, 8), np.float32)
    tail = np.take(table, tail_ids, axis=2)
    s = sum(PROMPT) + sum(
        int(a.reshape(-1).view(np.uint32).sum(dtype=np.uint64)) for a in (cached, tail)
    )
    assert [e.token_id for e in events] == [
        1 + (s + 7 * i) % (SYNTHETIC_VOCAB - 1) for i in range(2)
    ]
