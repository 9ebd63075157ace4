"""Specification of the process executor: a persistent pool, once per start method."""

from __future__ import annotations

import functools
import gc
import importlib.util
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import numpy as np
import psutil
import pytest

import lmcache_mp.batch as lmc_batch
import lmcache_mp.stream as lmc_stream
from lmcache_mp._core.phase import build_phase
from lmcache_mp.errors import (
    LMCacheBatchedStreamError,
    LMCachePicklingError,
    PhaseTimeoutError,
)
from lmcache_mp.executors import PhaseRun
from lmcache_mp.executors._process import ProcessExecutor
from lmcache_mp.kv import SharedMemoryKVStore, connect
from tests._fakes import FakeEngine, FileBarrierEngine
from tests._scripts import all_gone, prefilled_batch_script

START_METHODS = ["spawn", "forkserver"]


@pytest.fixture(params=START_METHODS)
def start_method(request: pytest.FixtureRequest) -> str:
    """Each executor test runs once per start method."""
    return str(request.param)


def _batch(
    store: SharedMemoryKVStore, start_method: str, n: int = 4, **opts: Any
) -> lmc_batch.LMCacheBatchedStream:
    opts.setdefault("max_workers", 2)
    batch = lmc_batch.LMCacheBatchedStream("process", mp_context=start_method, **opts)
    engine = FakeEngine(store)
    for i in range(n):
        batch.add(lmc_stream.create_request(store, engine, list(range(i, i + 10))))
    return batch


def worker_pid(kv: np.ndarray, tokens: list[int]) -> tuple[np.ndarray, list[int], int]:
    """Report which process ran the edit."""
    return kv, tokens, os.getpid()


def test_the_pool_starts_once_and_serves_every_phase(
    store: SharedMemoryKVStore, start_method: str
) -> None:
    """Pool start-up is paid in the first phase only; later phases reuse the same workers."""
    with _batch(store, start_method) as batch:
        first = batch.prefill({}).to_dict()["metrics"]["transport"]
        pids = batch.executor.pids()  # type: ignore[attr-defined]
        batch.modify(worker_pid)
        later = batch.decode({"max_tokens": 2}).to_dict()["metrics"]["transport"]
        assert first["pool_start_s"] > 0 and later["pool_start_s"] == 0
        assert len(pids) == 2 and os.getpid() not in pids
        assert {m.info for m in batch.modify_metrics.values()} <= set(pids)
        assert batch.executor.pids() == pids  # type: ignore[attr-defined]


def test_every_request_is_in_flight_at_once_whatever_the_worker_count(
    store: SharedMemoryKVStore, start_method: str, tmp_path: Any
) -> None:
    """Six requests on two workers: each answers only once all six are in flight."""
    engine = FileBarrierEngine(store, str(tmp_path), parties=6)
    with lmc_batch.LMCacheBatchedStream(
        "process", mp_context=start_method, max_workers=2
    ) as batch:
        for i in range(6):
            batch.add(
                lmc_stream.create_request(store, engine, [i, i + 1, i + 2, i + 3])
            )
        batch.prefill({}, phase_timeout=60)
        assert all(s.decoded_tokens() == 1 for s in batch.streams.values())


def test_a_large_closure_crosses_once_per_phase_not_per_stream(
    store: SharedMemoryKVStore, start_method: str
) -> None:
    """A fn capturing 8 MB is pickled once for 8 streams; KV bytes never go through a pipe."""
    weights = np.ones(2 * 1024 * 1024, dtype=np.float32)  # 8 MiB

    def scale(kv: np.ndarray, tokens: list[int]) -> tuple[np.ndarray, list[int]]:
        return (kv * weights[0]).astype(kv.dtype), tokens

    with _batch(store, start_method, n=8) as batch:
        batch.prefill({})
        transport = batch.modify(scale).to_dict()["metrics"]["transport"]
    assert weights.nbytes < transport["pickled_bytes_sent"] < 1.5 * weights.nbytes
    assert transport["pickled_bytes_received"] < 64 * 1024


