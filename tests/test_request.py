"""Specification of upstream 0.5.6's request API: streams over
one context per cache kind, fns taking ``{kind: tensor}``, the batch's
``request_streams`` names, on the same implementation as the seed's API.
"""

from __future__ import annotations

import enum
import inspect
import re
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import pytest
import torch

import lmcache_mp.batch as lmc_batch
import lmcache_mp.request as lmc_request
import lmcache_mp.stream as lmc_stream
from lmcache_mp import LMCacheSDKCacheKind
from lmcache_mp.errors import (
    CacheKindError,
    LMCacheBatchedStreamError,
    LMCacheStreamError,
    StreamInputError,
)
from lmcache_mp.kv import SharedMemoryKVStore, connect
from tests._fakes import FakeEngine, QueryFakeEngine, kv_for, q_for

KV, QUERY = LMCacheSDKCacheKind.KV, LMCacheSDKCacheKind.QUERY
PROMPT = list(range(1, 11))  # 10 tokens: 8 cached in 4-token chunks


class UpstreamKind(enum.Enum):
    """Stands in for ``lmcache.sdk.cache_kind.LMCacheSDKCacheKind``."""

    KV = "kv"
    QUERY = "query"


@pytest.fixture
def kinds_store() -> Iterator[tuple[SharedMemoryKVStore, SharedMemoryKVStore]]:
    """A fresh store with 4-token chunks and its QUERY namespace."""
    ctx = connect(chunk_size=4)
    yield ctx, ctx.for_kind(QUERY)
    ctx.destroy()


def _prefilled(
    kv_ctx: Any, q_ctx: Any, prompt: list[int] = PROMPT
) -> lmc_request.LMCacheRequestStream:
    stream = lmc_request.create_request(
        [kv_ctx, q_ctx], QueryFakeEngine(kv_ctx, q_ctx), prompt
    )
    stream.generate({})
    return stream


def _drop_first_chunk(
    tensors: Mapping[Any, Any], tokens: list[int]
) -> tuple[Any, list[int]]:
    """A 0.5.6-style torch fn: keeps the KV after the first chunk."""
    kv = tensors[LMCacheSDKCacheKind.KV]
    assert isinstance(kv, torch.Tensor)
    return kv[:, :, 4:], tokens[4:]


def test_create_request_takes_contexts_and_gives_a_request_stream(
    kinds_store: tuple[Any, Any],
) -> None:
    """create_request(contexts, ...) builds an LMCacheRequestStream keyed by the contexts' kinds."""
    kv_ctx, q_ctx = kinds_store
    stream = lmc_request.create_request([q_ctx, kv_ctx], FakeEngine(kv_ctx), PROMPT)
    assert isinstance(stream, lmc_request.LMCacheRequestStream)
    assert stream.contexts == {KV: kv_ctx, QUERY: q_ctx}
    assert stream.ctx is kv_ctx


def test_the_accessors_are_properties_as_in_0_5_6(
    kinds_store: tuple[Any, Any],
) -> None:
    """request_stream_id, suffix_tokens, decoded_tokens, output_text, output_tokens and is_done read as attributes."""
    kv_ctx, q_ctx = kinds_store
    stream = _prefilled(kv_ctx, q_ctx)
    assert isinstance(stream.request_stream_id, str) and stream.request_stream_id
    first = (sum(PROMPT)) % 50
    assert stream.decoded_tokens == 1
    assert stream.output_tokens == [first]
    assert stream.output_text == f"<{first}>"
    assert stream.is_done is False
    stream.modify_kv(_drop_first_chunk)
    # 10 prompt tokens + 1 generated, 8 cached: the uncached tail is pending.
    assert stream.suffix_tokens == [*PROMPT[8:], first]


def test_a_kinds_fn_gets_every_contexts_tensor_of_the_tokens(
    kinds_store: tuple[Any, Any],
) -> None:
    """modify_kv hands {KV: [2, L, T, D], QUERY: [1, L, T, D]} of the cached prefix, as torch tensors by default."""
    kv_ctx, q_ctx = kinds_store
    stream = _prefilled(kv_ctx, q_ctx)
    seen: dict[Any, Any] = {}

    def record(tensors: Mapping[Any, Any], tokens: list[int]) -> tuple[Any, list[int]]:
        seen.update({k: tensors[k].numpy().copy() for k in tensors})
        seen["tokens"] = tokens
        return tensors[KV], tokens

    stream.modify_kv(record)
    assert seen["tokens"] == PROMPT[:8]
    np.testing.assert_array_equal(seen[KV], kv_for(PROMPT)[:, :, :8])
    np.testing.assert_array_equal(seen[QUERY], q_for(PROMPT)[:, :, :8])


