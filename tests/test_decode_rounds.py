"""Compression while generating: ``decode(compress=fn, every=N)`` decodes
N tokens at a time and runs ``fn`` on the streams still generating between
rounds, as kvpress's DecodingPress compresses every few decode steps."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import pytest

import lmcache_mp.batch as lmc_batch
import lmcache_mp.stream as lmc_stream
from lmcache_mp import LMCacheSDKCacheKind, connect, request
from lmcache_mp.edits import make_edit
from lmcache_mp.engine import EmbeddedEngine, EngineConfig
from lmcache_mp.errors import LMCacheBatchedStreamError, LMCacheStreamError
from lmcache_mp.kv import KVStore
from lmcache_mp.stream import TokenEvent

QUERY = LMCacheSDKCacheKind.QUERY
CHUNK = 16
PROMPT_LEN, MAX_TOKENS, EVERY, BUDGET = 150, 64, 16, 96
GREEDY: dict[str, Any] = {"temperature": 0, "ignore_eos": True}
#: The first token of the prompt that :func:`fails_second_round` singles out.
MARKER = 7
EXECUTORS = [
    ("serial", "spawn"),
    ("thread", "spawn"),
    ("process", "spawn"),
    ("process", "forkserver"),
]


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(11)
    prompts = [[int(t) for t in rng.integers(8, 512, PROMPT_LEN)] for _ in range(4)]
    prompts[0][0] = MARKER
    return prompts


def fails_second_round(kv: Any, tokens: list[int]) -> tuple[Any, list[int]]:
    """A window edit that raises for the marked stream's second round."""
    # Its first round sees the whole prompt; the second, the budget's
    # tokens and the ones decoded since.
    if tokens[0] == MARKER and len(tokens) < PROMPT_LEN:
        raise RuntimeError("this stream's edit fails")
    return make_edit("window", budget=BUDGET)(kv, tokens)


@pytest.fixture
def ctx() -> Iterator[KVStore]:
    """A temporary store of 16-token chunks."""
    store = connect(chunk_size=CHUNK)
    try:
        yield store
    finally:
        store.close()


def _batch(
    ctx: KVStore, executor: str = "serial", method: str = "spawn"
) -> lmc_batch.LMCacheBatchedStream:
    """A batch of the four prompts, prefilled."""
    batch = lmc_batch.LMCacheBatchedStream(executor, max_workers=2, mp_context=method)
    engine = EmbeddedEngine(ctx, EngineConfig())
    for prompt in _prompts():
        batch.add(lmc_stream.create_request(ctx, engine, prompt))
    batch.prefill({"temperature": 0})
    return batch


def _outputs(batch: lmc_batch.LMCacheBatchedStream) -> list[list[int]]:
    return [list(s.output_tokens()) for s in batch.streams.values()]


@pytest.mark.parametrize(("executor", "method"), EXECUTORS)
def test_rounds_equal_the_hand_written_loop(executor: str, method: str) -> None:
    """``decode(compress=fn, every=N)`` gives, token for token, what
    ``decode(N) -> modify(fn) -> decode(N) ...`` over the streams not done
    gives, on every executor."""
    edit = make_edit("window", budget=BUDGET)
    with connect(chunk_size=CHUNK) as ctx, _batch(ctx, executor, method) as batch:
        batch.decode({**GREEDY, "max_tokens": MAX_TOKENS}, compress=edit, every=EVERY)
        rounds = _outputs(batch)
    with connect(chunk_size=CHUNK) as ctx, _batch(ctx, executor, method) as batch:
        left = MAX_TOKENS
        active = list(batch.streams)
        while active and left > 0:
            step = min(EVERY, left)
            batch.decode({**GREEDY, "max_tokens": step}, stream_ids=active)
            left -= step
            active = [s for s in active if not batch.streams[s].done]
            if active and left > 0:
                batch.modify(edit, stream_ids=active)
        by_hand = _outputs(batch)
    assert rounds == by_hand
    assert all(len(out) == 1 + MAX_TOKENS for out in rounds)


def test_a_budget_holds_after_every_round(ctx: KVStore) -> None:
    """Each round leaves every stream at most ``budget`` KV tokens, and the
    report's Compression section says so."""
    edit = make_edit("knorm", budget=BUDGET)
    with _batch(ctx) as batch:
        metrics = batch.decode(
            {**GREEDY, "max_tokens": MAX_TOKENS}, compress=edit, every=EVERY
        )
        assert len(batch.round_metrics) == MAX_TOKENS // EVERY - 1
        for figures in batch.round_metrics:
            assert len(figures) == 4
            assert all(0 < f.tokens_after <= BUDGET for f in figures.values())
    section = metrics.to_dict()["metrics"]["compression"]
    assert section["rounds"] == MAX_TOKENS // EVERY - 1
    assert section["max_kv_tokens"] <= BUDGET


