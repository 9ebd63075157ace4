"""Specification of ``executor="auto"`` and the GIL hints (issue #12).

Decisions are checked on fns that are clearly GIL-bound (a pure-Python loop
of tens of milliseconds) or clearly not (a sleep, which releases the GIL);
which process ran each stream is read from the fn's own ``info``.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import lmcache_mp
import lmcache_mp.batch as lmc_batch
import lmcache_mp.stream as lmc_stream
from lmcache_mp._core.phase import PhaseSpec
from lmcache_mp.edits import make_edit
from lmcache_mp.engine import EmbeddedEngine
from lmcache_mp.executors._auto import AutoExecutor, GilWatch, weigh
from lmcache_mp.hints import gil_hint
from lmcache_mp.kv import SharedMemoryKVStore
from tests._fakes import FakeEngine, InMemoryKV

Result = tuple[np.ndarray, list[int], int]


def spin(seconds: float) -> None:
    """Run Python bytecode (holding the GIL) for ``seconds``."""
    end = time.perf_counter() + seconds
    n = 0
    while time.perf_counter() < end:
        n += 1


def python_loop(kv: np.ndarray, tokens: list[int]) -> Result:
    """A GIL-bound edit: 80 ms of bytecode; reports its pid."""
    spin(0.08)
    return kv, tokens, os.getpid()


def sleeper(kv: np.ndarray, tokens: list[int]) -> Result:
    """An edit that waits 30 ms without the GIL; reports its pid."""
    time.sleep(0.03)
    return kv, tokens, os.getpid()


@lmcache_mp.gil_bound
def marked_bound(kv: np.ndarray, tokens: list[int]) -> Result:
    """Marked GIL-bound, though it is quick; reports its pid."""
    return kv, tokens, os.getpid()


@pytest.fixture(params=["spawn", "forkserver"])
def auto_batch(
    request: pytest.FixtureRequest, store: SharedMemoryKVStore
) -> Iterator[lmc_batch.LMCacheBatchedStream]:
    """A prefilled 4-stream auto batch whose pool already runs (once per start method)."""
    with lmc_batch.LMCacheBatchedStream(
        "auto", max_workers=2, mp_context=request.param
    ) as batch:
        engine = FakeEngine(store)
        for i in range(4):
            batch.add(lmc_stream.create_request(store, engine, list(range(i, i + 8))))
        batch.prefill({})
        executor = batch.executor
        assert isinstance(executor, AutoExecutor)
        executor.process.start(4)
        yield batch


def _pids(batch: lmc_batch.LMCacheBatchedStream) -> list[int]:
    return [batch.modify_metrics[sid].info for sid in batch.streams]


def _config(report: lmcache_mp.Metrics) -> dict[str, Any]:
    config: dict[str, Any] = report.to_dict()["metrics"]["config"]
    return config


# --- the GIL watch and the cost model ----------------------------------------


def test_gil_watch_sees_bytecode_holding_the_gil() -> None:
    """A pure-Python loop holds the GIL for most of its run."""
    with GilWatch() as watch:
        spin(0.1)
    assert watch.held > 0.5


def test_gil_watch_sees_a_sleep_release_the_gil() -> None:
    """A sleep (C code without the GIL) holds it for almost none of its run."""
    with GilWatch() as watch:
        time.sleep(0.1)
    assert watch.held < 0.3


def test_gil_watch_stops_its_thread() -> None:
    """The watcher thread ends with the block."""
    before = threading.active_count()
    with GilWatch():
        assert threading.active_count() == before + 1
    assert threading.active_count() == before


@pytest.mark.parametrize(
    ("seconds", "held", "cpu", "start_s", "expected"),
    [
        (0.5, 1.0, 1.0, 0.0, "process"),  # GIL-bound, pool running
        (0.5, 1.0, 1.0, 1.0, "process"),  # GIL-bound and long enough to start one
        (0.002, 1.0, 1.0, 1.0, "thread"),  # GIL-bound but cheap: not worth a start
        (0.05, 0.0, 1.0, 1.0, "thread"),  # releases the GIL; a start costs more
        (0.05, 0.0, 0.0, 0.0, "thread"),  # waits (I/O): threads overlap them all
        (0.0001, 1.0, 1.0, 0.0, "thread"),  # the round trip costs more than work
    ],
)
def test_weigh_picks_the_cheaper_executor(
    seconds: float, held: float, cpu: float, start_s: float, expected: str
) -> None:
    """The cost model: threads overlap waits but run held CPU work serially;
    processes pay a round trip per stream and the pool start."""
    choice = weigh(seconds, held, rest=7, cores=2, start_s=start_s, cpu=cpu)
    assert choice.executor == expected
    assert f"{held:.0%}" in choice.reason


# --- hints -----------------------------------------------------------------------


def test_hints_mark_functions_and_classes() -> None:
    """gil_bound/releases_gil set the hint that gil_hint reads, through partials."""
    assert gil_hint(marked_bound) is True
    assert gil_hint(functools.partial(marked_bound)) is True
    assert gil_hint(python_loop) is None
    assert gil_hint(make_edit("pyscore")) is True
    assert gil_hint(make_edit("redundancy")) is False
    assert gil_hint(EmbeddedEngine) is True


def test_hint_on_an_object_without_attributes_is_a_type_error() -> None:
    """A frozen instance cannot carry a hint; the error says to mark its class."""
    with pytest.raises(TypeError, match="mark its class"):
        lmcache_mp.releases_gil(make_edit("stride"))


# --- phases --------------------------------------------------------------------


def test_gil_bound_fn_runs_on_processes(
    auto_batch: lmc_batch.LMCacheBatchedStream,
) -> None:
    """An unknown GIL-bound fn: the first stream runs here, the rest on workers."""
    report = auto_batch.modify(python_loop)
    pids = _pids(auto_batch)
    assert pids[0] == os.getpid()
    assert os.getpid() not in pids[1:]
    config = _config(report)
    assert config["executor"] == "auto"
    assert config["executor_chosen"] == "process"
    assert "holding the GIL" in config["executor_reason"]


def test_gil_free_fn_runs_on_threads(
    auto_batch: lmc_batch.LMCacheBatchedStream,
) -> None:
    """An unknown fn that releases the GIL runs on threads in this process."""
    report = auto_batch.modify(sleeper)
    assert set(_pids(auto_batch)) == {os.getpid()}
    assert _config(report)["executor_chosen"] == "thread"


def test_decision_is_kept_for_the_same_fn(
    auto_batch: lmc_batch.LMCacheBatchedStream,
) -> None:
    """The second phase with the same fn is not measured: every stream goes
    to the workers, and the reason is the first phase's."""
    first = _config(auto_batch.modify(python_loop))
    second = _config(auto_batch.modify(python_loop))
    assert os.getpid() not in _pids(auto_batch)
    assert second["executor_reason"] == first["executor_reason"]


