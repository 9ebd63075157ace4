"""Specification of a single stream (upstream ``lmcache.sdk.stream`` semantics)."""

from __future__ import annotations

import pickle
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import lmcache_mp.stream as lmc_stream
from lmcache_mp.errors import LMCacheStreamError, NoFullChunkError, StreamInputError
from lmcache_mp.stream import StreamState, TokenEvent
from tests._fakes import FakeEngine, InMemoryKV, kv_for


def test_create_request_gives_each_stream_a_unique_id(
    kv: InMemoryKV, engine: FakeEngine
) -> None:
    """Every stream gets its own id; the prompt is copied into ``tokens``."""
    prompt = [1, 2, 3]
    a = lmc_stream.create_request(kv, engine, prompt)
    b = lmc_stream.create_request(kv, engine, prompt)
    assert a.stream_id() != b.stream_id()
    prompt.append(4)
    assert a.tokens == [1, 2, 3]
    assert a.cache_salt == "" and a.ctx is kv and a.post_completion is engine


def test_generate_appends_output_and_returns_counts(
    kv: InMemoryKV, engine: FakeEngine
) -> None:
    """generate() sends tokens, appends the reply, and counts both sides."""
    s = lmc_stream.create_request(kv, engine, list(range(10)))
    perf = s.generate({"max_tokens": 3})
    expected = [(45 + 7 * i) % 50 for i in range(3)]
    assert engine.calls == [list(range(10))]
    assert s.tokens == list(range(10)) + expected
    assert s.output_tokens() == expected
    assert s.decoded_tokens() == 3
    assert s.output_text() == "".join(f"<{t}>" for t in expected)
    assert (perf.input_tokens, perf.output_tokens) == (10, 3)
    assert len(perf.tpot) == 2 and perf.ttft >= 0 and perf.duration >= 0


def test_max_tokens_defaults_to_one(kv: InMemoryKV, engine: FakeEngine) -> None:
    """Without max_tokens a generate produces one token and is not done."""
    s = lmc_stream.create_request(kv, engine, [1, 2])
    perf = s.generate({})
    assert perf.output_tokens == 1 and not s.is_done()


def test_done_is_set_when_fewer_than_max_tokens_come_back(kv: InMemoryKV) -> None:
    """An early EOS (fewer tokens than max_tokens) marks the stream done."""
    prompt = [1, 2, 3]  # sum 6: the reply is 6, 13, 20, ...
    s = lmc_stream.create_request(kv, FakeEngine(kv, eos_id=20), prompt)
    s.generate({"max_tokens": 5})
    assert s.output_tokens() == [6, 13]
    assert s.done and s.is_done()


def test_output_tokens_are_the_generated_ids_not_the_prompt(
    kv: InMemoryKV, engine: FakeEngine
) -> None:
    """output_tokens() returns what was generated, across calls (upstream returned tokens)."""
    s = lmc_stream.create_request(kv, engine, [5])
    s.generate({"max_tokens": 2})
    s.generate({"max_tokens": 1})
    assert s.output_tokens() == s.tokens[1:]
    assert 5 not in s.output_tokens()[:1] or (
        s.output_tokens()[0] == 5 and len(s.output_tokens()) == 3
    )
    assert len(s.output_tokens()) == 3


def test_suffix_tokens_argument_is_appended_before_generating(
    kv: InMemoryKV, engine: FakeEngine
) -> None:
    """generate(params, suffix_tokens) sends tokens + suffix as the prompt."""
    s = lmc_stream.create_request(kv, engine, [1, 2])
    perf = s.generate({"max_tokens": 1}, suffix_tokens=[9, 9])
    assert engine.calls[-1] == [1, 2, 9, 9]
    assert perf.input_tokens == 4
    assert s.tokens[:4] == [1, 2, 9, 9]


def test_retrieve_returns_the_chunk_aligned_cached_prefix(
    kv: InMemoryKV, engine: FakeEngine
) -> None:
    """retrieve_kv() returns [2, L, T, D] with T the chunk-aligned cached length."""
    s = lmc_stream.create_request(kv, engine, list(range(10)))
    s.generate({"max_tokens": 1})  # the engine stores the 10-token prompt: 2 chunks
    got = s.retrieve_kv(timeout=1)
    assert got.shape == (2, 2, 8, 4)
    np.testing.assert_array_equal(got, kv_for(list(range(8))))


def test_retrieve_times_out_with_an_error_naming_the_stream(
    kv: InMemoryKV, engine: FakeEngine
) -> None:
    """With nothing cached, retrieve_kv() raises after the timeout, naming the stream."""
    s = lmc_stream.create_request(kv, engine, list(range(10)))
    with pytest.raises(LMCacheStreamError, match=s.stream_id()) as info:
        s.retrieve_kv(timeout=0.05, poll_interval=0.01)
    assert info.value.stream_id == s.stream_id()