def test_upstreams_own_kind_enum_looks_up_the_tensors(
    kinds_store: tuple[Any, Any],
) -> None:
    """A fn indexing with upstream's enum (compared by value) gets the same tensors."""
    kv_ctx, q_ctx = kinds_store
    stream = _prefilled(kv_ctx, q_ctx)
    shapes = {}

    def by_upstream(
        tensors: Mapping[Any, Any], tokens: list[int]
    ) -> tuple[Any, list[int]]:
        shapes["q"] = tuple(tensors[UpstreamKind.QUERY].shape)
        assert UpstreamKind.KV in tensors and "query" in tensors
        return tensors[UpstreamKind.KV], tokens

    stream.modify_kv(by_upstream, array="numpy")
    assert shapes["q"] == (1, 2, 8, 4)


def test_a_seed_stream_keeps_fn_of_kv_and_tokens(kinds_store: tuple[Any, Any]) -> None:
    """A stream made by lmcache_mp.stream.create_request still hands fn a bare numpy KV."""
    kv_ctx, _ = kinds_store
    stream = lmc_stream.create_request(kv_ctx, FakeEngine(kv_ctx), PROMPT)
    stream.generate({})
    got: list[Any] = []

    def fn(kv: Any, tokens: list[int]) -> tuple[Any, list[int]]:
        got.append(kv)
        return kv, tokens

    stream.modify_kv(fn)
    assert isinstance(got[0], np.ndarray) and got[0].shape == (2, 2, 8, 4)


def test_retrieve_and_update_by_kind(kinds_store: tuple[Any, Any]) -> None:
    """update(kind=QUERY) stores a query tensor that retrieve(kind=QUERY) returns, and the tokens back the stream."""
    kv_ctx, q_ctx = kinds_store
    stream = _prefilled(kv_ctx, q_ctx)
    new = list(range(30, 38))
    stream.update(kind=QUERY, kv=torch.from_numpy(q_for(new)), tokens=new)
    assert stream.tokens == new and stream.is_done is False
    got = stream.retrieve(kind=QUERY, timeout=0)
    assert isinstance(got, torch.Tensor)
    np.testing.assert_array_equal(got.numpy(), q_for(new))


def test_update_checks_the_shape_of_its_kind(kinds_store: tuple[Any, Any]) -> None:
    """A KV-shaped tensor given as QUERY is refused, naming the stream; nothing changes."""
    kv_ctx, q_ctx = kinds_store
    stream = _prefilled(kv_ctx, q_ctx)
    before = stream.state.copy()
    with pytest.raises(StreamInputError, match="QUERY has shape") as info:
        stream.update(kind=QUERY, kv=kv_for(PROMPT[:8]), tokens=PROMPT[:8])
    assert info.value.stream_id == stream.request_stream_id
    assert stream.state == before


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda s: s.retrieve(kind="keys", timeout=0), id="unknown kind"),
        pytest.param(lambda s: s.retrieve(kind=QUERY, timeout=0), id="no such context"),
        pytest.param(
            lambda s: s.update(kind=QUERY, kv=q_for([1, 2]), tokens=[1, 2]),
            id="update without the context",
        ),
    ],
)
def test_a_missing_or_unknown_kind_is_a_typed_error(
    call: Any, kinds_store: tuple[Any, Any]
) -> None:
    """retrieve/update of an unknown kind, or of a kind the stream has no context for, raise CacheKindError naming the stream."""
    kv_ctx, _ = kinds_store
    stream = lmc_request.create_request([kv_ctx], FakeEngine(kv_ctx), PROMPT)
    with pytest.raises(CacheKindError, match=stream.request_stream_id) as info:
        call(stream)
    assert info.value.stream_id == stream.request_stream_id
    assert isinstance(info.value, LMCacheStreamError)


class _OddKindContext:
    kind = "values"
    chunk_size = 4


@pytest.mark.parametrize(
    ("contexts", "match"),
    [
        pytest.param(
            lambda kv, q: [kv, _OddKindContext()], "not a cache kind", id="unknown"
        ),
        pytest.param(lambda kv, q: [kv, kv], "two contexts of kind KV", id="repeated"),
    ],
)
def test_bad_contexts_fail_at_create_request(
    contexts: Any, match: str, kinds_store: tuple[Any, Any]
) -> None:
    """An unknown kind or a repeated kind fail create_request with CacheKindError."""
    kv_ctx, q_ctx = kinds_store
    with pytest.raises(CacheKindError, match=match):
        lmc_request.create_request(contexts(kv_ctx, q_ctx), FakeEngine(kv_ctx), PROMPT)


