"""The embedded engine's query recording (``query_ctx``)."""

from __future__ import annotations

import pickle
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest

from lmcache_mp import LMCacheSDKCacheKind, connect
from lmcache_mp.edits import SnapKV, keep_count
from lmcache_mp.engine import EmbeddedEngine, EngineConfig
from lmcache_mp.engine._fixed import ACT_LIMIT, linear, rms_norm
from lmcache_mp.engine._model import weights_for
from lmcache_mp.errors import CacheKindError, KVConfigError
from lmcache_mp.kv import KVStore

KV, QUERY = LMCacheSDKCacheKind.KV, LMCacheSDKCacheKind.QUERY
CHUNK = 16
ONE: dict[str, Any] = {"max_tokens": 1}
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}


@contextmanager
def named_store() -> Iterator[tuple[KVStore, KVStore]]:
    """A fresh named store with 16-token chunks and its QUERY context;
    destroyed (every kind) on exit."""
    kv_ctx = connect(f"shm:///test-q-{secrets.token_hex(8)}", chunk_size=CHUNK)
    q_ctx = kv_ctx.for_kind(QUERY)
    try:
        yield kv_ctx, q_ctx
    finally:
        q_ctx.close()
        kv_ctx.destroy()


def prompt_of(length: int, seed: int = 0) -> list[int]:
    """A random prompt of vocabulary ids (never the default EOS id 0)."""
    return [int(t) for t in np.random.default_rng(seed).integers(1, 512, length)]


def tokens_of(engine: EmbeddedEngine, prompt: list[int], params: dict[str, Any]) -> Any:
    """The token ids and the first event's cached tokens of one call."""
    events = list(engine(prompt, params))
    return [e.token_id for e in events], events[0].cached_tokens


def recorded(q_ctx: KVStore, prompt: list[int]) -> np.ndarray:
    """The queries the store holds for ``prompt`` (failing when none)."""
    got = q_ctx.retrieve(prompt)
    assert got is not None, "no queries were recorded"
    return got


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_recorded_queries_are_chunk_aligned_in_the_kv_layout(dtype: str) -> None:
    """A prefill records [1, L, T, kv_heads*head_dim] queries of the KV's
    dtype for the prompt's full chunks, the same token range as the KV."""
    config = EngineConfig(dtype=dtype)
    prompt = prompt_of(2 * CHUNK + 5)
    with named_store() as (kv_ctx, q_ctx):
        list(EmbeddedEngine(kv_ctx, config, query_ctx=q_ctx)(prompt, ONE))
        q, kv = recorded(q_ctx, prompt), kv_ctx.retrieve(prompt)
        assert kv is not None
        assert q.shape == (1, config.layers, 2 * CHUNK, config.width)
        assert q.dtype == np.dtype(dtype)
        assert q.shape[2] == kv.shape[2]


def test_recorded_queries_are_the_rotated_queries() -> None:
    """Layer 0's recorded queries are the rotated query projection of the
    normalized embeddings, clipped as attention reads them."""
    config = EngineConfig()
    prompt = prompt_of(CHUNK, seed=2)
    w = weights_for(config)
    x = w.embed[np.asarray(prompt)]
    qkv = linear(rms_norm(x), w.layers[0].qkv)
    q = qkv.reshape(CHUNK, 3, config.kv_heads, config.head_dim)[:, 0]
    half = config.head_dim // 2
    cos, sin = w.cos[:CHUNK, None], w.sin[:CHUNK, None]
    a, b = q[..., :half], q[..., half:]
    rotated = np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)
    clipped = np.clip(rotated, -ACT_LIMIT, ACT_LIMIT)
    want = clipped.reshape(CHUNK, config.width).astype(config.kv_dtype)
    with named_store() as (kv_ctx, q_ctx):
        list(EmbeddedEngine(kv_ctx, config, query_ctx=q_ctx)(prompt, ONE))
        np.testing.assert_array_equal(recorded(q_ctx, prompt)[0, 0], want)


