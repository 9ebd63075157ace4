"""Specification of LMCacheBatchedStream: upstream's API, run on every executor."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import lmcache_mp.batch as lmc_batch
import lmcache_mp.stream as lmc_stream
from lmcache_mp.errors import LMCacheBatchedStreamError, LMCacheStreamError
from lmcache_mp.kv import SharedMemoryKVStore, connect
from tests._fakes import FakeEngine, kv_for

PROMPT_LENGTHS = (10, 9, 13)


@pytest.fixture(
    params=[
        "serial",
        "thread",
        "process-spawn",
        "process-forkserver",
        "auto-forkserver",
    ],
)
def executor_opts(request: pytest.FixtureRequest) -> dict[str, Any]:
    """Every executor; the process one once per start method, auto on one."""
    name, _, method = request.param.partition("-")
    opts: dict[str, Any] = {"executor": name}
    if method:
        opts.update(mp_context=method, max_workers=2)
    return opts


@pytest.fixture
def batch(executor_opts: dict[str, Any]) -> Iterator[lmc_batch.LMCacheBatchedStream]:
    """A batch on the parametrized executor, closed afterwards."""
    with lmc_batch.LMCacheBatchedStream(**executor_opts) as b:
        yield b


def _fill(
    batch: lmc_batch.LMCacheBatchedStream, store: SharedMemoryKVStore, n: int = 3
) -> list[str]:
    engine = FakeEngine(store)
    for i in range(n):
        length = PROMPT_LENGTHS[i % len(PROMPT_LENGTHS)]
        batch.add(lmc_stream.create_request(store, engine, list(range(i, i + length))))
    return list(batch.streams)


def drop_to_first_chunk(
    kv: np.ndarray, tokens: list[int]
) -> tuple[np.ndarray, list[int], dict[str, int]]:
    """A modify fn keeping the first 4 tokens (module level, like most user fns)."""
    return kv[:, :, :4], tokens[:4], {"dropped": len(tokens) - 4}


def fail_on_token_two(
    kv: np.ndarray, tokens: list[int]
) -> tuple[np.ndarray, list[int]]:
    """A modify fn that raises for the stream whose prompt starts at 2."""
    if tokens[0] == 2:
        raise ValueError("cannot edit this one")
    return kv[:, :, :4], tokens[:4]


def test_seed_usage_block_reports_exact_token_counts(
    batch: lmc_batch.LMCacheBatchedStream, store: SharedMemoryKVStore
) -> None:
    """The seed's prefill -> modify -> decode runs; to_dict() has upstream's keys and exact counts."""
    _fill(batch, store)
    prefill = batch.prefill({"temperature": 1.0}).to_dict()
    assert prefill["metrics"]["config"]["num_streams"] == 3
    assert prefill["metrics"]["results"]["input_tokens"] == sum(PROMPT_LENGTHS)
    assert prefill["metrics"]["results"]["input_tput"] > 0
    modify = batch.modify(drop_to_first_chunk).to_dict()["metrics"]["results"]
    # Cached (chunk-aligned) prefixes of 11, 10 and 14 tokens: 8, 8 and 12.
    assert (modify["tokens_before"], modify["tokens_after"]) == (28, 12)
    results = batch.decode({"max_tokens": 5})
    data = results.to_dict()
    assert data["metrics"]["results"]["output_tokens"] == 15
    assert data["metrics"]["results"]["output_tput"] > 0
    assert data["metrics"]["config"]["executor"] == batch.executor.name
    # Decode prompt: 4 kept tokens + uncached tail (11-8, 10-8, 14-12) = 7, 6, 6.
    assert [len(s.tokens) for s in batch.streams.values()] == [12, 11, 11]
    results.emit()


def test_threads_and_processes_give_identical_streams(
    executor_opts: dict[str, Any], store: SharedMemoryKVStore
) -> None:
    """Every executor leaves the same tokens, text and stored KV as a serial run."""

    def run(opts: dict[str, Any], ctx: SharedMemoryKVStore) -> list[tuple[Any, ...]]:
        with lmc_batch.LMCacheBatchedStream(**opts) as b:
            _fill(b, ctx)
            b.prefill({})
            b.modify(drop_to_first_chunk)
            b.decode({"max_tokens": 4})
            return [
                (
                    s.tokens,
                    s.suffix_tokens(),
                    s.output_text(),
                    s.output_tokens(),
                    s.done,
                    ctx.retrieve(s.tokens).tobytes(),
                )
                for s in b.streams.values()
            ]

    reference_store = connect(chunk_size=4)
    try:
        expected = run({"executor": "serial"}, reference_store)
    finally:
        reference_store.destroy()
    assert run(executor_opts, store) == expected


def test_one_failing_fn_does_not_stop_the_others(
    batch: lmc_batch.LMCacheBatchedStream, store: SharedMemoryKVStore
) -> None:
    """One of five fns raises: four streams commit; the failed one keeps tokens, suffix and KV."""
    ids = _fill(batch, store, n=5)
    batch.prefill({})
    failed = ids[2]
    before = batch.streams[failed].state.copy()
    kv_before = store.retrieve(before.tokens)
    with pytest.raises(LMCacheBatchedStreamError, match=failed) as info:
        batch.modify(fail_on_token_two)
    error = info.value
    assert list(error.failures) == [failed]
    assert isinstance(error.failures[failed], LMCacheStreamError)
    assert "cannot edit this one" in str(error.failures[failed]) + str(
        error.failures[failed].__cause__
    )
    assert error.metrics is not None
    assert error.metrics.to_dict()["metrics"]["results"]["streams_modified"] == 4
    assert batch.streams[failed].state == before
    np.testing.assert_array_equal(store.retrieve(before.tokens), kv_before)
    for sid in ids:
        if sid != failed:
            assert len(batch.streams[sid].tokens) == 4


def test_one_failing_engine_call_does_not_stop_the_others(
    batch: lmc_batch.LMCacheBatchedStream, store: SharedMemoryKVStore
) -> None:
    """A post_completion that raises for one stream fails only that stream's generate."""
    ids = _fill(batch, store, n=3)
    bad = batch.streams[ids[1]]
    bad.post_completion = FakeEngine(store, vocab=0)  # modulo by zero inside
    with pytest.raises(LMCacheBatchedStreamError, match=ids[1]) as info:
        batch.prefill({})
    assert list(info.value.failures) == [ids[1]]
    assert set(batch.perf_metrics) == {ids[0], ids[2]}
    assert bad.decoded_tokens() == 0
    assert info.value.metrics is not None
    assert info.value.metrics.to_dict()["metrics"]["results"]["failed_streams"] == 1