def test_a_single_context_is_not_taken_for_contexts(
    kinds_store: tuple[Any, Any],
) -> None:
    """0.5.6's create_request given one context (the seed's call) says to pass a list."""
    kv_ctx, _ = kinds_store
    with pytest.raises(StreamInputError, match="iterable of contexts"):
        lmc_request.create_request(kv_ctx, FakeEngine(kv_ctx), PROMPT)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("result", "error", "match"),
    [
        pytest.param(
            lambda t, k: ({QUERY: t[QUERY]}, k),
            CacheKindError,
            "returned QUERY",
            id="a QUERY mapping",
        ),
        pytest.param(
            lambda t, k: (t[QUERY], k),
            StreamInputError,
            "expected 4-D \\[2",
            id="the QUERY tensor",
        ),
        pytest.param(
            lambda t, k: (t, k),
            CacheKindError,
            "returned KV, QUERY",
            id="the whole mapping",
        ),
    ],
)
def test_a_fn_returning_another_kind_commits_nothing(
    result: Any, error: type[Exception], match: str, kinds_store: tuple[Any, Any]
) -> None:
    """A fn that returns a kind other than KV fails its stream with a typed error; state and KV stay."""
    kv_ctx, q_ctx = kinds_store
    stream = _prefilled(kv_ctx, q_ctx)
    before = stream.state.copy()
    with pytest.raises(error, match=match) as info:
        stream.modify_kv(result)
    assert info.value.stream_id == stream.request_stream_id  # type: ignore[attr-defined]
    assert stream.state == before
    np.testing.assert_array_equal(kv_ctx.retrieve(PROMPT), kv_for(PROMPT)[:, :, :8])


# -- the batch under 0.5.6's names ----------------------------------------------


def test_request_streams_is_the_batchs_registry(kinds_store: tuple[Any, Any]) -> None:
    """request_streams is streams; get_request_stream finds by id or raises LMCacheBatchedStreamError."""
    kv_ctx, q_ctx = kinds_store
    with lmc_batch.LMCacheBatchedStream("serial") as batch:
        stream = lmc_request.create_request([kv_ctx, q_ctx], FakeEngine(kv_ctx), PROMPT)
        batch.add(stream)
        assert batch.request_streams is batch.streams
        assert batch.get_request_stream(stream.request_stream_id) is stream
        with pytest.raises(LMCacheBatchedStreamError, match="nope"):
            batch.get_request_stream("nope")


def _run_0_5_6(executor: str, kv_ctx: Any, q_ctx: Any, **opts: Any) -> list[Any]:
    """0.5.6's lower-level calls over 4 streams; what each ends with."""
    with lmc_batch.LMCacheBatchedStream(executor, **opts) as batch:
        for i in range(4):
            prompt = [i + t for t in PROMPT]
            batch.add(
                lmc_request.create_request(
                    [kv_ctx, q_ctx], QueryFakeEngine(kv_ctx, q_ctx), prompt
                )
            )
        assert batch.run_request_streams({"max_tokens": 1}) >= 0.0
        assert batch.modify_request_streams(_drop_first_chunk, timeout=5) >= 0.0
        batch.run_request_streams({"max_tokens": 3})
        return sorted(
            (s.tokens, s.output_tokens, float(kv_ctx.retrieve(s.tokens).sum()))
            for s in batch.request_streams.values()
        )


@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
def test_0_5_6_calls_give_the_threads_results_on_the_process_pool(
    start_method: str,
) -> None:
    """run_request_streams/modify_request_streams with a torch fn of {kind: tensor} give the thread executor's tokens and KV on the process pool."""
    results = []
    for executor, opts in (
        ("thread", {}),
        ("process", {"mp_context": start_method, "max_workers": 2}),
    ):
        ctx = connect(chunk_size=4)
        try:
            results.append(_run_0_5_6(executor, ctx, ctx.for_kind(QUERY), **opts))
        finally:
            ctx.destroy()
    assert results[0] == results[1]
    # 4 kept + the 3 uncached tokens sent with the decode + 3 decoded.
    assert all(len(tokens) == 4 + 3 + 3 for tokens, _, _ in results[0])