def test_kv_bytes_do_not_go_through_pipes(
    store: SharedMemoryKVStore, start_method: str
) -> None:
    """Modifying 4 MB of KV pickles a few KB: the workers read and write the store directly."""
    big = connect(chunk_size=256)
    try:
        engine = FakeEngine(big)
        with lmc_batch.LMCacheBatchedStream(
            "process", mp_context=start_method, max_workers=2
        ) as batch:
            for i in range(4):
                prompt = list(range(i, i + 1024))
                big.store(
                    np.random.default_rng(i).random((2, 8, 1024, 64), dtype=np.float32),
                    prompt,
                )
                batch.add(lmc_stream.create_request(big, engine, prompt))
            report = batch.modify(lambda kv, t: (kv[:, :, :512], t[:512])).to_dict()[
                "metrics"
            ]
        moved = (
            report["transport"]["pickled_bytes_sent"]
            + report["transport"]["pickled_bytes_received"]
        )
        assert report["results"]["kv_bytes_in"] == 4 * 2 * 8 * 1024 * 64 * 4
        assert moved < report["results"]["kv_bytes_in"] / 100
    finally:
        big.destroy()


def test_an_unpicklable_fn_fails_before_any_stream_is_touched(
    store: SharedMemoryKVStore, start_method: str
) -> None:
    """A fn closing over a lock cannot be pickled: the phase raises at once naming it."""
    lock = threading.Lock()

    def locked(kv: np.ndarray, tokens: list[int]) -> tuple[np.ndarray, list[int]]:
        with lock:
            return kv, tokens

    with _batch(store, start_method) as batch:
        batch.prefill({})
        before = {sid: s.state.copy() for sid, s in batch.streams.items()}
        with pytest.raises(LMCachePicklingError, match=r"modify fn .*locked.*lock"):
            batch.modify(locked)
        assert {sid: s.state for sid, s in batch.streams.items()} == before


def test_an_unpicklable_engine_fails_before_any_stream_is_touched(
    store: SharedMemoryKVStore, start_method: str
) -> None:
    """A post_completion that cannot be pickled is named in the error; no stream runs."""
    with _batch(store, start_method) as batch:
        next(iter(batch.streams.values())).post_completion = FakeEngine(
            threading.Lock()
        )
        with pytest.raises(LMCachePicklingError, match="post_completion"):
            batch.prefill({})
        assert all(s.decoded_tokens() == 0 for s in batch.streams.values())


def slow_for_stream_two(
    kv: np.ndarray, tokens: list[int]
) -> tuple[np.ndarray, list[int]]:
    """Takes a minute for the stream whose tokens start at 2."""
    if tokens[0] == 2:
        time.sleep(60)
    return kv[:, :, :4], tokens[:4]


def test_a_phase_timeout_fails_unfinished_streams_and_stops_their_workers(
    store: SharedMemoryKVStore, start_method: str
) -> None:
    """timeout= ends the phase: the slow stream fails with PhaseTimeoutError, others commit."""
    with _batch(store, start_method) as batch:
        batch.prefill({})
        pids = batch.executor.pids()  # type: ignore[attr-defined]
        slow = [sid for sid, s in batch.streams.items() if s.tokens[0] == 2]
        before = batch.streams[slow[0]].state.copy()
        start = time.monotonic()
        with pytest.raises(LMCacheBatchedStreamError) as info:
            batch.modify(slow_for_stream_two, phase_timeout=5)
        assert time.monotonic() - start < 30
        assert slow[0] in info.value.failures
        assert isinstance(info.value.failures[slow[0]], PhaseTimeoutError)
        assert batch.streams[slow[0]].state == before
        assert not any(
            psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"
            for p in pids
        )
        batch.decode({"max_tokens": 2})  # a fresh pool serves the next phase