def test_a_stream_shorter_than_a_chunk_fails_its_retrieve_at_once(
    kv: InMemoryKV, engine: FakeEngine
) -> None:
    """Fewer tokens than chunk_size can never be cached: retrieve_kv() (and
    so a modify) raises NoFullChunkError naming the stream without waiting
    out its timeout."""
    s = lmc_stream.create_request(kv, engine, [1, 2])
    s.generate({"max_tokens": 1})
    assert len(s.state.tokens) < kv.chunk_size
    started = time.monotonic()
    with pytest.raises(NoFullChunkError, match=f"{s.stream_id()}.*chunk_size 4"):
        s.modify_kv(lambda k, t: (k, t), timeout=60)
    assert time.monotonic() - started < 30


def test_modify_carries_the_uncached_tail_into_the_suffix(
    kv: InMemoryKV, engine: FakeEngine
) -> None:
    """modify_kv(): fn sees tokens[:T]; tokens[T:] goes before the pending suffix."""
    s = lmc_stream.create_request(kv, engine, list(range(10)))
    s.generate({"max_tokens": 1})
    tail = s.tokens[8:]
    seen: list[list[int]] = []

    def keep_first_chunk(
        kv_: np.ndarray, toks: list[int]
    ) -> tuple[np.ndarray, list[int]]:
        seen.append(list(toks))
        return kv_[:, :, :4], toks[:4]

    s.modify_kv(keep_first_chunk, timeout=1)
    assert seen == [list(range(8))]
    assert s.tokens == [0, 1, 2, 3]
    assert s.suffix_tokens() == tail
    s.generate({"max_tokens": 1})
    assert engine.calls[-1] == [0, 1, 2, 3, *tail]
    assert s.suffix_tokens() == []


def test_modify_stores_the_new_kv_under_the_new_tokens(
    kv: InMemoryKV, engine: FakeEngine
) -> None:
    """The edited KV is what a later retrieve of the new tokens returns."""
    s = lmc_stream.create_request(kv, engine, list(range(8)))
    s.generate({"max_tokens": 1})
    s.modify_kv(lambda k, t: (k[:, :, 4:] * 2, t[4:]), timeout=1)
    np.testing.assert_array_equal(
        kv.retrieve([4, 5, 6, 7]), kv_for(range(8))[:, :, 4:] * 2
    )


class NoOverwriteKV(InMemoryKV):
    """A context whose store, like upstream's, skips cached chunks and has
    no ``overwrite=``."""

    def store(  # type: ignore[override]
        self, kv: np.ndarray, tokens: Any, cache_salt: str = ""
    ) -> bool:
        return super().store(kv, tokens, cache_salt)


