"""The engines keep generated tokens' KV and queries, as vLLM + LMCache's
``save_decode_cache`` does: a modify after a decode sees them."""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import lmcache_mp.request as lmc_request
import lmcache_mp.stream as lmc_stream
from lmcache_mp import LMCacheSDKCacheKind, connect
from lmcache_mp.engine import EmbeddedEngine, EngineConfig
from lmcache_mp.kv import KVStore
from tests._fakes import InMemoryKV

KV, QUERY = LMCacheSDKCacheKind.KV, LMCacheSDKCacheKind.QUERY
CHUNK = 16
GREEDY: dict[str, Any] = {"temperature": 0, "ignore_eos": True}
PROMPT = [int(t) for t in np.random.default_rng(3).integers(1, 512, 100)]


@pytest.fixture
def pair() -> Iterator[tuple[KVStore, KVStore]]:
    """A temporary store (16-token chunks) and its QUERY context."""
    ctx = connect(chunk_size=CHUNK)
    q_ctx = ctx.for_kind(QUERY)
    try:
        yield ctx, q_ctx
    finally:
        q_ctx.close()
        ctx.close()


def _decoded(ctx: Any, q_ctx: Any = None, **options: Any) -> lmc_stream.LMCacheStream:
    """A stream of ``PROMPT`` prefilled, then decoded 40 tokens greedily."""
    engine = EmbeddedEngine(ctx, EngineConfig(), query_ctx=q_ctx, **options)
    stream = lmc_stream.create_request(ctx, engine, PROMPT)
    stream.generate({**GREEDY, "max_tokens": 1})
    stream.generate({**GREEDY, "max_tokens": 40})
    return stream


def _one_shot(tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """The KV and queries a cold prefill of ``tokens`` stores."""
    ctx = connect(chunk_size=CHUNK)
    q_ctx = ctx.for_kind(QUERY)
    try:
        list(EmbeddedEngine(ctx, EngineConfig(), query_ctx=q_ctx)(tokens, {}))
        kv, queries = ctx.retrieve(tokens), q_ctx.retrieve(tokens)
        assert kv is not None and queries is not None
        return np.asarray(kv), np.asarray(queries)
    finally:
        q_ctx.close()
        ctx.close()


def test_a_modify_after_decode_sees_the_generated_tokens_kv(
    pair: tuple[KVStore, KVStore],
) -> None:
    """After a decode, modify's fn gets the KV of prompt + generated tokens
    up to the last full chunk, bit for bit the KV a one-shot prefill of the
    same tokens stores."""
    ctx, _ = pair
    stream = _decoded(ctx)
    tokens = list(stream.tokens)
    seen: dict[str, Any] = {}

    def look(kv: np.ndarray, toks: list[int]) -> tuple[np.ndarray, list[int]]:
        seen["kv"], seen["tokens"] = np.array(kv), list(toks)
        return kv, toks

    stream.modify_kv(look, timeout=1)
    # 141 tokens; the last one sampled has no KV yet: 140 computed, 128 cached.
    assert len(tokens) == len(PROMPT) + 41
    assert seen["tokens"] == tokens[:128]
    ref, _ = _one_shot(tokens)
    assert np.array_equal(seen["kv"], ref[:, :, :128])


def test_the_generated_tokens_queries_are_recorded_too(
    pair: tuple[KVStore, KVStore],
) -> None:
    """With a QUERY context, a 0.5.6 stream's fn gets the queries of the
    generated tokens beside their KV, equal to a one-shot prefill's."""
    ctx, q_ctx = pair
    engine = EmbeddedEngine(ctx, EngineConfig(), query_ctx=q_ctx)
    stream = lmc_request.create_request([ctx, q_ctx], engine, PROMPT)
    stream.generate({**GREEDY, "max_tokens": 1})
    stream.generate({**GREEDY, "max_tokens": 40})
    seen: dict[Any, np.ndarray] = {}

    def look(tensors: Any, toks: list[int]) -> tuple[Any, list[int]]:
        seen.update({kind: np.array(tensors[kind]) for kind in (KV, QUERY)})
        return tensors[KV], toks

    stream.modify_kv(look, timeout=1, array="numpy")
    ref_kv, ref_queries = _one_shot(list(stream.tokens))
    assert seen[KV].shape[2] == seen[QUERY].shape[2] == 128
    assert np.array_equal(seen[KV], ref_kv[:, :, :128])
    assert np.array_equal(seen[QUERY], ref_queries[:, :, :128])


def test_save_decode_cache_false_stores_the_prompt_only(
    pair: tuple[KVStore, KVStore],
) -> None:
    """``save_decode_cache=False``: a modify after a decode sees the
    prompt's full chunks only, as before decode KV was kept."""
    ctx, _ = pair
    stream = _decoded(ctx, save_decode_cache=False)
    seen: list[int] = []
    stream.modify_kv(lambda kv, toks: seen.append(len(toks)) or (kv, toks), timeout=1)
    # The second call's prompt was 101 tokens: 96 of them in full chunks.
    assert seen == [96]


def test_the_next_decode_reuses_the_generated_tokens_kv(
    pair: tuple[KVStore, KVStore],
) -> None:
    """The decode after a decode computes only what is not cached: its first
    event reports the chunk-aligned cached prefix of prompt + generated."""
    ctx, _ = pair
    stream = _decoded(ctx)
    engine = stream.post_completion
    events = list(engine(list(stream.tokens), {**GREEDY, "max_tokens": 2}))
    assert events[0].cached_tokens == 128


def test_a_context_without_ranges_gets_whole_prefixes() -> None:
    """A context of the protocol alone (``store(kv, tokens, salt)``) gets
    each decode chunk as the whole prefix, and holds the same KV."""
    plain = InMemoryKV(CHUNK)
    stream = _decoded(plain)
    got = plain.retrieve(list(stream.tokens))
    assert got is not None and got.shape[2] == 128
    ref, _ = _one_shot(list(stream.tokens))
    assert np.array_equal(np.asarray(got), ref[:, :, :128])


def test_the_option_survives_pickling() -> None:
    """An engine pickles with ``save_decode_cache``, so workers keep it."""
    engine = EmbeddedEngine(InMemoryKV(CHUNK), save_decode_cache=False)
    assert pickle.loads(pickle.dumps(engine)).save_decode_cache is False
    assert "save_decode_cache=False" in repr(engine)
    assert pickle.loads(
        pickle.dumps(EmbeddedEngine(InMemoryKV(CHUNK)))
    ).save_decode_cache