def test_an_unclosed_batch_stops_its_workers_when_collected(
    store: SharedMemoryKVStore, start_method: str
) -> None:
    """Dropping the last reference to a batch shuts its pool down."""
    batch = _batch(store, start_method)
    batch.prefill({})
    pids = batch.executor.pids()  # type: ignore[attr-defined]
    del batch
    gc.collect()
    assert all_gone(pids, timeout=20)


def test_a_callers_executor_is_used_and_left_running(
    store: SharedMemoryKVStore, start_method: str
) -> None:
    """executor=ProcessPoolExecutor(...) runs the phases; close() does not shut it down."""
    import multiprocessing

    with ProcessPoolExecutor(
        2, mp_context=multiprocessing.get_context(start_method)
    ) as pool:
        batch = lmc_batch.LMCacheBatchedStream(pool)
        engine = FakeEngine(store)
        for i in range(3):
            batch.add(lmc_stream.create_request(store, engine, list(range(i, i + 9))))
        batch.prefill({})
        batch.modify(worker_pid)
        batch.close()
        assert {m.info for m in batch.modify_metrics.values()} - {os.getpid()}
        assert pool.submit(os.getpid).result(timeout=30) != os.getpid()


def blas_env(
    kv: np.ndarray, tokens: list[int]
) -> tuple[np.ndarray, list[int], tuple[str | None, bool]]:
    """Report the worker's BLAS thread cap and whether json was preloaded."""
    return kv, tokens, (os.environ.get("OMP_NUM_THREADS"), "json" in sys.modules)


def test_workers_cap_blas_threads_and_import_preloads(
    store: SharedMemoryKVStore, start_method: str
) -> None:
    """blas_threads caps OMP/BLAS threads in each worker; preload modules are imported."""
    with _batch(store, start_method, blas_threads=1, preload=["json"]) as batch:
        batch.prefill({})
        batch.modify(blas_env)
        assert {m.info for m in batch.modify_metrics.values()} == {("1", True)}


def test_a_slow_preload_is_waited_for(
    store: SharedMemoryKVStore, start_method: str
) -> None:
    """The pool waits for its workers' preloads however long they take (a
    model's weights on a busy machine): a preload sleeping seconds starts
    both workers, and the phase runs on them."""
    slow = functools.partial(time.sleep, 3.0)
    with _batch(store, start_method, preload=[slow]) as batch:
        batch.prefill({})
        batch.modify(worker_pid)
        assert len({m.info for m in batch.modify_metrics.values()}) == 2


def count_concurrent(kv: np.ndarray, tokens: list[int], directory: str = "") -> Any:
    """Records how many edits run at once, through marker files."""
    marker = os.path.join(directory, f"{os.getpid()}-{tokens[0]}")
    open(marker, "w").close()
    seen = len(os.listdir(directory))
    time.sleep(0.2)
    os.unlink(marker)
    return kv, tokens, seen


def test_max_in_flight_bounds_concurrent_edits(
    store: SharedMemoryKVStore, start_method: str, tmp_path: Any
) -> None:
    """max_in_flight=1 runs one edit at a time even with two workers."""
    import functools

    fn = functools.partial(count_concurrent, directory=str(tmp_path))
    with _batch(store, start_method, max_in_flight=1) as batch:
        batch.prefill({})
        batch.modify(fn)
        assert {m.info for m in batch.modify_metrics.values()} == {1}


def _run_held(
    store: SharedMemoryKVStore, start_method: str, verdict: bool, **opts: Any
) -> tuple[PhaseRun, list[str], list[int]]:
    """Run a modify of 4 streams on a started pool with a hold that answers
    ``verdict``; return the run, the job ids and the outcomes counted at
    each question."""
    with _batch(store, start_method) as batch:
        batch.prefill({})
        streams = list(batch.streams.values())
        spec, jobs = build_phase(streams, kind="modify", fn=worker_pid)
        executor = batch.executor
        assert isinstance(executor, ProcessExecutor)
        asked: list[int] = []

        def hold(run: PhaseRun) -> bool:
            asked.append(len(run.outcomes))
            return verdict

        run = executor.run(spec, jobs, timeout=60, hold=hold, **opts)
    return run, [job.stream_id for job in jobs], asked