def test_stream_ids_select_a_subset(
    batch: lmc_batch.LMCacheBatchedStream, store: SharedMemoryKVStore
) -> None:
    """Only the selected streams run; num_streams counts them."""
    ids = _fill(batch, store)
    report = batch.prefill({}, stream_ids=[ids[1]])
    assert report.to_dict()["metrics"]["config"]["num_streams"] == 1
    assert [batch.streams[s].decoded_tokens() for s in ids] == [0, 1, 0]
    assert list(batch.perf_metrics) == [ids[1]]


def test_prefill_forces_max_tokens_one_without_mutating_params(
    batch: lmc_batch.LMCacheBatchedStream, store: SharedMemoryKVStore
) -> None:
    """prefill() runs with max_tokens=1 and leaves the caller's dict alone."""
    _fill(batch, store)
    params = {"max_tokens": 64, "temperature": 0.5}
    report = batch.prefill(params)
    assert params == {"max_tokens": 64, "temperature": 0.5}
    assert all(s.decoded_tokens() == 1 for s in batch.streams.values())
    assert set(report.to_dict()["metrics"]["latency"]) == {
        "mean_ttft_ms",
        "p50_ttft_ms",
        "p90_ttft_ms",
        "p99_ttft_ms",
    }


def test_modify_info_comes_back_per_stream(
    batch: lmc_batch.LMCacheBatchedStream, store: SharedMemoryKVStore
) -> None:
    """What a fn returns as a third item is available per stream in modify_metrics."""
    ids = _fill(batch, store)
    batch.prefill({})
    batch.modify(drop_to_first_chunk)
    assert [batch.modify_metrics[s].info for s in ids] == [
        {"dropped": 4},
        {"dropped": 4},
        {"dropped": 8},
    ]


