"""Specification of the in-process executors and of the batch's memory bound."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from threadpoolctl import threadpool_info

import lmcache_mp.batch as lmc_batch
import lmcache_mp.batch._memory
import lmcache_mp.stream as lmc_stream
from lmcache_mp.errors import (
    LMCacheBatchedStreamError,
    LMCacheStreamError,
    PhaseTimeoutError,
)
from lmcache_mp.executors import physical_cores
from lmcache_mp.kv import SharedMemoryKVStore, connect
from tests._fakes import FakeEngine, InMemoryKV
from tests._scripts import all_gone, prefilled_batch_script


def _filled(
    executor: str, ctx: Any, n: int = 3, **opts: Any
) -> lmc_batch.LMCacheBatchedStream:
    batch = lmc_batch.LMCacheBatchedStream(executor, **opts)
    for i in range(n):
        batch.add(
            lmc_stream.create_request(ctx, FakeEngine(ctx), list(range(i, i + 8)))
        )
    batch.prefill({})
    return batch


def blas_threads(
    kv: np.ndarray, tokens: list[int]
) -> tuple[np.ndarray, list[int], int]:
    """Report the BLAS thread limit in force while the edit runs."""
    return kv, tokens, min(info["num_threads"] for info in threadpool_info())


def test_thread_executor_caps_blas_threads_while_a_phase_runs() -> None:
    """One thread per stream with BLAS capped at cores // streams (never below 1)."""
    batch = _filled("thread", InMemoryKV(4), n=3)
    batch.modify(blas_threads)
    expected = max(1, physical_cores() // 3)
    assert {m.info for m in batch.modify_metrics.values()} == {expected}


def slow_first(kv: np.ndarray, tokens: list[int]) -> tuple[np.ndarray, list[int]]:
    """Takes 1.5 s for the stream whose tokens start at 0."""
    if tokens[0] == 0:
        time.sleep(1.5)
    return kv[:, :, :4], tokens[:4]


def test_thread_timeout_fails_the_slow_stream_and_discards_its_late_result() -> None:
    """A thread cannot be killed: its stream fails at the timeout and its late result is never committed."""
    batch = _filled("thread", InMemoryKV(4))
    slow = next(sid for sid, s in batch.streams.items() if s.tokens[0] == 0)
    before = batch.streams[slow].state.copy()
    with pytest.raises(LMCacheBatchedStreamError) as info:
        batch.modify(slow_first, phase_timeout=0.3)
    assert list(info.value.failures) == [slow]
    assert isinstance(info.value.failures[slow], PhaseTimeoutError)
    time.sleep(1.5)
    assert batch.streams[slow].state == before


def exits_on_first(kv: np.ndarray, tokens: list[int]) -> tuple[np.ndarray, list[int]]:
    """sys.exit(3) for the stream whose tokens start at 0, KeyboardInterrupt
    for the one at 1; keeps the first chunk of every other stream."""
    if tokens[0] == 0:
        sys.exit(3)
    if tokens[0] == 1:
        raise KeyboardInterrupt
    return kv[:, :, :4], tokens[:4]


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_sys_exit_or_keyboardinterrupt_in_a_fn_fails_only_its_stream(
    executor: str,
) -> None:
    """A fn's own SystemExit or KeyboardInterrupt fails its stream with an
    LMCacheStreamError caused by it; the phase goes on and the other stream
    commits its edit, on threads as in a worker process."""
    ctx = connect(chunk_size=4)
    try:
        with _filled(executor, ctx) as batch:
            by_first = {s.tokens[0]: sid for sid, s in batch.streams.items()}
            with pytest.raises(LMCacheBatchedStreamError) as info:
                batch.modify(exits_on_first)
            failures = info.value.failures
            assert sorted(failures) == sorted([by_first[0], by_first[1]])
            for first, cause in ((0, "SystemExit"), (1, "KeyboardInterrupt")):
                error = failures[by_first[first]]
                assert isinstance(error, LMCacheStreamError)
                assert cause in str(error) and by_first[first] in str(error)
            assert batch.streams[by_first[2]].tokens == [2, 3, 4, 5]
    finally:
        ctx.destroy()


def test_serial_timeout_fails_the_streams_not_started() -> None:
    """The serial executor checks the timeout between streams."""
    batch = _filled("serial", InMemoryKV(4))
    with pytest.raises(LMCacheBatchedStreamError) as info:
        batch.modify(slow_first, phase_timeout=0.3)
    assert len(info.value.failures) == 2
    assert all(isinstance(e, PhaseTimeoutError) for e in info.value.failures.values())


def test_modify_concurrency_follows_available_memory(
    store: SharedMemoryKVStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without max_in_flight, only as many streams as fit in half the free memory hold KV at once."""
    batch = _filled("thread", store, n=4)
    per_stream = 3 * 2 * 2 * 4 * 4 * len(next(iter(batch.streams.values())).tokens)
    monkeypatch.setattr(
        lmcache_mp.batch._memory.psutil,
        "virtual_memory",
        lambda: SimpleNamespace(available=2 * per_stream * 2),
    )
    assert batch._modify_bound(list(batch.streams)) == 2
    monkeypatch.setattr(
        lmcache_mp.batch._memory.psutil,
        "virtual_memory",
        lambda: SimpleNamespace(available=1),
    )
    assert batch._modify_bound(list(batch.streams)) == 1


def test_an_unclosed_batch_leaves_no_worker_at_interpreter_exit(tmp_path: Any) -> None:
    """A script that never closes its batch still ends every worker when it exits."""
    pidfile = tmp_path / "pids"
    script = prefilled_batch_script(pidfile)
    subprocess.run(
        [sys.executable, "-c", script],
        check=True,
        timeout=120,
        stdout=subprocess.DEVNULL,
    )
    pids = [int(p) for p in pidfile.read_text().split()]
    assert len(pids) == 2 and all_gone(pids)


def test_a_script_without_a_main_guard_gets_a_clear_error(tmp_path: Any) -> None:
    """Workers that die at start (unguarded script under spawn) raise TerminatedWorkerError naming the fix."""
    script = tmp_path / "unguarded.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import sys
            sys.path.insert(0, {os.getcwd()!r})
            import lmcache_mp.batch as lmc_batch, lmcache_mp.stream as lmc_stream
            from tests._fakes import FakeEngine, InMemoryKV
            from lmcache_mp.errors import TerminatedWorkerError
            ctx = InMemoryKV(4)
            batch = lmc_batch.LMCacheBatchedStream("process", max_workers=1)
            batch.add(lmc_stream.create_request(ctx, FakeEngine(ctx), [1, 2, 3, 4]))
            try:
                batch.prefill({{}})
            except TerminatedWorkerError as exc:
                print("ERROR:", exc)
            """
        )
    )
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120
    )
    assert "ERROR:" in out.stdout and "__name__ == '__main__'" in out.stdout


def test_without_threadpoolctl_the_thread_executor_warns_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No threadpoolctl: threads cannot cap BLAS; a RuntimeWarning names the extra, once."""
    import lmcache_mp._util.blas as executors

    monkeypatch.setitem(sys.modules, "threadpoolctl", None)
    monkeypatch.setattr(executors, "_warned_uncapped", False)
    with pytest.warns(RuntimeWarning, match=r"lmcache-mp\[blas\]") as record:
        batch = _filled("thread", InMemoryKV(4), n=3)
        batch.modify(lambda kv, t: (kv, t))
        batch.modify(lambda kv, t: (kv, t))
    assert sum("threadpoolctl" in str(w.message) for w in record) == 1