def test_the_report_covers_the_whole_generation(ctx: KVStore) -> None:
    """The decode report counts every round's tokens, and its TPOT has a
    gap for every token after a stream's first."""
    edit = make_edit("window", budget=BUDGET)
    with _batch(ctx) as batch:
        metrics = batch.decode(
            {**GREEDY, "max_tokens": MAX_TOKENS}, compress=edit, every=EVERY
        )
        perf = list(batch.perf_metrics.values())
    results = metrics.to_dict()["metrics"]["results"]
    assert results["output_tokens"] == 4 * MAX_TOKENS
    assert all(len(p.tpot) == MAX_TOKENS - 1 for p in perf)
    assert all(p.output_tokens == MAX_TOKENS for p in perf)


class StopsEarly:
    """An engine whose replies under the salt ``"stop"`` end (as at EOS)
    after ``limit`` tokens in all; the other streams' go on. It counts in
    the caller's process: for the serial executor."""

    def __init__(self, engine: EmbeddedEngine, limit: int) -> None:
        self.engine, self.limit, self.yielded = engine, limit, 0

    def __call__(
        self, prompt: Sequence[int], params: Mapping[str, Any], salt: str = ""
    ) -> Iterator[TokenEvent]:
        for event in self.engine(prompt, params, salt):
            if salt == "stop":
                if self.yielded == self.limit:
                    return
                self.yielded += 1
            yield event


def test_a_stream_at_eos_is_not_modified_again(ctx: KVStore) -> None:
    """A stream that stops mid-round (EOS) leaves the loop: no later round
    modifies or decodes it, while the others decode every token."""
    engine = StopsEarly(EmbeddedEngine(ctx, EngineConfig()), 1 + EVERY + 4)
    batch = lmc_batch.LMCacheBatchedStream("serial")
    with batch:
        for index, prompt in enumerate(_prompts()):
            salt = "stop" if index == 0 else ""
            batch.add(lmc_stream.create_request(ctx, engine, prompt, salt))
        batch.prefill({"temperature": 0})
        marked = next(iter(batch.streams))
        edit = make_edit("window", budget=BUDGET)
        batch.decode({**GREEDY, "max_tokens": MAX_TOKENS}, compress=edit, every=EVERY)
        assert batch.streams[marked].done
        # Round 1 modified it; it stopped 4 tokens into round 2.
        assert marked in batch.round_metrics[0]
        assert all(marked not in r for r in batch.round_metrics[1:])
        outputs = _outputs(batch)
    assert len(outputs[0]) == 1 + EVERY + 4
    assert all(len(out) == 1 + MAX_TOKENS for out in outputs[1:])


def test_a_failed_round_fails_that_stream_only(ctx: KVStore) -> None:
    """A stream whose compression fails leaves the loop with its last
    committed state; the others decode every token and commit; the error,
    raised at the end, names that stream."""
    with _batch(ctx) as batch:
        marked = next(iter(batch.streams))
        with pytest.raises(LMCacheBatchedStreamError, match=marked) as info:
            batch.decode(
                {**GREEDY, "max_tokens": MAX_TOKENS},
                compress=fails_second_round,
                every=EVERY,
            )
        outputs = _outputs(batch)
    assert set(info.value.failures) == {marked}
    assert isinstance(info.value.failures[marked], RuntimeError) or isinstance(
        info.value.failures[marked].__cause__, RuntimeError
    )
    # It decoded two rounds; its second compression failed.
    assert len(outputs[0]) == 1 + 2 * EVERY
    assert all(len(out) == 1 + MAX_TOKENS for out in outputs[1:])


@pytest.mark.parametrize(
    ("options", "error", "needle"),
    [
        ({"every": 16}, ValueError, "needs compress"),
        ({"compress": make_edit("window", budget=8), "every": 0}, ValueError, ">= 1"),
        ({"compress": make_edit("window", budget=8)}, ValueError, ">= 1"),
        ({"compress": 3, "every": 4}, TypeError, "callable"),
    ],
    ids=["every-alone", "every-zero", "every-missing", "not-callable"],
)
def test_bad_round_options_are_refused_before_any_run(
    ctx: KVStore, options: dict[str, Any], error: type[Exception], needle: str
) -> None:
    """``every`` without ``compress``, a non-positive ``every`` or a
    ``compress`` that is not callable fail at once, decoding nothing."""
    with _batch(ctx) as batch:
        with pytest.raises(error, match=needle):
            batch.decode({**GREEDY, "max_tokens": 8}, **options)
        assert all(len(out) == 1 for out in _outputs(batch))


def snapkv_noting_queries(tensors: Any, tokens: list[int]) -> Any:
    """SnapKV at the budget, its info noting how many positions the
    queries it was given cover."""
    kv, kept, info = make_edit("snapkv", budget=BUDGET, window=8)(tensors, tokens)
    return kv, kept, {**info, "queries": int(tensors[QUERY].shape[2])}


