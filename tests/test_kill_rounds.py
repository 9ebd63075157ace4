"""Workers SIGKILLed at random moments: no stream is ever half modified.

Each round runs a modify over 8 streams on a spawn pool of 2 workers while a
background thread SIGKILLs one worker, picked at random, after a random
delay. Whatever the moment, every stream ends the round either fully
modified or fully unmodified, in its state and in the store; the batch error
names exactly the streams that did not commit; no stored chunk fails its
checksum; and the next round runs on the rebuilt pool.

The edit doubles the KV and shifts every token id by one, so that each
committed edit lands under new chunk keys and the chunks of the previous
state stay as they were. An edit that keeps a prefix of its tokens (e.g.
"keep the first 4 tokens") rewrites the previous state's chunks in place;
a kill between that write and the commit is pinned down on its own by
test_a_worker_killed_after_an_in_place_edit_landed_keeps_the_old_kv.

The other tests pin down single kills the rounds can only hit by chance: an
idle worker, a worker killed while the pool starts, and the parent itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from collections.abc import Sequence
from concurrent.futures.process import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import psutil
import pytest

import lmcache_mp.batch as lmc_batch
import lmcache_mp.stream as lmc_stream
from lmcache_mp.errors import (
    CorruptChunkWarning,
    LMCacheBatchedStreamError,
    TerminatedWorkerError,
)
from lmcache_mp.executors._process import ProcessExecutor
from lmcache_mp.kv import SharedMemoryKVStore
from lmcache_mp.stream import StreamState
from tests._fakes import FakeEngine, kv_for

STREAMS = 8
PROMPT_LEN = 16
CHUNK = 4
#: The killer waits up to this long into the phase; the phase itself takes
#: about 8 streams x 100 ms / 2 workers plus dispatch.
MAX_KILL_DELAY_S = 0.4
#: Every blocking wait in this file gives up after this long.
WAIT_S = 60.0


def double_and_shift(kv: np.ndarray, tokens: list[int]) -> tuple[np.ndarray, list[int]]:
    """Doubles the KV and shifts every token id by one, taking 50-150 ms."""
    time.sleep(random.uniform(0.05, 0.15))
    return kv * 2, [t + 1 for t in tokens]


def expected_state(prefilled: StreamState, edits: int) -> StreamState:
    """A stream's state after ``edits`` committed edits of its prefilled state.

    The first edit sees the cached prompt; the generated token, not cached
    (it fills no chunk), moves to the suffix and stays there; the state
    notes the tokens the last edit left.
    """
    if edits == 0:
        return prefilled.copy()
    prompt = prefilled.tokens[:PROMPT_LEN]
    return dataclasses.replace(
        prefilled.copy(),
        tokens=[t + edits for t in prompt],
        suffix=prefilled.tokens[PROMPT_LEN:],
        edited=PROMPT_LEN,
    )


def expected_kv(prefilled: StreamState, edits: int) -> np.ndarray:
    """The KV the store must return for that state: the engine's, doubled per edit."""
    kv: np.ndarray = kv_for(prefilled.tokens[:PROMPT_LEN]) * np.float32(2.0**edits)
    return kv


class Killer(threading.Thread):
    """SIGKILLs one random worker of ``executor`` after ``delay`` seconds.

    The kill is only sent while the phase is running: :meth:`finish`, called
    as soon as the phase returns, takes the same lock, so a late killer
    sends nothing.
    """

    def __init__(self, executor: ProcessExecutor, delay: float, seed: int) -> None:
        super().__init__(daemon=True)
        self.executor = executor
        self.delay = delay
        self.rng = random.Random(seed)
        self.killed: int | None = None
        self._over = threading.Event()
        self._lock = threading.Lock()

    def _pids(self) -> list[int]:
        # The phase thread may be swapping in a rebuilt pool's workers.
        for _ in range(10):
            try:
                return self.executor.pids()
            except RuntimeError:
                time.sleep(0.001)
        return []

    def run(self) -> None:
        """Wait, then kill one worker unless the phase is over."""
        if self._over.wait(self.delay):
            return
        while True:
            with self._lock:
                if self._over.is_set():
                    return
                pids = self._pids()
                if pids:
                    pid = self.rng.choice(pids)
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        return
                    self.killed = pid
                    return
            time.sleep(0.005)

    def finish(self) -> None:
        """Mark the phase over and wait for the thread."""
        with self._lock:
            self._over.set()
        self.join(timeout=WAIT_S)
        assert not self.is_alive(), "the killer thread did not stop"