def test_a_missing_query_fails_only_that_stream_in_a_batch(
    kinds_store: tuple[Any, Any],
) -> None:
    """A stream whose QUERY is not cached fails its modify naming it; the others commit."""
    kv_ctx, q_ctx = kinds_store
    with lmc_batch.LMCacheBatchedStream("thread") as batch:
        good = lmc_request.create_request(
            [kv_ctx, q_ctx], QueryFakeEngine(kv_ctx, q_ctx), PROMPT
        )
        bare = lmc_request.create_request(
            [kv_ctx, q_ctx], FakeEngine(kv_ctx), [40 + t for t in PROMPT]
        )
        batch.add(good)
        batch.add(bare)
        batch.prefill({})
        before = bare.state.copy()
        with pytest.raises(LMCacheBatchedStreamError) as info:
            batch.modify_request_streams(
                _drop_first_chunk, timeout=0.2, poll_interval=0.05
            )
        assert list(info.value.failures) == [bare.request_stream_id]
        assert "no cached QUERY" in str(info.value.failures[bare.request_stream_id])
        assert bare.state == before
        assert good.tokens == PROMPT[4:8]


def test_a_ready_made_edit_works_on_either_api(kinds_store: tuple[Any, Any]) -> None:
    """make_edit("random") given a 0.5.6 stream's {kind: tensor} edits its KV exactly as on a seed stream."""
    from lmcache_mp.edits import make_edit

    kv_ctx, q_ctx = kinds_store
    edit = make_edit("random", keep=0.5, keep_first=0, keep_last=0, seed=3)
    request = _prefilled(kv_ctx, q_ctx)
    request.modify_kv(edit, array="numpy")
    seed = lmc_stream.create_request(kv_ctx, FakeEngine(kv_ctx), PROMPT)
    seed.generate({})
    seed.modify_kv(edit)
    assert request.tokens == seed.tokens and len(seed.tokens) == 4
    np.testing.assert_array_equal(
        kv_ctx.retrieve(request.tokens), kv_ctx.retrieve(seed.tokens)
    )


@pytest.mark.parametrize("api", ["seed", "0.5.6 without QUERY"])
@pytest.mark.parametrize("executor", ["thread", "process"])
def test_snapkv_on_a_stream_without_queries_fails_it_naming_the_stream(
    api: str, executor: str, kinds_store: tuple[Any, Any]
) -> None:
    """snapkv given a stream with no QUERY context fails that stream with a typed error saying why; nothing is committed for it, the others commit."""
    from lmcache_mp.edits import make_edit

    kv_ctx, q_ctx = kinds_store
    with lmc_batch.LMCacheBatchedStream(executor, max_workers=2) as batch:
        good = lmc_request.create_request(
            [kv_ctx, q_ctx], QueryFakeEngine(kv_ctx, q_ctx), PROMPT
        )
        other = [40 + t for t in PROMPT]
        if api == "seed":
            bad: Any = lmc_stream.create_request(kv_ctx, FakeEngine(kv_ctx), other)
        else:
            bad = lmc_request.create_request([kv_ctx], FakeEngine(kv_ctx), other)
        batch.add(good)
        batch.add(bad)
        batch.prefill({})
        before = bad.state.copy()
        with pytest.raises(LMCacheBatchedStreamError) as info:
            batch.modify(make_edit("snapkv", keep=0.5, window=2, kernel=1))
        sid = bad._stream_id
        assert list(info.value.failures) == [sid]
        failure = info.value.failures[sid]
        assert isinstance(failure, LMCacheStreamError)
        assert sid in str(failure) and "CacheKindError" in str(failure)
        assert "QUERY context" in str(failure)
        assert bad.state == before
        np.testing.assert_array_equal(kv_ctx.retrieve(other), kv_for(other)[:, :, :8])
        assert len(good.tokens) == 4


