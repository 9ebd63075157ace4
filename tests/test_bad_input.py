"""Bad input everywhere: each gets a typed error naming it, and harms nothing.

Property-based: hypothesis draws bad token ids, prompts, ``max_tokens``,
suffixes, stream ids, formats and widths. Each must be refused with a typed
error (:class:`StreamInputError`, :class:`LMCacheBatchedStreamError`,
``ValueError``) whose message names the bad value (and the stream, where
there is one), before any stream changes. A barrage of them on a process
batch must leave its workers and its store as they were.
"""

from __future__ import annotations

import os
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import lmcache_mp.batch as lmc_batch
import lmcache_mp.stream as lmc_stream
from lmcache_mp.errors import (
    CorruptChunkWarning,
    LMCacheBatchedStreamError,
    StreamInputError,
)
from lmcache_mp.executors._process import ProcessExecutor
from lmcache_mp.kv import SharedMemoryKVStore
from lmcache_mp.metrics import available_formats
from tests._fakes import FakeEngine, InMemoryKV, kv_for

EXAMPLES = settings(max_examples=60, deadline=None)
PROMPT = list(range(8))
WAIT_S = 60.0

#: Bad inputs tried, by kind; printed once the module is done.
TRIED: Counter[str] = Counter()

#: Anything that is not a token id: negatives, bools, floats (even 3.0),
#: strings, None, numpy floats and bools.
bad_tokens = st.one_of(
    st.integers(max_value=-1),
    st.booleans(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.none(),
    st.floats(width=32, allow_nan=False).map(np.float32),
    st.booleans().map(np.bool_),
)
#: ``max_tokens`` values below 1 or not ints.
bad_max_tokens = st.one_of(
    st.integers(max_value=0),
    st.booleans(),
    st.floats(allow_nan=True),
    st.text(max_size=8),
    st.none(),
)
#: Widths the terminal formatter cannot use: below 20, or not ints.
bad_widths = st.one_of(
    st.integers(max_value=19),
    st.booleans(),
    st.floats(allow_nan=True),
    st.text(max_size=8),
    st.none(),
)
bad_formats = st.text(max_size=12).filter(lambda s: s not in available_formats())
stream_ids = st.one_of(st.text(max_size=40), st.integers(), st.none())


@pytest.fixture(scope="module", autouse=True)
def report_tried() -> Iterator[None]:
    """Print how many bad inputs the module tried (for ``pytest -s``)."""
    yield
    kinds = ", ".join(f"{kind}={n}" for kind, n in sorted(TRIED.items()))
    print(f"\nRELIABILITY: bad inputs tried={sum(TRIED.values())} ({kinds})")


def _with_bad(good: list[int], bad: Any, at: int) -> list[Any]:
    at %= len(good) + 1
    return [*good[:at], bad, *good[at:]]


def _names(message: str, value: Any) -> bool:
    return repr(value) in message or str(value) in message


def _unchanged(
    batch: lmc_batch.LMCacheBatchedStream, before: dict[str, lmc_stream.StreamState]
) -> bool:
    return {sid: s.state for sid, s in batch.streams.items()} == before


def _snapshot(
    batch: lmc_batch.LMCacheBatchedStream,
) -> dict[str, lmc_stream.StreamState]:
    return {sid: s.state.copy() for sid, s in batch.streams.items()}


def keep_first_chunk(kv: np.ndarray, tokens: list[int]) -> tuple[np.ndarray, list[int]]:
    """A valid edit: shift the tokens of the first chunk (a new prefix)."""
    return kv[:, :, :4] * np.float32(3), [t + 1000 for t in tokens[:4]]


# -- streams --------------------------------------------------------------------


def _assert_generate_refuses(
    bad: Any, needle: str, params: dict[str, Any], suffix: list[Any] | tuple[()] = ()
) -> None:
    """generate(params, suffix) raises StreamInputError naming ``needle``, the
    bad value and the stream; the engine is not called; nothing changes."""
    kv = InMemoryKV()
    engine = FakeEngine(kv)
    stream = lmc_stream.create_request(kv, engine, PROMPT)
    before = stream.state.copy()
    with pytest.raises(StreamInputError) as info:
        stream.generate(params, suffix_tokens=suffix)
    message = str(info.value)
    assert needle in message and _names(message, bad)
    assert stream.stream_id() in message
    assert stream.state == before and not engine.calls


@EXAMPLES
@given(bad=bad_tokens, at=st.integers(0, 8))
def test_a_bad_prompt_token_is_refused_naming_it(bad: Any, at: int) -> None:
    """create_request refuses a prompt holding a bad token id, naming it and its index."""
    TRIED["prompt token"] += 1
    kv = InMemoryKV()
    prompt = _with_bad(PROMPT, bad, at)
    with pytest.raises(StreamInputError) as info:
        lmc_stream.create_request(kv, FakeEngine(kv), prompt)
    message = str(info.value)
    assert f"prompt[{at % (len(PROMPT) + 1)}]" in message
    assert _names(message, bad)
    assert info.value.stream_id is not None and info.value.stream_id in message


@pytest.mark.parametrize("empty", [[], (), range(0)])
def test_an_empty_prompt_is_refused(empty: Any) -> None:
    """create_request refuses an empty prompt, saying so and naming the stream."""
    TRIED["empty prompt"] += 1
    kv = InMemoryKV()
    with pytest.raises(StreamInputError, match="empty") as info:
        lmc_stream.create_request(kv, FakeEngine(kv), empty)
    assert info.value.stream_id is not None and info.value.stream_id in str(info.value)


@EXAMPLES
@given(bad=bad_max_tokens)
def test_a_bad_max_tokens_is_refused_before_the_engine_is_called(bad: Any) -> None:
    """generate refuses max_tokens < 1 or not an int, naming it; no request is sent."""
    TRIED["max_tokens"] += 1
    _assert_generate_refuses(bad, "max_tokens", {"max_tokens": bad})


@EXAMPLES
@given(bad=bad_tokens, at=st.integers(0, 3))
def test_a_bad_suffix_token_is_refused_before_the_engine_is_called(
    bad: Any, at: int
) -> None:
    """generate refuses suffix_tokens holding a bad id, naming it; nothing changes."""
    TRIED["suffix token"] += 1
    _assert_generate_refuses(
        bad, "suffix_tokens[", {"max_tokens": 2}, _with_bad([1, 2, 3], bad, at)
    )


@EXAMPLES
@given(bad=bad_tokens, at=st.integers(0, 8))
def test_assigning_bad_tokens_is_refused_and_keeps_the_old_ones(
    bad: Any, at: int
) -> None:
    """stream.tokens = [..., bad, ...] is refused naming the value; tokens are unchanged."""
    TRIED["tokens assignment"] += 1
    kv = InMemoryKV()
    stream = lmc_stream.create_request(kv, FakeEngine(kv), PROMPT)
    with pytest.raises(StreamInputError) as info:
        stream.tokens = _with_bad(PROMPT, bad, at)
    assert _names(str(info.value), bad) and stream.stream_id() in str(info.value)
    assert stream.tokens == PROMPT


# -- batches: stream ids, formats, widths ----------------------------------------------

#: Every batch method that selects streams, called with ``ids``.
SELECTING: dict[str, Callable[[lmc_batch.LMCacheBatchedStream, list[Any]], Any]] = {
    "prefill": lambda b, ids: b.prefill({}, stream_ids=ids),
    "modify": lambda b, ids: b.modify(keep_first_chunk, stream_ids=ids),
    "decode": lambda b, ids: b.decode({"max_tokens": 2}, stream_ids=ids),
    "run_streams": lambda b, ids: b.run_streams({"max_tokens": 2}, ids),
    "modify_stream": lambda b, ids: b.modify_stream(keep_first_chunk, ids),
}


def _serial_batch(n: int = 3) -> lmc_batch.LMCacheBatchedStream:
    kv = InMemoryKV()
    engine = FakeEngine(kv)
    batch = lmc_batch.LMCacheBatchedStream("serial")
    for i in range(n):
        batch.add(lmc_stream.create_request(kv, engine, [i, *PROMPT]))
    batch.prefill({})
    return batch


@EXAMPLES
@given(
    method=st.sampled_from(sorted(SELECTING)),
    unknown=stream_ids,
    known=st.integers(0, 3),
    data=st.data(),
)
def test_an_unknown_stream_id_is_refused_by_every_phase_before_any_stream_runs(
    method: str, unknown: Any, known: int, data: st.DataObject
) -> None:
    """A phase selecting an unknown id (among known ones) raises naming it; no stream runs."""
    TRIED[f"unknown id in {method}"] += 1
    with _serial_batch() as batch:
        ids: list[Any] = list(batch.streams)[:known]
        if unknown in batch.streams:
            return
        ids.insert(data.draw(st.integers(0, len(ids)), label="at"), unknown)
        before = _snapshot(batch)
        with pytest.raises(LMCacheBatchedStreamError) as info:
            SELECTING[method](batch, ids)
        assert f"stream {unknown} is not in the batch" in str(info.value)
        assert _unchanged(batch, before)


@EXAMPLES
@given(unknown=stream_ids)
def test_get_stream_refuses_an_unknown_id_naming_it(unknown: Any) -> None:
    """get_stream(unknown) raises LMCacheBatchedStreamError naming the id."""
    TRIED["unknown id in get_stream"] += 1
    with _serial_batch(1) as batch:
        if unknown in batch.streams:
            return
        with pytest.raises(
            LMCacheBatchedStreamError, match="is not in the batch"
        ) as info:
            batch.get_stream(unknown)
        assert str(unknown) in str(info.value)


@EXAMPLES
@given(unknown=stream_ids)
def test_get_perf_metrics_refuses_an_unknown_id_naming_it(unknown: Any) -> None:
    """get_perf_metrics over an unknown id raises naming it, rather than
    reporting a stream that does not exist as a failed one."""
    TRIED["unknown id in get_perf_metrics"] += 1
    with _serial_batch(1) as batch:
        if unknown in batch.streams:
            return
        with pytest.raises(
            LMCacheBatchedStreamError, match="is not in the batch"
        ) as info:
            batch.get_perf_metrics(1.0, "terminal", 80, "prefill", [unknown])
        assert str(unknown) in str(info.value)


@EXAMPLES
@given(mode=st.text(max_size=12).filter(lambda m: m not in ("prefill", "decode")))
def test_get_perf_metrics_refuses_an_unknown_mode_naming_it(mode: str) -> None:
    """get_perf_metrics(mode=...) other than prefill/decode raises naming the mode."""
    TRIED["mode"] += 1
    with _serial_batch(1) as batch, pytest.raises(LMCacheBatchedStreamError) as info:
        batch.get_perf_metrics(1.0, "terminal", 80, mode)
    assert repr(mode) in str(info.value)


#: The phases that take ``fmt`` and ``width``.
FORMATTED: dict[str, Callable[..., Any]] = {
    "prefill": lambda b, **kw: b.prefill({}, **kw),
    "modify": lambda b, **kw: b.modify(keep_first_chunk, **kw),
    "decode": lambda b, **kw: b.decode({"max_tokens": 2}, **kw),
}


@EXAMPLES
@given(method=st.sampled_from(sorted(FORMATTED)), fmt=bad_formats)
def test_an_unknown_format_is_refused_naming_it(method: str, fmt: str) -> None:
    """A phase given an unknown fmt raises ValueError naming it and the known ones."""
    TRIED[f"fmt in {method}"] += 1
    with _serial_batch() as batch, pytest.raises(ValueError) as info:
        FORMATTED[method](batch, fmt=fmt)
    assert repr(fmt) in str(info.value)
    assert all(name in str(info.value) for name in available_formats())


@EXAMPLES
@given(method=st.sampled_from(sorted(FORMATTED)), width=bad_widths)
def test_a_bad_width_is_refused_naming_it(method: str, width: Any) -> None:
    """A phase given a terminal width below 20 or not an int raises ValueError naming it."""
    TRIED[f"width in {method}"] += 1
    with _serial_batch() as batch, pytest.raises(ValueError) as info:
        FORMATTED[method](batch, fmt="terminal", width=width)
    assert "width" in str(info.value) and _names(str(info.value), width)


@EXAMPLES
@given(
    method=st.sampled_from(sorted(FORMATTED)),
    bad=st.one_of(
        st.fixed_dictionaries({"fmt": bad_formats}),
        st.fixed_dictionaries({"width": bad_widths}),
    ),
)
def test_a_bad_format_or_width_is_refused_before_any_stream_runs(
    method: str, bad: dict[str, Any]
) -> None:
    """A phase given a bad fmt or width changes no stream: the report options are
    checked before the phase, not after it has committed."""
    TRIED[f"report option before {method}"] += 1
    with _serial_batch() as batch:
        before = _snapshot(batch)
        with pytest.raises((ValueError, TypeError)):
            FORMATTED[method](batch, **bad)
        assert _unchanged(batch, before)


# -- a barrage on a process batch ------------------------------------------------


def _attack(
    batch: lmc_batch.LMCacheBatchedStream,
    store: SharedMemoryKVStore,
    kind: str,
    bad: Any,
) -> BaseException:
    """Make one bad call of ``kind``; return what it raised."""
    ids = list(batch.streams)
    calls: dict[str, Callable[[], Any]] = {
        "max_tokens": lambda: batch.decode({"max_tokens": bad}),
        "unknown id": lambda: SELECTING[
            ("prefill", "modify", "decode", "run_streams")[len(str(bad)) % 4]
        ](batch, [*ids[:2], bad]),
        "ids as a string": lambda: batch.decode({}, stream_ids=ids[0]),  # type: ignore[arg-type]
        "id selected twice": lambda: batch.modify(
            keep_first_chunk, stream_ids=ids[:1] * 2
        ),
        "not a stream": lambda: batch.add(bad),
        "a stream twice": lambda: batch.add(batch.streams[ids[0]]),
        "fn not callable": lambda: batch.modify(bad),
        "prompt token": lambda: batch.add(
            lmc_stream.create_request(
                store, FakeEngine(store), _with_bad(PROMPT, bad, 3)
            )
        ),
    }
    try:
        calls[kind]()
    except Exception as exc:
        return exc
    raise AssertionError(f"{kind} with {bad!r} was accepted")


#: The bad calls of the barrage, each drawn with a bad value.
ATTACKS = {
    "max_tokens": bad_max_tokens,
    "unknown id": st.text(max_size=40),
    "ids as a string": st.none(),
    "id selected twice": st.none(),
    "a stream twice": st.none(),
    "not a stream": bad_tokens,
    "fn not callable": bad_tokens,
    "prompt token": bad_tokens,
}


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def _barrage(
    data: st.DataObject,
    batch: lmc_batch.LMCacheBatchedStream,
    store: SharedMemoryKVStore,
    pids: list[int],
) -> None:
    """One bad call on ``batch``: refused, naming the culprit; nothing changed."""
    kind = data.draw(st.sampled_from(sorted(ATTACKS)), label="kind")
    bad = data.draw(ATTACKS[kind], label="bad")
    if kind == "unknown id" and bad in batch.streams:
        return
    TRIED[f"process batch: {kind}"] += 1
    first = next(iter(batch.streams))
    culprit = {
        "max_tokens": bad,
        "unknown id": bad,
        "prompt token": bad,
        "not a stream": type(bad).__name__,
        "fn not callable": type(bad).__name__,
    }.get(kind, first)
    before = _snapshot(batch)
    error = _attack(batch, store, kind, bad)
    if kind == "fn not callable":
        assert isinstance(error, TypeError), repr(error)
    else:
        assert isinstance(error, (LMCacheBatchedStreamError, StreamInputError))
    assert _names(str(error), culprit), f"{kind}: {error} does not name {culprit!r}"
    if kind == "max_tokens":
        assert isinstance(error, LMCacheBatchedStreamError)
        assert set(error.failures) == set(batch.streams)
        assert all(isinstance(e, StreamInputError) for e in error.failures.values())
    assert _unchanged(batch, before)
    assert batch.executor.pids() == pids  # type: ignore[attr-defined]


def test_a_barrage_of_bad_input_leaves_the_pool_and_the_store_whole(
    store: SharedMemoryKVStore,
) -> None:
    """100 bad calls on a started process batch: each refused with a typed error
    and no stream changed; then the same workers run prefill/modify/decode as a
    serial run does, and every stored chunk passes its checksum."""
    prompts = [[i, *PROMPT] for i in range(4)]
    with lmc_batch.LMCacheBatchedStream(
        "process", mp_context="spawn", max_workers=2
    ) as batch:
        engine = FakeEngine(store)
        for prompt in prompts:
            batch.add(lmc_stream.create_request(store, engine, prompt))
        executor = batch.executor
        assert isinstance(executor, ProcessExecutor)
        executor.start()
        pids = executor.pids()
        assert len(pids) == 2 and os.getpid() not in pids

        _barrage(batch=batch, store=store, pids=pids)

        batch.prefill({}, phase_timeout=WAIT_S)
        batch.modify(keep_first_chunk, phase_timeout=WAIT_S)
        batch.decode({"max_tokens": 3}, phase_timeout=WAIT_S)
        assert executor.pids() == pids
        got = [s.state for s in batch.streams.values()]

    reference = InMemoryKV()
    with lmc_batch.LMCacheBatchedStream("serial") as serial:
        engine = FakeEngine(reference)
        for prompt in prompts:
            serial.add(lmc_stream.create_request(reference, engine, prompt))
        serial.prefill({})
        serial.modify(keep_first_chunk)
        serial.decode({"max_tokens": 3})
        assert got == [s.state for s in serial.streams.values()]
    with warnings.catch_warnings():
        warnings.simplefilter("error", CorruptChunkWarning)
        for prompt, state in zip(prompts, got, strict=True):
            np.testing.assert_array_equal(
                store.retrieve(prompt), kv_for(prompt)[:, :, :8]
            )
            np.testing.assert_array_equal(
                store.retrieve(state.tokens), reference.retrieve(state.tokens)
            )
