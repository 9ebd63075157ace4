"""Specification of ``executor="auto"`` and the GIL hints.

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
from lmcache_mp._core.phase import PhaseSpec, build_phase
from lmcache_mp._util.gilwatch import GilProbe, GilWatch, queued_s
from lmcache_mp.edits import make_edit
from lmcache_mp.engine import EmbeddedEngine
from lmcache_mp.executors import _auto
from lmcache_mp.executors._auto import AutoExecutor
from lmcache_mp.executors._cost import ROUND_TRIP_S, weigh
from lmcache_mp.executors._worker import run_job
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


def first_quick(kv: np.ndarray, tokens: list[int]) -> Result:
    """Waits 30 ms without the GIL on the first stream (tokens from 0),
    0.5 s on the others, so that the first one's outcome is back while the
    others still run; reports its pid."""
    time.sleep(0.03 if tokens[0] == 0 else 0.5)
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


def test_gil_watch_reports_cpu_and_core_waits_within_the_wall_time() -> None:
    """CPU used and time queued for a core are each within the block's wall
    time (a sleep uses neither much)."""
    with GilWatch() as watch:
        spin(0.05)
        time.sleep(0.05)
    assert 0.0 < watch.cpu_s <= watch.wall_s
    assert 0.0 <= watch.queued_s <= watch.wall_s


def test_queued_time_only_grows() -> None:
    """The run-queue wait of a thread is a running total (0 where the OS
    does not report it)."""
    first = queued_s()
    spin(0.02)
    assert queued_s() >= first >= 0.0


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
        # GIL-bound on a busy machine: half its wall time it waited for a
        # core, holding the GIL all along; not waits threads overlap.
        (0.3, 0.98, 0.5, 0.0, "process"),
        (0.2, 0.05, 1.0, 0.0, "process"),  # BLAS work: processes use both cores
        (0.002, 1.0, 1.0, 1.0, "thread"),  # GIL-bound but cheap: not worth a start
        (0.05, 0.0, 1.0, 1.0, "thread"),  # releases the GIL; a start costs more
        (0.05, 0.0, 0.0, 0.0, "thread"),  # waits (I/O): threads overlap them all
        (0.0001, 1.0, 1.0, 0.0, "thread"),  # the round trip costs more than work
    ],
)
def test_weigh_picks_the_cheaper_executor(
    seconds: float, held: float, cpu: float, start_s: float, expected: str
) -> None:
    """The cost model: threads overlap waits but run the GIL-held share
    serially; processes pay a round trip per stream and the pool start."""
    choice = weigh(seconds, held, rest=7, cores=2, start_s=start_s, cpu=cpu)
    assert choice.executor == expected
    assert f"{held:.0%}" in choice.reason


@pytest.mark.parametrize("cores", [2, 8, 64])
@pytest.mark.parametrize("cpu", [1.0, 0.4])
def test_weigh_counts_a_gil_holding_fn_as_serial_on_threads(
    cores: int, cpu: float
) -> None:
    """A fn holding the GIL all its wall time costs the sum of its streams on
    threads, whatever the cores and however much of it was CPU."""
    choice = weigh(0.3, 1.0, rest=7, cores=cores, start_s=0.0, cpu=cpu)
    assert choice.threads_s == pytest.approx(7 * 0.3)
    assert choice.executor == "process"


def test_weigh_counts_processes_in_rounds_of_workers() -> None:
    """Processes run whole streams, ``cores`` at a time: 7 streams on 2 cores
    take 4 rounds, plus a round trip each and the pool start."""
    choice = weigh(0.3, 1.0, rest=7, cores=2, start_s=0.5)
    assert choice.processes_s == pytest.approx(4 * 0.3 + 7 * ROUND_TRIP_S + 0.5)


def test_weigh_runs_gil_free_cpu_work_on_threads_with_many_cores() -> None:
    """CPU work that releases the GIL spreads over threads: with cores to
    spare and no pool running, a start is not worth it."""
    choice = weigh(0.05, 0.0, rest=15, cores=32, start_s=1.0, cpu=1.0)
    assert choice.executor == "thread"
    assert choice.threads_s < choice.processes_s


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
    """An unknown GIL-bound fn, with the pool running: the measured stream
    runs in a worker, and so does every other one; none runs here."""
    report = auto_batch.modify(python_loop)
    assert os.getpid() not in _pids(auto_batch)
    config = _config(report)
    assert config["executor"] == "auto"
    assert config["executor_chosen"] == "process"
    assert "holding the GIL" in config["executor_reason"]


def test_gil_free_fn_runs_on_threads(
    auto_batch: lmc_batch.LMCacheBatchedStream, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unknown fn that waits without the GIL, with the pool running: the
    first round (one stream per worker, the first measured) runs on the
    workers; the streams not sent when the measurement came back run on
    threads in this process."""
    monkeypatch.setattr(_auto, "physical_cores", lambda: 2)
    report = auto_batch.modify(first_quick)
    pids = _pids(auto_batch)
    executor = auto_batch.executor
    assert isinstance(executor, AutoExecutor)
    assert set(pids[:2]) <= set(executor.process.pids())
    assert pids[2] == pids[3] == os.getpid()
    assert _config(report)["executor_chosen"] == "thread"