@pytest.mark.parametrize(("executor", "method"), EXECUTORS[::2])
def test_query_edits_score_with_the_latest_window_each_round(
    ctx: KVStore, executor: str, method: str
) -> None:
    """With a QUERY context, a query-aware edit runs every round: the first
    gets the queries of the whole cached prefix, each later one those of
    the positions after the previous edit's last full chunk (the tokens
    computed since), and the budget holds."""
    rounds, _ = _snapkv_rounds(ctx, EVERY, executor, method)
    assert len(rounds) == MAX_TOKENS // EVERY - 1
    first = (PROMPT_LEN + 1 + EVERY - 1) // CHUNK * CHUNK
    aligned = BUDGET // CHUNK * CHUNK
    for index, figures in enumerate(rounds):
        for m in figures.values():
            assert m.tokens_after <= BUDGET
            assert m.info is not None
            expected = first if index == 0 else m.tokens_before - aligned
            assert m.info["queries"] == expected


def _snapkv_rounds(
    ctx: KVStore, every: int, executor: str = "serial", method: str = "spawn"
) -> tuple[list[dict[str, Any]], list[list[int]]]:
    """Generate MAX_TOKENS on the four prompts with a QUERY context,
    compressing with :func:`snapkv_noting_queries` every ``every`` tokens;
    each round's figures, and the outputs."""
    queries = ctx.for_kind(LMCacheSDKCacheKind.QUERY)
    batch = lmc_batch.LMCacheBatchedStream(executor, max_workers=2, mp_context=method)
    engine = EmbeddedEngine(ctx, EngineConfig(), query_ctx=queries)
    try:
        with batch:
            for prompt in _prompts():
                batch.add(request.create_request([ctx, queries], engine, prompt, ""))
            batch.prefill({"temperature": 0})
            batch.decode(
                {**GREEDY, "max_tokens": MAX_TOKENS},
                compress=snapkv_noting_queries,
                every=every,
                array="numpy",
            )
            outputs = [list(s.state.output_ids) for s in batch.streams.values()]
            return list(batch.round_metrics), outputs
    finally:
        queries.close()


def test_a_round_leaves_a_stream_with_nothing_new_cached_as_it_is(
    ctx: KVStore,
) -> None:
    """With rounds shorter than a chunk, a round in which a stream's
    generated tokens completed no chunk since the last compression leaves
    it as it is (the fn is not called: nothing new is cached, and no
    queries of new tokens exist), and the rounds with a new chunk
    compress it; a query-aware edit runs through such a generation."""
    every = 4
    rounds, outputs = _snapkv_rounds(ctx, every)
    assert len(rounds) == MAX_TOKENS // every - 1
    called = [[m.info is not None for m in figures.values()] for figures in rounds]
    assert any(all(c) for c in called[1:])
    assert any(not any(c) for c in called[1:])
    for figures in rounds:
        for m in figures.values():
            assert m.tokens_after <= BUDGET
            if m.info is None:
                assert m.tokens_before == m.tokens_after
    assert all(len(out) == 1 + MAX_TOKENS for out in outputs)


def test_a_second_query_edit_with_nothing_cached_since_fails_naming_it(
    ctx: KVStore,
) -> None:
    """A query-aware modify right after another, with no decode between,
    fails naming the stream and what to do, instead of waiting for
    queries no engine will record."""
    queries = ctx.for_kind(LMCacheSDKCacheKind.QUERY)
    engine = EmbeddedEngine(ctx, EngineConfig(), query_ctx=queries)
    try:
        stream = request.create_request([ctx, queries], engine, _prompts()[1], "")
        stream.generate({"temperature": 0, "max_tokens": 1})
        edit = make_edit("snapkv", budget=BUDGET, window=8)
        stream.modify_kv(edit, array="numpy")
        with pytest.raises(
            LMCacheStreamError, match="nothing was cached since"
        ) as info:
            stream.modify_kv(edit, array="numpy")
        assert info.value.stream_id and info.value.stream_id in str(info.value)
    finally:
        queries.close()


@pytest.mark.parametrize("rerotate", [True, False])
def test_rerotated_rounds_keep_every_key_at_its_index(
    ctx: KVStore, rerotate: bool
) -> None:
    """With ``rerotate=True``, after every round the cached keys sit at
    their indices in the stream's tokens: in layer 0, where a key depends
    only on its token and position, the cache left by the rounds (kept
    keys moved, later tokens decoded after them) equals a one-shot
    prefill of the same tokens. Without it the kept keys keep their old
    positions, and it does not."""
    attention = EngineConfig().attention
    edit = make_edit("knorm", budget=BUDGET, rerotate=rerotate, attention=attention)
    with _batch(ctx) as batch:
        batch.decode({**GREEDY, "max_tokens": MAX_TOKENS}, compress=edit, every=EVERY)
        stream = next(iter(batch.streams.values()))
        kv = stream.retrieve_kv()
        tokens = list(stream.tokens)
    with connect(chunk_size=CHUNK) as fresh:
        one_shot = lmc_stream.create_request(
            fresh, EmbeddedEngine(fresh, EngineConfig()), tokens
        )
        one_shot.generate({**GREEDY, "max_tokens": 1})
        reference = one_shot.retrieve_kv()
    cached = int(kv.shape[2])
    assert cached > BUDGET
    same = np.allclose(kv[:, 0], reference[:, 0, :cached], atol=1e-5)
    assert same is rerotate