def test_gil_bound_hint_skips_the_measurement(
    auto_batch: lmc_batch.LMCacheBatchedStream,
) -> None:
    """A fn marked gil_bound goes to the workers at once, even a quick one."""
    report = auto_batch.modify(marked_bound)
    assert os.getpid() not in _pids(auto_batch)
    assert _config(report)["executor_reason"] == "the modify fn is marked gil_bound"


def test_unpicklable_fn_runs_on_threads(
    auto_batch: lmc_batch.LMCacheBatchedStream,
) -> None:
    """A fn that cannot be pickled (it holds a lock) still runs, on threads."""
    lock = threading.Lock()

    def locked(kv: np.ndarray, tokens: list[int]) -> Result:
        with lock:
            return kv, tokens, os.getpid()

    report = auto_batch.modify(locked)
    assert set(_pids(auto_batch)) == {os.getpid()}
    assert "cannot be pickled" in _config(report)["executor_reason"]


class _UnpicklableKV(InMemoryKV):
    """A KV context that cannot be sent to a worker."""

    def __reduce__(self) -> Any:
        raise TypeError("this context stays in its process")


def test_phase_that_cannot_be_pickled_runs_on_threads() -> None:
    """A context that cannot reach the workers does not fail the phase:
    auto runs it on threads and says why."""
    kv = _UnpicklableKV()
    with lmc_batch.LMCacheBatchedStream("auto", max_workers=2) as batch:
        engine = FakeEngine(kv)
        for i in range(3):
            batch.add(lmc_stream.create_request(kv, engine, list(range(i, i + 8))))
        batch.prefill({})
        report = batch.modify(marked_bound)
    assert set(_pids(batch)) == {os.getpid()}
    config = _config(report)
    assert config["executor_chosen"] == "thread"
    assert "cannot be pickled" in config["executor_reason"]


def test_a_failing_first_stream_still_commits_the_others(
    auto_batch: lmc_batch.LMCacheBatchedStream,
) -> None:
    """The measured stream's failure is its own: the rest run and commit."""
    first = next(iter(auto_batch.streams))

    def fails_first(kv: np.ndarray, tokens: list[int]) -> Result:
        if tokens[0] == 0:
            raise ValueError("bad stream")
        return kv[:, :, :4], tokens[:4], os.getpid()

    with pytest.raises(lmcache_mp.LMCacheBatchedStreamError) as info:
        auto_batch.modify(fails_first)
    assert set(info.value.failures) == {first}
    assert all(
        len(s.tokens) == 4 for sid, s in auto_batch.streams.items() if sid != first
    )


# --- generate phases pick by the engine ------------------------------------------


class _NoHintEngine(FakeEngine):
    """An engine without a hint."""


@pytest.mark.parametrize(
    ("engine_hint", "n_jobs", "expected"),
    [
        (True, 4, "process"),
        (False, 4, "thread"),
        (None, 4, "thread"),
        (True, 1, "thread"),
    ],
)
def test_generate_picks_by_the_engine(
    engine_hint: bool | None, n_jobs: int, expected: str
) -> None:
    """GIL-bound engines get processes; I/O-bound and unhinted ones threads,
    as upstream; one stream gets threads."""
    engine: Any = _NoHintEngine(None)
    if engine_hint is not None:
        engine = functools.partial(
            (lmcache_mp.gil_bound if engine_hint else lmcache_mp.releases_gil)(
                lambda *a: iter(())
            )
        )
    spec = PhaseSpec(kind="generate", contexts=(), engines=(engine,))
    executor = AutoExecutor()
    try:
        assert executor.choose_generate(spec, n_jobs).executor == expected
    finally:
        executor.close()