def test_recording_changes_neither_tokens_nor_kv() -> None:
    """An engine with a query_ctx yields the tokens and stores the KV bits
    of one without, cold and on a cache hit."""
    prompt = prompt_of(3 * CHUNK + 3, seed=1)
    with named_store() as (plain_kv, _), named_store() as (kv_ctx, q_ctx):
        plain = EmbeddedEngine(plain_kv)
        recording = EmbeddedEngine(kv_ctx, query_ctx=q_ctx)
        for cut in (CHUNK + 4, len(prompt)):
            assert tokens_of(recording, prompt[:cut], GREEDY) == tokens_of(
                plain, prompt[:cut], GREEDY
            )
        want, got = plain_kv.retrieve(prompt), kv_ctx.retrieve(prompt)
        assert want is not None and got is not None
        assert got.tobytes() == want.tobytes()


def test_a_prefill_that_reuses_the_cache_still_records_every_query() -> None:
    """After a cache hit the queries cover the whole prompt, the reused
    positions' taken from the store: bit for bit a cold run's."""
    prompt = prompt_of(4 * CHUNK + 2, seed=3)
    with named_store() as (cold_kv, cold_q), named_store() as (kv_ctx, q_ctx):
        list(EmbeddedEngine(cold_kv, query_ctx=cold_q)(prompt, ONE))
        engine = EmbeddedEngine(kv_ctx, query_ctx=q_ctx)
        list(engine(prompt[: 2 * CHUNK + 1], ONE))
        _, cached = tokens_of(engine, prompt, ONE)
        assert cached == 2 * CHUNK
        q = recorded(q_ctx, prompt)
        assert q.shape[2] == 4 * CHUNK
        assert q.tobytes() == recorded(cold_q, prompt).tobytes()


def test_queries_of_a_prefix_agree_with_its_extension() -> None:
    """Cold runs of a prompt and of a longer prompt starting with it record
    the same queries for the shared positions (attention is causal)."""
    prompt = prompt_of(5 * CHUNK, seed=4)
    with named_store() as (a_kv, a_q), named_store() as (b_kv, b_q):
        list(EmbeddedEngine(a_kv, query_ctx=a_q)(prompt[: 2 * CHUNK + 7], ONE))
        list(EmbeddedEngine(b_kv, query_ctx=b_q)(prompt, ONE))
        short, long = recorded(a_q, prompt[: 2 * CHUNK]), recorded(b_q, prompt)
        np.testing.assert_array_equal(long[:, :, : 2 * CHUNK], short)


def test_only_the_known_prefix_is_stored_when_reused_queries_are_missing() -> None:
    """When the KV of more positions was reused than the store has queries
    for, only the queries from position 0 up to that gap are stored."""
    prompt = prompt_of(4 * CHUNK + 1, seed=5)
    with named_store() as (kv_ctx, q_ctx):
        recording = EmbeddedEngine(kv_ctx, query_ctx=q_ctx)
        list(recording(prompt[:CHUNK], ONE))
        # KV of three chunks, from an engine that records no queries.
        list(EmbeddedEngine(kv_ctx)(prompt[: 3 * CHUNK], ONE))
        _, cached = tokens_of(recording, prompt, ONE)
        assert cached == 3 * CHUNK
        assert recorded(q_ctx, prompt).shape[2] == CHUNK


def test_a_reused_prompt_without_queries_stores_none() -> None:
    """Reused KV with no queries in the store leaves the QUERY store empty
    (no query tensor with a hole at the start)."""
    prompt = prompt_of(3 * CHUNK, seed=6)
    with named_store() as (kv_ctx, q_ctx):
        list(EmbeddedEngine(kv_ctx)(prompt, ONE))
        list(EmbeddedEngine(kv_ctx, query_ctx=q_ctx)(prompt, ONE))
        assert q_ctx.retrieve(prompt) is None


def test_stored_queries_of_another_layout_raise() -> None:
    """Queries in the store that do not fit the model raise KVConfigError
    on a prefill that reuses the cache."""
    prompt = prompt_of(2 * CHUNK + 1, seed=7)
    with named_store() as (kv_ctx, q_ctx):
        list(EmbeddedEngine(kv_ctx)(prompt, ONE))
        q_ctx.store(np.zeros((1, 3, 2 * CHUNK, 64), np.float32), prompt[: 2 * CHUNK])
        engine = EmbeddedEngine(kv_ctx, query_ctx=q_ctx)
        with pytest.raises(KVConfigError, match=r"queries of shape \(1, 3, 32, 64\)"):
            list(engine(prompt, ONE))