def test_without_torch_a_kinds_fn_gets_numpy(
    kinds_store: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where torch is not installed, a 0.5.6 stream's fn is handed numpy arrays instead of failing."""
    import sys

    kv_ctx, q_ctx = kinds_store
    stream = _prefilled(kv_ctx, q_ctx)
    monkeypatch.setitem(sys.modules, "torch", None)
    types = []

    def record(tensors: Mapping[Any, Any], tokens: list[int]) -> tuple[Any, list[int]]:
        types.extend(type(t) for t in tensors.values())
        return tensors[KV], tokens

    stream.modify_kv(record)
    assert types == [np.ndarray, np.ndarray]


@pytest.mark.parametrize(
    ("executor", "opts"),
    [
        pytest.param("thread", {}, id="thread"),
        pytest.param("process", {"mp_context": "spawn"}, id="spawn"),
        pytest.param("process", {"mp_context": "forkserver"}, id="forkserver"),
    ],
)
def test_a_stream_without_contexts_only_generates(
    executor: str, opts: dict[str, Any], kinds_store: tuple[Any, Any]
) -> None:
    """LMCacheRequestStream(contexts=[]) is valid, as upstream: it prefills and decodes on any executor."""
    kv_ctx, _ = kinds_store
    stream = lmc_request.LMCacheRequestStream(
        contexts=[], post_completion=FakeEngine(kv_ctx), prompt_token_ids=PROMPT
    )
    assert stream.contexts == {}
    with lmc_batch.LMCacheBatchedStream(executor, max_workers=1, **opts) as batch:
        batch.add(stream)
        batch.prefill({})
        batch.decode({"max_tokens": 3})
    # One token from the prefill, three from the decode.
    assert len(stream.output_tokens) == 4
    assert len(stream.tokens) == len(PROMPT) + 4


def _drop_first_chunk_by_query(
    tensors: Mapping[Any, Any], tokens: list[int]
) -> tuple[Any, list[int]]:
    """A 0.5.6-style fn that reads the queries too (as SnapKV's)."""
    assert tensors[LMCacheSDKCacheKind.QUERY].shape[2] == len(tokens)
    return _drop_first_chunk(tensors, tokens)


@pytest.mark.parametrize(
    ("contexts", "error", "match"),
    [
        pytest.param(lambda kv, q: [], CacheKindError, "no KV context", id="none"),
        pytest.param(lambda kv, q: [q], CacheKindError, "no KV context", id="QUERY"),
        pytest.param(
            lambda kv, q: [kv], LMCacheStreamError, "no .*QUERY.* tensor", id="KV"
        ),
    ],
)
@pytest.mark.parametrize("executor", ["thread", "process"])
def test_a_modify_needing_a_missing_kind_fails_only_that_stream(
    contexts: Any,
    error: type[Exception],
    match: str,
    executor: str,
    kinds_store: tuple[Any, Any],
) -> None:
    """A modify of a stream lacking a kind its fn needs fails it with a typed error naming it; the others commit."""
    kv_ctx, q_ctx = kinds_store
    with lmc_batch.LMCacheBatchedStream(executor, max_workers=2) as batch:
        good = lmc_request.create_request(
            [kv_ctx, q_ctx], QueryFakeEngine(kv_ctx, q_ctx), PROMPT
        )
        lacking = lmc_request.create_request(
            contexts(kv_ctx, q_ctx),
            QueryFakeEngine(kv_ctx, q_ctx),
            [40 + t for t in PROMPT],
        )
        batch.add(good)
        batch.add(lacking)
        batch.prefill({})
        before = lacking.state.copy()
        with pytest.raises(LMCacheBatchedStreamError) as info:
            batch.modify(_drop_first_chunk_by_query, timeout=5)
    sid = lacking.request_stream_id
    assert list(info.value.failures) == [sid]
    failure = info.value.failures[sid]
    assert isinstance(failure, error)
    assert f"stream {sid}" in str(failure)
    assert re.search(match, str(failure))
    assert lacking.state == before
    assert good.tokens == PROMPT[4:8]


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda b, fn: b.modify(fn, timeout=0.3), id="modify"),
        pytest.param(lambda b, fn: b.modify_stream(fn, None, 0.3), id="modify_stream"),
        pytest.param(
            lambda b, fn: b.modify_request_streams(fn, timeout=0.3),
            id="modify_request_streams",
        ),
    ],
)
def test_timeout_is_how_long_a_modify_waits_for_the_kv(
    call: Any, kinds_store: tuple[Any, Any]
) -> None:
    """timeout= of every modify call is upstream's: the wait for each stream's KV, not the phase's limit."""
    kv_ctx, q_ctx = kinds_store
    with lmc_batch.LMCacheBatchedStream("thread") as batch:
        never_prefilled = lmc_request.create_request(
            [kv_ctx, q_ctx], FakeEngine(kv_ctx), PROMPT
        )
        batch.add(never_prefilled)
        with pytest.raises(LMCacheBatchedStreamError) as info:
            call(batch, _drop_first_chunk)
    error = info.value.failures[never_prefilled.request_stream_id]
    assert "no cached KV" in str(error)
    assert "after 0.3s" in str(error)


def test_the_batch_takes_upstreams_phase_arguments_by_their_names() -> None:
    """Every parameter of upstream 0.5.6's batch phases exists here with its default, timeout included."""
    from lmcache.sdk.batch import LMCacheBatchedStream as Upstream

    for name in (
        "prefill",
        "modify",
        "decode",
        "run_request_streams",
        "modify_request_streams",
    ):
        ours = inspect.signature(getattr(lmc_batch.LMCacheBatchedStream, name))
        for param in inspect.signature(getattr(Upstream, name)).parameters.values():
            assert param.name in ours.parameters, (name, param.name)
            assert ours.parameters[param.name].default == param.default, (
                name,
                param.name,
            )