def test_a_hold_leaves_the_jobs_not_sent_yet_unrun(
    store: SharedMemoryKVStore, start_method: str
) -> None:
    """A hold that says stop once the first outcome is back: with one job in
    flight, the other three are never sent; they are named unrun, and have
    no outcome (what auto uses to move them to threads)."""
    run, ids, asked = _run_held(store, start_method, True, max_in_flight=1)
    assert asked == [1]
    assert list(run.outcomes) == ids[:1]
    assert run.unrun == ids[1:]


def test_a_hold_that_says_go_on_is_not_asked_again(
    store: SharedMemoryKVStore, start_method: str
) -> None:
    """A hold that decides to carry on at its first question: every job
    runs, none is unrun, and it is asked once."""
    run, ids, asked = _run_held(store, start_method, False)
    assert len(asked) == 1
    assert set(run.outcomes) == set(ids)
    assert run.unrun == []


#: Source that, once a line arrives on stdin, sends SIGINT to the thread
#: reading it rather than to the main thread, as the kernel may do with a
#: process-directed signal.
_SIGINT_ON_A_LINE = """
import faulthandler, signal, threading
# Python keeps SIGINT ignored when it starts so, as a pytest run from a
# shell's background job (`cmd &`) passes it on: the child then never saw
# the signal and both variants hung. Ctrl-C at a terminal has the default.
signal.signal(signal.SIGINT, signal.default_int_handler)
# Still running 10 s on (9 s after the SIGINT): every thread's stack goes to
# stderr, which the test's report shows.
faulthandler.dump_traceback_later(10)
def _interrupt():
    sys.stdin.readline()
    signal.pthread_kill(threading.get_ident(), signal.SIGINT)
threading.Thread(target=_interrupt, daemon=True).start()
"""


@pytest.mark.parametrize("taken_by", ["main thread", "another thread"])
def test_ctrl_c_stops_the_parent_and_every_worker(tmp_path: Any, taken_by: str) -> None:
    """SIGINT to the parent during a phase: it exits within seconds and no
    worker survives, whichever of its threads the signal is delivered to."""
    pidfile = tmp_path / "pids"
    script = prefilled_batch_script(
        pidfile,
        _SIGINT_ON_A_LINE
        + "batch.modify(lambda kv, t: (time.sleep(60), (kv, t))[1])\n",
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        time.sleep(1.0)
        if taken_by == "main thread":
            proc.send_signal(signal.SIGINT)
        else:
            assert proc.stdin is not None
            proc.stdin.write("\n")
            proc.stdin.flush()
        proc.wait(timeout=15)
    finally:
        proc.kill()
        proc.communicate(timeout=15)
    pids = [int(p) for p in pidfile.read_text().split()]
    assert len(pids) == 2 and all_gone(pids)


def test_phase_outcomes_pickle_without_kv(store: SharedMemoryKVStore) -> None:
    """The store context pickles by location only: a few hundred bytes, whatever it holds."""
    store.store(np.zeros((2, 2, 64, 4), np.float32), list(range(64)))
    assert len(pickle.dumps(store)) < 1024


def test_a_fn_from_a_module_workers_cannot_import_is_sent_by_value(
    store: SharedMemoryKVStore,
    start_method: str,
    tmp_path: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A fn defined in a file loaded by path (not on sys.path) still runs in the workers."""
    path = tmp_path / "my_local_edits.py"
    path.write_text(
        "def keep4(kv, tokens):\n    return kv[:, :, :4], tokens[:4], 'local'\n"
    )
    spec = importlib.util.spec_from_file_location("my_local_edits", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "my_local_edits", module)
    spec.loader.exec_module(module)
    with _batch(store, start_method) as batch:
        batch.prefill({})
        batch.modify(module.keep4)
        assert {m.info for m in batch.modify_metrics.values()} == {"local"}
