"""Specification of the batch registry and argument checks (no phase runs)."""

from __future__ import annotations

import pytest

import lmcache_mp.batch as lmc_batch
import lmcache_mp.stream as lmc_stream
from lmcache_mp.errors import LMCacheBatchedStreamError
from tests._fakes import FakeEngine, InMemoryKV


@pytest.fixture
def batch() -> lmc_batch.LMCacheBatchedStream:
    """A thread batch (no pool) holding two streams."""
    b = lmc_batch.LMCacheBatchedStream("thread")
    ctx = InMemoryKV(4)
    for prompt in ([1, 2, 3], [4, 5, 6]):
        b.add(lmc_stream.create_request(ctx, FakeEngine(ctx), prompt))
    return b


def test_adding_a_stream_twice_is_an_error_naming_it(
    batch: lmc_batch.LMCacheBatchedStream,
) -> None:
    """add() refuses a second stream with the same id."""
    stream = next(iter(batch.streams.values()))
    with pytest.raises(
        LMCacheBatchedStreamError, match=f"{stream.stream_id()} is already"
    ):
        batch.add(stream)


def test_adding_something_else_is_an_error(
    batch: lmc_batch.LMCacheBatchedStream,
) -> None:
    """add() takes streams only."""
    with pytest.raises(LMCacheBatchedStreamError, match="got list"):
        batch.add([1, 2])  # type: ignore[arg-type]


def test_get_stream_returns_the_stream_or_names_the_missing_id(
    batch: lmc_batch.LMCacheBatchedStream,
) -> None:
    """get_stream() finds a member and names an unknown id."""
    sid = next(iter(batch.streams))
    assert batch.get_stream(sid) is batch.streams[sid]
    with pytest.raises(LMCacheBatchedStreamError, match="nope is not in the batch"):
        batch.get_stream("nope")


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_unknown_stream_ids_are_an_error_before_anything_runs(
    batch: lmc_batch.LMCacheBatchedStream, phase: str
) -> None:
    """A phase given an unknown id raises naming it and runs no stream."""
    with pytest.raises(LMCacheBatchedStreamError, match="ghost"):
        getattr(batch, phase)({}, stream_ids=[next(iter(batch.streams)), "ghost"])
    assert all(s.decoded_tokens() == 0 for s in batch.streams.values())


def test_selecting_a_stream_twice_is_an_error(
    batch: lmc_batch.LMCacheBatchedStream,
) -> None:
    """The same id twice in stream_ids would run one stream twice at once."""
    sid = next(iter(batch.streams))
    with pytest.raises(LMCacheBatchedStreamError, match="selected twice"):
        batch.run_streams({}, stream_ids=[sid, sid])


def test_unknown_executor_lists_the_choices() -> None:
    """executor= accepts known names or an Executor; else ValueError listing them."""
    with pytest.raises(ValueError, match="process, serial, thread"):
        lmc_batch.LMCacheBatchedStream("gpu")


def test_unknown_start_method_lists_the_choices() -> None:
    """mp_context must be a start method of the platform."""
    with pytest.raises(ValueError, match="spawn"):
        lmc_batch.LMCacheBatchedStream("process", mp_context="teleport")


def test_invalid_report_mode_is_an_error(batch: lmc_batch.LMCacheBatchedStream) -> None:
    """get_perf_metrics() takes mode 'prefill' or 'decode' only."""
    with pytest.raises(LMCacheBatchedStreamError, match="invalid mode 'modify'"):
        batch.get_perf_metrics(1.0, "terminal", 80, "modify")


def test_unknown_format_lists_the_formats(
    batch: lmc_batch.LMCacheBatchedStream,
) -> None:
    """fmt must name a formatter."""
    with pytest.raises(ValueError, match="json, markdown, terminal"):
        batch.prefill({}, fmt="xml")


def test_a_closed_batch_refuses_phases(batch: lmc_batch.LMCacheBatchedStream) -> None:
    """After close() (or the with block) phases raise instead of restarting workers."""
    batch.close()
    batch.close()
    with pytest.raises(LMCacheBatchedStreamError, match="closed"):
        batch.prefill({})


def test_a_closed_batch_refuses_a_new_stream_naming_it(
    batch: lmc_batch.LMCacheBatchedStream,
) -> None:
    """add() after close() raises naming the stream, and the stream is not
    taken in (a closed batch pins nothing)."""
    batch.close()
    ctx = InMemoryKV(4)
    stream = lmc_stream.create_request(ctx, FakeEngine(ctx), [7, 8, 9])
    with pytest.raises(
        LMCacheBatchedStreamError, match=f"closed.*{stream.stream_id()}"
    ):
        batch.add(stream)
    assert stream.stream_id() not in batch.streams


def test_modify_needs_a_callable(batch: lmc_batch.LMCacheBatchedStream) -> None:
    """modify() with a non-callable fn is a TypeError before anything runs."""
    with pytest.raises(TypeError, match="callable"):
        batch.modify(42)  # type: ignore[arg-type]