def _inject(
    monkeypatch: pytest.MonkeyPatch,
    wall_s: float,
    cpu: float,
    held: float,
    queued: float = 0.0,
) -> None:
    """Make auto see this measurement of its measured stream, on a 2-core
    machine (the stream still runs; only its figures are replaced)."""
    monkeypatch.setattr(_auto, "physical_cores", lambda: 2)
    probe = GilProbe(wall_s, wall_s * cpu, wall_s * queued, held)
    monkeypatch.setattr(_auto, "measurement", lambda outcome: probe)


def quick(kv: np.ndarray, tokens: list[int]) -> Result:
    """An unhinted edit that does nothing; reports its pid."""
    return kv, tokens, os.getpid()


def test_measured_gil_holding_fn_goes_to_processes(
    auto_batch: lmc_batch.LMCacheBatchedStream, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fn measured holding the GIL 98% of a 300 ms stream, at half CPU
    (a busy machine), runs on processes: threads would run it serially."""
    _inject(monkeypatch, wall_s=0.3, cpu=0.5, held=0.98)
    report = auto_batch.modify(quick)
    assert os.getpid() not in _pids(auto_batch)
    assert _config(report)["executor_chosen"] == "process"


def test_measured_waiting_fn_goes_to_threads(
    auto_batch: lmc_batch.LMCacheBatchedStream, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fn measured waiting (no CPU, no GIL) runs on threads, which
    overlap its waits."""
    _inject(monkeypatch, wall_s=0.05, cpu=0.0, held=0.0)
    report = auto_batch.modify(first_quick)
    assert _pids(auto_batch)[2:] == [os.getpid()] * 2
    assert _config(report)["executor_chosen"] == "thread"


def test_time_queued_for_a_core_counts_as_cpu_not_as_waits(
    auto_batch: lmc_batch.LMCacheBatchedStream, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GIL-free fn that used a third of its stream on a core and waited
    two thirds for one (a busy machine) is CPU work that processes spread,
    not waits that threads overlap."""
    _inject(monkeypatch, wall_s=0.3, cpu=1 / 3, held=0.0, queued=2 / 3)
    report = auto_batch.modify(quick)
    assert _config(report)["executor_chosen"] == "process"


def test_a_running_pool_measures_the_first_stream_in_a_full_round(
    auto_batch: lmc_batch.LMCacheBatchedStream, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the pool running, the measured stream runs in a worker while
    the other worker runs the second: nothing runs alone."""
    _inject(monkeypatch, wall_s=0.05, cpu=0.0, held=0.0)
    auto_batch.modify(quick)
    pids = _pids(auto_batch)
    executor = auto_batch.executor
    assert isinstance(executor, AutoExecutor)
    assert set(pids[:2]) <= set(executor.process.pids())


def test_the_measurement_comes_from_the_worker_that_ran_it(
    auto_batch: lmc_batch.LMCacheBatchedStream,
) -> None:
    """The reason cites the measured stream's own figures, taken in its
    worker: a fn spinning 80 ms there is seen holding the GIL for most of
    a stream of at least 80 ms."""
    report = auto_batch.modify(python_loop)
    reason = _config(report)["executor_reason"]
    took_ms = float(reason.split("a stream took ", 1)[1].split(" ms", 1)[0])
    held = int(reason.split("holding the GIL ", 1)[1].split("%", 1)[0])
    assert took_ms >= 80.0
    assert held > 50


def test_a_measured_job_reports_its_probe_wherever_it_runs(
    store: SharedMemoryKVStore,
) -> None:
    """A job marked ``measure`` comes back with its GIL watch's figures
    (whole run: retrieve, fn, store); an unmarked one without."""
    engine = FakeEngine(store)
    streams = [
        lmc_stream.create_request(store, engine, list(range(i, i + 8)))
        for i in range(2)
    ]
    for s in streams:
        s.generate({})
    spec, jobs = build_phase(streams, kind="modify", fn=python_loop)
    jobs[0].measure = True
    measured = run_job(spec, jobs[0], remote=False)
    plain = run_job(spec, jobs[1], remote=False)
    assert measured.error is None and measured.probe is not None
    assert measured.probe.wall_s >= 0.08
    assert measured.probe.held > 0.5
    assert plain.probe is None


def test_an_idle_pool_is_not_started_to_run_beside_the_measurement(
    store: SharedMemoryKVStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before the pool runs, the measured stream runs alone: a pool start
    would outlast it, and threads may be the choice."""
    _inject(monkeypatch, wall_s=0.05, cpu=0.0, held=0.0)
    with lmc_batch.LMCacheBatchedStream("auto", max_workers=2) as batch:
        engine = FakeEngine(store)
        for i in range(4):
            batch.add(lmc_stream.create_request(store, engine, list(range(i, i + 8))))
        batch.prefill({})
        batch.modify(quick)
        executor = batch.executor
        assert isinstance(executor, AutoExecutor)
        assert executor.process.pids() == []
    assert set(_pids(batch)) == {os.getpid()}


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