@dataclass
class Tally:
    """What the kill rounds did (the figures the README quotes)."""

    rounds: int = 0
    kills_mid_phase: int = 0
    rounds_with_failures: int = 0
    streams_failed: int = 0
    #: Failures blamed on a worker the pool itself SIGTERMed, not the one
    #: killed (see test_killing_an_idle_worker_fails_no_stream).
    blamed_on_sigterm: int = 0

    def line(self) -> str:
        """One line for ``pytest -s`` output."""
        return (
            f"RELIABILITY: kill rounds={self.rounds} "
            f"kills landing mid-phase={self.kills_mid_phase} "
            f"rounds with failed streams={self.rounds_with_failures} "
            f"streams failed={self.streams_failed} "
            f"failures blamed on a SIGTERMed bystander={self.blamed_on_sigterm}"
        )


def _spawn_batch() -> lmc_batch.LMCacheBatchedStream:
    """A process batch on a spawn pool of 2 workers."""
    return lmc_batch.LMCacheBatchedStream("process", mp_context="spawn", max_workers=2)


def _two_prefilled_streams(batch: lmc_batch.LMCacheBatchedStream, ctx: Any) -> str:
    """Add and prefill streams with prompts 0..7 and 100..107; return the first's id."""
    engine = FakeEngine(ctx)
    for start in (0, 100):
        batch.add(lmc_stream.create_request(ctx, engine, list(range(start, start + 8))))
    batch.prefill({}, phase_timeout=WAIT_S)
    return next(sid for sid, s in batch.streams.items() if s.tokens[0] == 0)


def _check_round(
    batch: lmc_batch.LMCacheBatchedStream,
    store: SharedMemoryKVStore,
    prefilled: dict[str, StreamState],
    edits: dict[str, int],
    error: LMCacheBatchedStreamError | None,
    killed: int | None,
) -> set[str]:
    """Check one round's outcome, advance ``edits``; return the unmodified ids."""
    unmodified = set()
    for sid, stream in batch.streams.items():
        if stream.state == expected_state(prefilled[sid], edits[sid] + 1):
            edits[sid] += 1
            continue
        assert stream.state == expected_state(prefilled[sid], edits[sid]), (
            f"stream {sid} is neither modified nor unmodified: {stream.state}"
        )
        unmodified.add(sid)
    failures = {} if error is None else error.failures
    assert set(failures) == unmodified
    if killed is None:
        assert not failures, f"no worker was killed, yet {failures} failed"
    for sid, exc in failures.items():
        assert isinstance(exc, TerminatedWorkerError), repr(exc)
        assert sid in str(exc) and error is not None and sid in str(error)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CorruptChunkWarning)
        for sid, stream in batch.streams.items():
            np.testing.assert_array_equal(
                store.retrieve(stream.tokens),
                expected_kv(prefilled[sid], edits[sid]),
                err_msg=f"stream {sid} after {edits[sid]} edits",
            )
    return unmodified