def test_only_an_edit_that_did_not_land_is_warned(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A same-token edit that a store without overwrite skipped is lost,
    and logs a warning naming the stream; an edit of new tokens whose
    chunks are all cached already (the same KV under the same prefix)
    logs nothing above debug."""
    kv = NoOverwriteKV()
    engine = FakeEngine(kv)
    drop = lambda k, t: (k[:, :, 4:], t[4:])  # noqa: E731
    for _ in range(2):
        s = lmc_stream.create_request(kv, engine, list(range(8)))
        s.generate({"max_tokens": 1})
        with caplog.at_level("DEBUG", logger="lmcache_mp"):
            s.modify_kv(drop, timeout=1)
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    assert any("already cached" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level("WARNING", logger="lmcache_mp"):
        s.modify_kv(lambda k, t: (k * 2, t), timeout=1)
    assert [r.getMessage() for r in caplog.records] == [
        f"store reported edited KV already cached for stream {s.stream_id()}"
    ]


def test_modify_clears_done(kv: InMemoryKV) -> None:
    """A modify makes the stream resumable: done is cleared."""
    s = lmc_stream.create_request(kv, FakeEngine(kv, eos_id=17), [1, 2, 3, 4])
    s.generate({"max_tokens": 5})  # 10, then EOS (17)
    assert s.done
    s.modify_kv(lambda k, t: (k, t), timeout=1)
    assert not s.done


def test_modify_returns_the_fn_info_and_figures(
    kv: InMemoryKV, engine: FakeEngine
) -> None:
    """A fn returning (kv, tokens, info) hands info back with the edit's figures."""
    s = lmc_stream.create_request(kv, engine, list(range(8)))
    s.generate({"max_tokens": 1})
    m = s.modify_kv(lambda k, t: (k[:, :, :4], t[:4], {"dropped": 4}), timeout=1)
    assert m.info == {"dropped": 4}
    assert (m.tokens_before, m.tokens_after) == (8, 4)
    assert m.kv_bytes_in == 2 * m.kv_bytes_out == kv_for(range(8)).nbytes


def test_modify_figures_split_the_time_into_retrieve_fn_and_store(
    kv: InMemoryKV, engine: FakeEngine
) -> None:
    """The fn's own time is fn_s (a 50 ms sleep lands there), and the three
    parts add up to the duration."""
    s = lmc_stream.create_request(kv, engine, list(range(8)))
    s.generate({"max_tokens": 1})

    def slow(k: np.ndarray, t: list[int]) -> tuple[np.ndarray, list[int]]:
        time.sleep(0.05)
        return k[:, :, :4], t[:4]

    m = s.modify_kv(slow, timeout=1)
    assert m.fn_s >= 0.05
    assert m.retrieve_s < m.fn_s and m.store_s < m.fn_s
    assert m.retrieve_s + m.fn_s + m.store_s == pytest.approx(m.duration, abs=1e-3)


@pytest.mark.parametrize(
    ("result", "needle"),
    [
        (lambda k, t: (k[:, :, :3], t[:4]), "3 tokens on axis 2 but 4 token ids"),
        (lambda k, t: (k[0], t), "expected 4-D"),
        (lambda k, t: (np.concatenate([k, k]), t), "expected 4-D"),
        (lambda k, t: (None, t), "expected an array"),
        (lambda k, t: k, "expected a tuple"),
        (lambda k, t: (k, [*t[:-1], -1]), "token ids are >= 0"),
        (lambda k, t: (k, None), "new_tokens is NoneType, expected a sequence"),
        (lambda k, t: (k, "abcdefgh"), "new_tokens is str, expected a sequence"),
        (lambda k, t: (k[:, :, :0], []), "the edit returned no tokens"),
    ],
    ids=[
        "token-axis",
        "3-d",
        "first-axis",
        "none",
        "not-a-tuple",
        "negative-token",
        "tokens-none",
        "tokens-string",
        "no-tokens",
    ],
)
def test_bad_fn_results_are_rejected_and_change_nothing(
    kv: InMemoryKV, engine: FakeEngine, result: Any, needle: str
) -> None:
    """A malformed edit raises StreamInputError naming the stream; state and store are unchanged."""
    s = lmc_stream.create_request(kv, engine, list(range(8)))
    s.generate({"max_tokens": 1})
    before, chunks = s.state.copy(), dict(kv.chunks)
    with pytest.raises(StreamInputError, match=needle) as info:
        s.modify_kv(result, timeout=1)
    assert s.stream_id() in str(info.value)
    assert s.state == before
    assert kv.chunks.keys() == chunks.keys()


def test_update_kv_names_both_sizes(kv: InMemoryKV, engine: FakeEngine) -> None:
    """update_kv() with a KV/token mismatch names the stream and both sizes."""
    s = lmc_stream.create_request(kv, engine, [1, 2, 3, 4])
    with pytest.raises(
        StreamInputError, match=rf"{s.stream_id()}.*5 tokens.*4 token ids"
    ):
        s.update_kv(np.zeros((2, 2, 5, 4), np.float32), [1, 2, 3, 4])


def test_update_kv_replaces_tokens(kv: InMemoryKV, engine: FakeEngine) -> None:
    """update_kv() stores the KV and makes its tokens back the stream."""
    s = lmc_stream.create_request(kv, engine, [1, 2, 3, 4])
    lmc_stream.update(s, kv_for([7, 7, 7, 7]), [7, 7, 7, 7])
    assert s.tokens == [7, 7, 7, 7]
    np.testing.assert_array_equal(lmc_stream.get(s, timeout=1), kv_for([7, 7, 7, 7]))


def test_fn_exception_is_wrapped_with_its_cause_and_changes_nothing(
    kv: InMemoryKV, engine: FakeEngine
) -> None:
    """A raising fn gives LMCacheStreamError whose __cause__ is the fn's error."""
    s = lmc_stream.create_request(kv, engine, list(range(8)))
    s.generate({"max_tokens": 1})
    before = s.state.copy()

    def boom(k: np.ndarray, t: list[int]) -> Any:
        raise KeyError("no such layer")

    with pytest.raises(LMCacheStreamError, match="modify fn raised KeyError") as info:
        s.modify_kv(boom, timeout=1)
    assert isinstance(info.value.__cause__, KeyError)
    assert s.state == before


def test_engine_failure_mid_stream_changes_nothing(kv: InMemoryKV) -> None:
    """post_completion raising after some tokens: error names the stream, state unchanged."""

    def flaky(
        prompt: list[int], params: dict[str, Any], salt: str
    ) -> Iterator[TokenEvent]:
        yield TokenEvent(1, "a")
        raise ConnectionError("engine went away")

    s = lmc_stream.create_request(kv, flaky, [1, 2])
    before = s.state.copy()
    with pytest.raises(
        LMCacheStreamError, match=rf"{s.stream_id()}.*ConnectionError"
    ) as info:
        s.generate({"max_tokens": 4})
    assert isinstance(info.value.__cause__, ConnectionError)
    assert s.state == before


def test_engine_yielding_a_non_event_is_an_error(kv: InMemoryKV) -> None:
    """An engine that yields something without an int token_id fails the call."""
    s = lmc_stream.create_request(kv, lambda p, sp, salt: iter([3]), [1])
    with pytest.raises(LMCacheStreamError, match="expected a TokenEvent"):
        s.generate({"max_tokens": 1})


@pytest.mark.parametrize(
    ("prompt", "needle"),
    [
        ([], "empty"),
        ([1, "2"], r"prompt\[1\]"),
        ([1, -3], ">= 0"),
        ([2**63], "< 2\\*\\*63"),
        ([True], r"prompt\[0\]"),
        ([1.5], "float"),
    ],
    ids=["empty", "str", "negative", "too-large", "bool", "float"],
)
def test_bad_prompts_are_rejected(
    kv: InMemoryKV, engine: FakeEngine, prompt: list[Any], needle: str
) -> None:
    """create_request() rejects prompts that are not non-empty lists of token ids."""
    with pytest.raises(StreamInputError, match=needle):
        lmc_stream.create_request(kv, engine, prompt)


@pytest.mark.parametrize("max_tokens", [0, -1, 2.5, "3", True])
def test_bad_max_tokens_is_rejected_before_calling_the_engine(
    kv: InMemoryKV, engine: FakeEngine, max_tokens: Any
) -> None:
    """max_tokens must be an int >= 1; the engine is not called otherwise."""
    s = lmc_stream.create_request(kv, engine, [1])
    with pytest.raises(StreamInputError, match="max_tokens"):
        s.generate({"max_tokens": max_tokens})
    assert engine.calls == []


def test_tokens_are_assignable_and_validated(
    kv: InMemoryKV, engine: FakeEngine
) -> None:
    """Upstream code assigns stream.tokens; bad values are refused."""
    s = lmc_stream.create_request(kv, engine, [1])
    s.tokens = [4, 5]
    assert s.tokens == [4, 5]
    with pytest.raises(StreamInputError):
        s.tokens = [4, "x"]  # type: ignore[list-item]


def test_numpy_token_ids_are_accepted_as_ints(
    kv: InMemoryKV, engine: FakeEngine
) -> None:
    """Prompts given as numpy integer arrays become plain int lists."""
    s = lmc_stream.create_request(kv, engine, np.arange(4, dtype=np.int32))
    assert s.tokens == [0, 1, 2, 3] and all(type(t) is int for t in s.tokens)


def test_state_pickles_and_copies_independently() -> None:
    """StreamState is plain data: pickles round-trip; copy() shares no list."""
    state = StreamState(
        tokens=[1, 2], suffix=[3], decoded=1, text_parts=["a"], output_ids=[2]
    )
    assert pickle.loads(pickle.dumps(state)) == state
    other = state.copy()
    other.tokens.append(9)
    other.text_parts.append("b")
    assert state.tokens == [1, 2] and state.text_parts == ["a"]


def test_module_level_generate_delegates(kv: InMemoryKV, engine: FakeEngine) -> None:
    """lmc_stream.generate(stream, ...) is stream.generate(...)."""
    s = lmc_stream.create_request(kv, engine, [1, 2])
    perf = lmc_stream.generate(s, {"max_tokens": 2}, [3])
    assert perf.input_tokens == 3 and s.decoded_tokens() == 2


def test_an_edit_that_keeps_the_tokens_replaces_the_cached_kv(
    kv: InMemoryKV, engine: FakeEngine
) -> None:
    """A same-token edit (e.g. quantization) lands: the store's chunks are replaced, not skipped."""
    s = lmc_stream.create_request(kv, engine, list(range(8)))
    s.generate({"max_tokens": 1})
    s.modify_kv(lambda k, t: (np.round(k), t), timeout=1)
    np.testing.assert_array_equal(
        kv.retrieve(list(range(8))), np.round(kv_for(range(8)))
    )


def test_a_context_without_overwrite_keeps_upstream_semantics(
    engine: FakeEngine,
) -> None:
    """A context whose store() has no overwrite= is called as upstream's: cached chunks stay."""

    class PlainKV(InMemoryKV):
        def store(self, kv: np.ndarray, tokens: Any, cache_salt: str = "") -> bool:  # type: ignore[override]
            return super().store(kv, tokens, cache_salt)

    ctx = PlainKV(4)
    s = lmc_stream.create_request(ctx, FakeEngine(ctx), list(range(8)))
    s.generate({"max_tokens": 1})
    s.modify_kv(lambda k, t: (k + 1, t), timeout=1)
    np.testing.assert_array_equal(ctx.retrieve(list(range(8))), kv_for(range(8)))