def test_the_engine_pickles_with_its_query_ctx() -> None:
    """An unpickled engine records queries in the same QUERY namespace, and
    its repr names the query context."""
    prompt = prompt_of(2 * CHUNK, seed=8)
    with named_store() as (kv_ctx, q_ctx):
        engine = EmbeddedEngine(kv_ctx, EngineConfig(seed=2), query_ctx=q_ctx)
        assert f"query_ctx={q_ctx!r}" in repr(engine)
        copy = pickle.loads(pickle.dumps(engine))
        try:
            assert copy.query_ctx is not None
            assert copy.query_ctx.kind is QUERY
            assert copy.query_ctx.url == q_ctx.url
            assert copy.config == engine.config
            list(copy(prompt, ONE))
            assert recorded(q_ctx, prompt).shape[2] == 2 * CHUNK
        finally:
            copy.query_ctx.close()


def test_an_engine_without_query_ctx_pickles_as_before() -> None:
    """Without a query_ctx the engine reduces to (ctx, config), as it did."""
    with named_store() as (kv_ctx, _):
        engine = EmbeddedEngine(kv_ctx)
        assert engine.__reduce__() == (EmbeddedEngine, (kv_ctx, engine.config))
        assert engine.query_ctx is None and "query_ctx" not in repr(engine)


def test_a_query_ctx_of_another_kind_raises() -> None:
    """A KV context, or a context with no kind, as query_ctx raises
    CacheKindError at construction, naming QUERY."""
    with named_store() as (kv_ctx, _):
        with pytest.raises(CacheKindError, match="must be a QUERY context"):
            EmbeddedEngine(kv_ctx, query_ctx=kv_ctx)
        with pytest.raises(CacheKindError, match="must be a QUERY context"):
            EmbeddedEngine(kv_ctx, query_ctx=object())  # type: ignore[arg-type]


def test_snapkv_edits_what_the_engine_recorded() -> None:
    """SnapKV over the engine's stored KV and queries returns a valid edit:
    the budget, the window, kept tokens in order, their rows unchanged."""
    config = EngineConfig()
    prompt = prompt_of(4 * CHUNK + 9, seed=9)
    with named_store() as (kv_ctx, q_ctx):
        list(EmbeddedEngine(kv_ctx, config, query_ctx=q_ctx)(prompt, ONE))
        kv, q = kv_ctx.retrieve(prompt), recorded(q_ctx, prompt)
        assert kv is not None
        tokens = prompt[: kv.shape[2]]
        edit = SnapKV(keep=0.4, window=8, heads=config.kv_heads)
        new_kv, new_tokens, info = edit({KV: kv, QUERY: q}, tokens)
        kept = keep_count(0.4, len(tokens), 8)
        assert new_kv.shape == (2, config.layers, kept, config.width)
        assert len(new_tokens) == info["kept"] == kept
        assert info["dropped"] == len(tokens) - kept
        assert new_tokens[-8:] == tokens[-8:]
        rows = [kv[:, :, i] for i in range(len(tokens))]
        positions = [
            next(
                i for i, row in enumerate(rows) if np.array_equal(row, new_kv[:, :, j])
            )
            for j in range(kept)
        ]
        assert positions == sorted(set(positions))
        assert [tokens[i] for i in positions] == new_tokens


class _Logged:
    """A context that logs each store into a shared list, then stores."""

    def __init__(self, ctx: KVStore, name: str, log: list[str]) -> None:
        self._ctx, self._name, self._log = ctx, name, log
        self.kind = ctx.kind
        self.chunk_size = ctx.chunk_size

    def retrieve(self, tokens: Any, cache_salt: str = "") -> Any:
        return self._ctx.retrieve(tokens, cache_salt)

    def store(self, kv: Any, tokens: Any, cache_salt: str = "") -> bool:
        self._log.append(self._name)
        return self._ctx.store(kv, tokens, cache_salt)


def test_a_prefill_stores_its_queries_before_its_kv() -> None:
    """Queries go in first, so a concurrent prefill that reuses this KV
    also finds all its queries (it would otherwise record a shorter prefix
    of them, which query-aware edits then refuse)."""
    log: list[str] = []
    with named_store() as (kv_ctx, q_ctx):
        engine = EmbeddedEngine(
            _Logged(kv_ctx, "kv", log),
            EngineConfig(),
            query_ctx=_Logged(q_ctx, "query", log),
        )
        list(engine(prompt_of(3 * CHUNK), ONE))
    assert log == ["query", "kv"]