def _kill_rounds(store: SharedMemoryKVStore, rounds: int, seed: int) -> Tally:
    """Run ``rounds`` modify phases, each with one random kill; check each."""
    rng = random.Random(seed)
    tally = Tally()
    with _spawn_batch() as batch:
        engine = FakeEngine(store)
        for i in range(STREAMS):
            prompt = [1000 * i + j for j in range(PROMPT_LEN)]
            batch.add(lmc_stream.create_request(store, engine, prompt))
        batch.prefill({})
        prefilled = {sid: s.state.copy() for sid, s in batch.streams.items()}
        edits = dict.fromkeys(batch.streams, 0)
        executor = batch.executor
        assert isinstance(executor, ProcessExecutor)
        for _ in range(rounds):
            killer = Killer(
                executor, rng.uniform(0.0, MAX_KILL_DELAY_S), rng.randrange(2**32)
            )
            killer.start()
            error = None
            try:
                batch.modify(double_and_shift, phase_timeout=WAIT_S)
            except LMCacheBatchedStreamError as exc:
                error = exc
            finally:
                killer.finish()
            failed = _check_round(batch, store, prefilled, edits, error, killer.killed)
            tally.rounds += 1
            tally.kills_mid_phase += killer.killed is not None
            tally.rounds_with_failures += bool(failed)
            tally.streams_failed += len(failed)
            if error is not None:
                tally.blamed_on_sigterm += sum(
                    getattr(exc, "exitcode", None) == -signal.SIGTERM
                    for exc in error.failures.values()
                )
        # After the last kill, a quiet round commits every stream and the
        # pool decodes.
        batch.modify(double_and_shift, phase_timeout=WAIT_S)
        assert not _check_round(batch, store, prefilled, edits, None, None)
        batch.decode({"max_tokens": 2}, phase_timeout=WAIT_S)
        assert all(s.decoded_tokens() == 3 for s in batch.streams.values())
    print(tally.line())
    return tally


@pytest.mark.slow
def test_twenty_kill_rounds_leave_every_stream_whole(
    store: SharedMemoryKVStore,
) -> None:
    """20 rounds, a random worker SIGKILLed in each: no stream is ever half modified."""
    tally = _kill_rounds(store, rounds=20, seed=20)
    assert tally.rounds == 20


def test_three_kill_rounds_leave_every_stream_whole(
    store: SharedMemoryKVStore,
) -> None:
    """The kill rounds in short, for the default suite: 3 rounds."""
    tally = _kill_rounds(store, rounds=3, seed=3)
    assert tally.rounds == 3


def slow_first_stream(
    kv: np.ndarray, tokens: list[int], marks: str = ""
) -> tuple[np.ndarray, list[int]]:
    """Drops a file naming the worker and its role; the stream at 0 takes 2 s."""
    role = "slow" if tokens[0] == 0 else "fast"
    open(os.path.join(marks, f"{role}-{os.getpid()}"), "w").close()
    if role == "slow":
        time.sleep(2.0)
    return kv * 2, [t + 1 for t in tokens]


def _wait_for_marks(marks: str, roles: set[str]) -> dict[str, int]:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        found = {
            name.split("-")[0]: int(name.split("-")[1]) for name in os.listdir(marks)
        }
        if roles <= set(found):
            return found
        time.sleep(0.01)
    raise AssertionError(f"no edit reported {roles} in {WAIT_S}s")


def test_killing_an_idle_worker_fails_no_stream(
    store: SharedMemoryKVStore, tmp_path: Any
) -> None:
    """A worker killed between tasks ran no stream: every stream still commits.

    The pool SIGTERMs the busy worker when the idle one dies; that stream
    is a bystander and must be run again on the rebuilt pool, not failed.
    """
    fn = functools.partial(slow_first_stream, marks=str(tmp_path))
    with _spawn_batch() as batch:
        _two_prefilled_streams(batch, store)
        executor = batch.executor
        assert isinstance(executor, ProcessExecutor)
        killed: list[int] = []

        def kill_the_idle_worker() -> None:
            slow = _wait_for_marks(str(tmp_path), {"slow", "fast"})["slow"]
            time.sleep(0.3)  # the fast edit has returned; its worker idles
            idle = [pid for pid in executor.pids() if pid != slow]
            os.kill(idle[0], signal.SIGKILL)
            killed.append(idle[0])

        killer = threading.Thread(target=kill_the_idle_worker, daemon=True)
        killer.start()
        batch.modify(fn, phase_timeout=WAIT_S)
        killer.join(timeout=WAIT_S)
        assert killed, "the idle worker was not killed"
        assert all(s.tokens[0] in (1, 101) for s in batch.streams.values())


def die_on_stream_zero(
    kv: np.ndarray, tokens: list[int]
) -> tuple[np.ndarray, list[int]]:
    """SIGKILLs its worker for the stream whose tokens start at 0."""
    if tokens[0] == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    return kv * 2, [t + 1 for t in tokens]


def _pools() -> set[int]:
    return {id(o) for o in gc.get_objects() if isinstance(o, ProcessPoolExecutor)}