def test_lambdas_and_closures_work_as_modify_fns(
    batch: lmc_batch.LMCacheBatchedStream, store: SharedMemoryKVStore
) -> None:
    """A closure over local state is shipped to workers (pickled by value)."""
    ids = _fill(batch, store)
    batch.prefill({})
    scale = np.float32(3.0)
    batch.modify(lambda kv, toks: (kv[:, :, -4:] * scale, toks[-4:]))
    stream = batch.streams[ids[0]]
    np.testing.assert_array_equal(
        store.retrieve(stream.tokens), kv_for(list(range(8)))[:, :, 4:] * 3
    )


def test_decode_report_has_latency_and_cache_sections(
    batch: lmc_batch.LMCacheBatchedStream, store: SharedMemoryKVStore
) -> None:
    """decode reports TTFT/TPOT percentiles, per-stream speed and prompt-cache hits."""
    _fill(batch, store)
    batch.prefill({})
    data = batch.decode({"max_tokens": 3}).to_dict()["metrics"]
    assert {"mean_ttft_ms", "p99_tpot_ms", "p50_stream_tput", "min_stream_tput"} <= set(
        data["latency"]
    )
    # The fake engine cached each prompt's full chunks at prefill: 8, 8, 12 tokens.
    assert data["cache"]["cache_hit_tokens"] == 28
    assert data["cache"]["computed_tokens"] == sum(n + 1 for n in PROMPT_LENGTHS) - 28


def test_empty_selection_is_a_zero_duration_report(
    batch: lmc_batch.LMCacheBatchedStream,
) -> None:
    """Selecting no stream runs nothing and reports zero duration, as upstream."""
    assert batch.run_streams({}) == 0.0
    report = batch.decode({"max_tokens": 2}, stream_ids=[])
    assert report.to_dict()["metrics"]["results"]["duration"] == 0.0
    assert batch.modify_stream(drop_to_first_chunk) == 0.0


def doubled(kv: np.ndarray, tokens: list[int]) -> tuple[np.ndarray, list[int]]:
    """A same-token edit: every token kept, the KV doubled."""
    return kv * 2, tokens


def test_a_same_token_edit_lands_in_the_store(
    batch: lmc_batch.LMCacheBatchedStream, store: SharedMemoryKVStore
) -> None:
    """An edit that keeps the tokens replaces the cached KV (committed with the stream)."""
    ids = _fill(batch, store)
    batch.prefill({})
    before = {sid: store.retrieve(batch.streams[sid].tokens) for sid in ids}
    batch.modify(doubled)
    for sid in ids:
        np.testing.assert_array_equal(
            store.retrieve(batch.streams[sid].tokens), before[sid] * 2
        )
    assert not [n for n in os.listdir(store.path) if n.startswith(".tmp-")]


@pytest.mark.parametrize(("cap", "threads"), [(None, 3), (2, 2)])
def test_a_thread_report_names_the_threads_the_phase_ran(
    store: SharedMemoryKVStore, cap: int | None, threads: int
) -> None:
    """The thread executor's report gives the threads a phase ran on: one
    per stream by default (as upstream), else the cap."""
    with lmc_batch.LMCacheBatchedStream("thread", max_workers=cap) as batch:
        _fill(batch, store)
        report = batch.prefill({}).to_dict()["metrics"]["config"]
    assert (report["executor"], report["workers"]) == ("thread", threads)