def test_a_broken_pool_is_freed_without_waiting_for_the_garbage_collector(
    store: SharedMemoryKVStore,
) -> None:
    """Once a batch whose worker died is closed, nothing holds its dead pool (its
    pipes, its named semaphores in /dev/shm): it is freed at once, not whenever
    the cyclic garbage collector next runs."""
    gc.collect()
    before = _pools()
    gc.disable()
    try:
        with _spawn_batch() as batch:
            _two_prefilled_streams(batch, store)
            with pytest.raises(LMCacheBatchedStreamError):
                batch.modify(die_on_stream_zero, phase_timeout=WAIT_S)
        left = _pools() - before
    finally:
        gc.enable()
        gc.collect()
    assert not left, f"{len(left)} closed pools are only reachable through cycles"


def keep_first_chunk_doubled(
    kv: np.ndarray, tokens: list[int]
) -> tuple[np.ndarray, list[int]]:
    """Keeps the first 4 tokens (their chunk key is unchanged) and doubles their KV."""
    return kv[:, :, :CHUNK] * 2, tokens[:CHUNK]


class KillAfterEdit:
    """A KV context that SIGKILLs the worker as soon as an edit of the stream
    whose tokens start at 0 has reached the store: the kill lands after the
    write and before the parent can commit."""

    def __init__(self, inner: SharedMemoryKVStore) -> None:
        self.inner = inner
        self.parent = os.getpid()
        self.armed = False  # set after the prefill: shipped with the modify

    @property
    def chunk_size(self) -> int:
        """The wrapped store's."""
        return self.inner.chunk_size

    def retrieve(self, tokens: Sequence[int], cache_salt: str = "") -> Any:
        """The wrapped store's."""
        return self.inner.retrieve(tokens, cache_salt)

    def store(
        self,
        kv: Any,
        tokens: Sequence[int],
        cache_salt: str = "",
        *,
        overwrite: bool = False,
    ) -> bool:
        """Store, then die if this is the target's edit in a worker."""
        wrote = self.inner.store(kv, tokens, cache_salt, overwrite=overwrite)
        self._maybe_die(tokens)
        return wrote

    def stage(self, kv: Any, tokens: Sequence[int], cache_salt: str = "") -> Any:
        """Stage (a same-token edit), then die if this is the target's edit."""
        staged = self.inner.stage(kv, tokens, cache_salt)
        self._maybe_die(tokens)
        return staged

    def sweep(self, owner: Any = None) -> int:
        """The wrapped store's."""
        return int(self.inner.sweep(owner))

    def _maybe_die(self, tokens: Sequence[int]) -> None:
        if self.armed and tokens[0] == 0 and os.getpid() != self.parent:
            os.kill(os.getpid(), signal.SIGKILL)


def doubled_in_place(kv: np.ndarray, tokens: list[int]) -> tuple[np.ndarray, list[int]]:
    """Keeps every token and doubles the KV: a same-token edit, which overwrites."""
    return kv * 2, tokens


@pytest.mark.parametrize(
    "edit", [keep_first_chunk_doubled, doubled_in_place], ids=["prefix", "same-tokens"]
)
def test_a_worker_killed_after_an_in_place_edit_landed_keeps_the_old_kv(
    store: SharedMemoryKVStore, edit: Any
) -> None:
    """A stream whose worker dies after its edit reached the store, before the
    commit, keeps its previous state and the KV of that state, even when the
    edit kept a token prefix (same chunk key) and changed its values."""
    ctx = KillAfterEdit(store)
    with _spawn_batch() as batch:
        target = _two_prefilled_streams(batch, ctx)
        before = batch.streams[target].state.copy()
        kv_before = store.retrieve(before.tokens)
        ctx.armed = True
        with pytest.raises(LMCacheBatchedStreamError) as info:
            batch.modify(edit, stream_ids=[target], phase_timeout=WAIT_S)
        assert list(info.value.failures) == [target]
        assert isinstance(info.value.failures[target], TerminatedWorkerError)
        assert batch.streams[target].state == before
        np.testing.assert_array_equal(store.retrieve(before.tokens), kv_before)
        # What the dead worker staged or half-wrote was swept away.
        assert not [n for n in os.listdir(store.path) if n.startswith(".tmp-")]


#: Runs in a child interpreter, so that a hang in the library cannot hang the
#: suite. The pool's and the store's files go to the test's tmp_path: a run
#: killed on timeout leaves nothing in /dev/shm.
_PRELUDE = """
import os, signal, sys, threading, time
sys.path.insert(0, {root!r})
import lmcache_mp._util.paths
lmcache_mp._util.paths.shm_root = lambda: {scratch!r}
import psutil
from lmcache_mp.kv import connect
from tests.test_kill_rounds import _spawn_batch, _two_prefilled_streams
ctx = connect("file://" + os.path.join({scratch!r}, "store"), chunk_size=4)
"""

_KILL_WHILE_STARTING = """
def kill_the_first_worker():
    me = psutil.Process()
    while True:
        for child in me.children():
            try:
                cmdline = " ".join(child.cmdline())
            except psutil.Error:
                continue
            if "spawn_main" in cmdline and "resource_tracker" not in cmdline:
                os.kill(child.pid, signal.SIGKILL)
                return
        time.sleep(0.002)

if __name__ == "__main__":
    threading.Thread(target=kill_the_first_worker, daemon=True).start()
    with _spawn_batch() as batch:
        try:
            _two_prefilled_streams(batch, ctx)
            print("decoded", sum(s.decoded_tokens() for s in batch.streams.values()))
        except Exception as exc:
            print("raised", type(exc).__name__, exc)
    ctx.destroy()
"""

_WAIT_AFTER_PREFILL = """
if __name__ == "__main__":
    batch = _spawn_batch()
    _two_prefilled_streams(batch, ctx)
    print(" ".join(map(str, batch.executor.pids())), flush=True)
    time.sleep(120)
"""


def _child(body: str, scratch: Any) -> subprocess.Popen[str]:
    script = textwrap.dedent(_PRELUDE + body).format(
        root=os.getcwd(), scratch=str(scratch)
    )
    return subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True
    )


def _family(proc: subprocess.Popen[str]) -> list[psutil.Process]:
    """The child's descendants: its workers and its resource tracker."""
    with contextlib.suppress(psutil.NoSuchProcess):
        return psutil.Process(proc.pid).children(recursive=True)
    return []


def _stop(proc: subprocess.Popen[str], family: list[psutil.Process]) -> None:
    """Kill the child and its workers; let the resource tracker exit by itself
    (it unlinks the pool's semaphores once every holder of its pipe is gone)."""
    trackers = []
    for member in family:
        with contextlib.suppress(psutil.Error):
            if "resource_tracker" in " ".join(member.cmdline()):
                trackers.append(member)
                continue
            member.kill()
    proc.kill()
    proc.wait(timeout=WAIT_S)
    _, stuck = psutil.wait_procs(trackers, timeout=WAIT_S)
    for member in stuck:
        member.kill()


def test_a_worker_killed_while_the_pool_starts_fails_no_stream(tmp_path: Any) -> None:
    """A worker SIGKILLed before it ran anything: the phase runs on a rebuilt pool.

    Run in a child interpreter: today the phase either raises a bare
    BrokenProcessPool or (about one run in fifteen here) never returns.
    """
    proc = _child(_KILL_WHILE_STARTING, tmp_path)
    try:
        out, _ = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        out = "hung: the phase had not returned after 30s"
    finally:
        _stop(proc, _family(proc))
    assert out.strip() == "decoded 2"


def _alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
    return alive


def test_workers_exit_when_the_parent_is_killed(tmp_path: Any) -> None:
    """SIGKILL of the parent (the OOM killer's way): its idle workers exit too,
    rather than wait forever on the call queue as orphans."""
    proc = _child(_WAIT_AFTER_PREFILL, tmp_path)
    family: list[psutil.Process] = []
    try:
        assert proc.stdout is not None
        pids = [int(pid) for pid in proc.stdout.readline().split()]
        assert len(pids) == 2
        family = _family(proc)
        proc.kill()
        proc.wait(timeout=WAIT_S)
        deadline = time.monotonic() + 10
        while _alive(pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        survivors = _alive(pids)
    finally:
        _stop(proc, family)
    assert not survivors, f"workers {survivors} outlived their killed parent"
