"""The crash table: every way one stream can fail in a worker, once per start method.

For each case: the failed stream's error has the expected type and names the
stream and the cause; the other streams commit; the failed stream keeps its
state and its stored KV; and the next phase succeeds on a (rebuilt) pool.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

import lmcache_mp.batch as lmc_batch
import lmcache_mp.stream as lmc_stream
from lmcache_mp.errors import (
    LMCacheBatchedStreamError,
    LMCachePicklingError,
    LMCacheStreamError,
    PhaseTimeoutError,
    RemoteTraceback,
    StreamInputError,
    TerminatedWorkerError,
)
from lmcache_mp.kv import SharedMemoryKVStore
from tests._fakes import BadEventEngine, FakeEngine, FlakyEngine
from tests._store_util import staged_names

TARGET = 2  # the stream whose prompt starts at token 2 fails


def _edit(
    kv: np.ndarray, tokens: list[int], broken: Callable[[np.ndarray, list[int]], Any]
) -> Any:
    return broken(kv, tokens) if tokens[0] == TARGET else (kv[:, :, :4], tokens[:4])


def fn_raises(kv: np.ndarray, tokens: list[int]) -> Any:
    """Raises inside the fn."""
    return _edit(kv, tokens, lambda k, t: {}["missing layer"])


def wrong_shape(kv: np.ndarray, tokens: list[int]) -> Any:
    """Returns a 3-D KV."""
    return _edit(kv, tokens, lambda k, t: (k[0], t))


def wrong_token_count(kv: np.ndarray, tokens: list[int]) -> Any:
    """Returns 4 KV rows for 3 tokens."""
    return _edit(kv, tokens, lambda k, t: (k[:, :, :4], t[:3]))


def not_an_array(kv: np.ndarray, tokens: list[int]) -> Any:
    """Returns a string as the KV."""
    return _edit(kv, tokens, lambda k, t: ("kv", t))


def returns_none(kv: np.ndarray, tokens: list[int]) -> Any:
    """Returns None instead of a tuple."""
    return _edit(kv, tokens, lambda k, t: None)


def wrong_dtype(kv: np.ndarray, tokens: list[int]) -> Any:
    """Returns an int64 KV (finite, right shape, wrong dtype)."""
    return _edit(kv, tokens, lambda k, t: (k[:, :, :4].astype(np.int64), t[:4]))


def unpicklable_info(kv: np.ndarray, tokens: list[int]) -> Any:
    """Returns a lock as info, which cannot be sent back."""
    return _edit(kv, tokens, lambda k, t: (k[:, :, :4], t[:4], threading.Lock()))


def exits(kv: np.ndarray, tokens: list[int]) -> Any:
    """Calls os._exit(3) in the worker."""
    return _edit(kv, tokens, lambda k, t: os._exit(3))


def sigkill(kv: np.ndarray, tokens: list[int]) -> Any:
    """The worker receives SIGKILL."""
    return _edit(kv, tokens, lambda k, t: os.kill(os.getpid(), signal.SIGKILL))


def segfault(kv: np.ndarray, tokens: list[int]) -> Any:
    """The worker segfaults in native code."""
    return _edit(kv, tokens, lambda k, t: ctypes.string_at(0))


@dataclass(frozen=True)
class Case:
    """One way to fail: the phase it happens in and what the error must say."""

    fn: Callable[..., Any] | None
    engine: type[FakeEngine] | None
    error: type[BaseException]
    says: str
    remote: bool = True


CASES = {
    "fn-raises": Case(fn_raises, None, LMCacheStreamError, "KeyError"),
    "wrong-shape": Case(wrong_shape, None, StreamInputError, "expected 4-D"),
    "wrong-token-count": Case(
        wrong_token_count, None, StreamInputError, "4 tokens on axis 2 but 3"
    ),
    "not-an-array": Case(
        not_an_array, None, StreamInputError, "expected a numeric array"
    ),
    "none": Case(returns_none, None, StreamInputError, "expected a tuple"),
    "wrong-dtype": Case(wrong_dtype, None, StreamInputError, "int64"),
    "unpicklable-result": Case(
        unpicklable_info, None, LMCachePicklingError, "could not be pickled"
    ),
    "os-exit": Case(
        exits, None, TerminatedWorkerError, "exited with code 3", remote=False
    ),
    "sigkill": Case(sigkill, None, TerminatedWorkerError, "SIGKILL", remote=False),
    "segfault": Case(segfault, None, TerminatedWorkerError, "SIGSEGV", remote=False),
    "engine-raises": Case(
        None, FlakyEngine, LMCacheStreamError, "connection reset mid-stream"
    ),
    "engine-bad-event": Case(
        None, BadEventEngine, LMCacheStreamError, "expected a TokenEvent"
    ),
}


@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
@pytest.mark.parametrize("name", list(CASES))
def test_crash_case(name: str, start_method: str, store: SharedMemoryKVStore) -> None:
    """One stream fails as the case says; nothing else is lost; the next phase works."""
    case = CASES[name]
    with lmc_batch.LMCacheBatchedStream(
        "process", mp_context=start_method, max_workers=2
    ) as batch:
        engine = FakeEngine(store)
        for i in range(5):
            batch.add(lmc_stream.create_request(store, engine, list(range(i, i + 10))))
        batch.prefill({})
        target = next(sid for sid, s in batch.streams.items() if s.tokens[0] == TARGET)
        others = [sid for sid in batch.streams if sid != target]
        before = {sid: s.state.copy() for sid, s in batch.streams.items()}
        kv_before = store.retrieve(before[target].tokens)
        if case.engine is not None:
            batch.streams[target].post_completion = case.engine(store)

        with pytest.raises(LMCacheBatchedStreamError) as info:
            if case.fn is not None:
                batch.modify(case.fn)
            else:
                batch.decode({"max_tokens": 3})

        error = info.value.failures[target]
        assert list(info.value.failures) == [target]
        assert isinstance(error, case.error)
        assert target in str(error) and target in str(info.value)
        remote = error.__cause__
        if case.remote:
            assert isinstance(remote, RemoteTraceback)
            assert case.says in str(error) + remote.tb
        else:
            assert case.says in str(error)
        assert batch.streams[target].state == before[target]
        np.testing.assert_array_equal(store.retrieve(before[target].tokens), kv_before)
        for sid in others:
            assert batch.streams[sid].state != before[sid], f"{sid} did not commit"

        batch.streams[target].post_completion = engine
        batch.decode({"max_tokens": 2})
        assert batch.streams[target].decoded_tokens() == before[target].decoded + 2


# -- the pool torn down mid-phase: what is reported committed is in the store --

#: The teardown cases' target waits this long before it tears the pool
#: down, while the other streams (a tenth of a second each) all finish.
_TEARDOWN_AFTER_S = 1.5
#: Read back in a fresh interpreter: each stream's cached KV (its sum and
#: length) for the tokens it holds, from a store opened by its URL.
_READ_BACK = """
import json, sys
import numpy as np
from lmcache_mp.kv import connect
url, chunk_size, tokens = json.loads(sys.stdin.read())
ctx = connect(url, chunk_size=chunk_size)
out = {}
for sid, toks in tokens.items():
    kv = ctx.retrieve(toks)
    out[sid] = None if kv is None else [float(kv.astype(np.float64).sum()), kv.shape[2]]
print(json.dumps(out))
"""


def _read_back(store: SharedMemoryKVStore, tokens: dict[str, list[int]]) -> Any:
    """Each stream's KV as a fresh process reads it from the store."""
    proc = subprocess.run(
        [sys.executable, "-c", _READ_BACK],
        input=json.dumps([store.url, store.chunk_size, tokens]),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        cwd=os.getcwd(),
    )
    return json.loads(proc.stdout)


def _summary(kv: np.ndarray | None) -> list[float] | None:
    return None if kv is None else [float(kv.astype(np.float64).sum()), kv.shape[2]]


def _same_tokens(kv: np.ndarray, tokens: list[int]) -> Any:
    """Replaces the KV of the tokens the stream holds (a staged write)."""
    return np.full_like(kv, 7.0), tokens


def _every_other(kv: np.ndarray, tokens: list[int]) -> Any:
    """Keeps every other token: new tokens, new chunks."""
    return np.full_like(kv[:, :, ::2], 7.0), tokens[::2]


def _tear_down(how: str) -> Callable[[], Any]:
    def sleep_then() -> Any:
        time.sleep(_TEARDOWN_AFTER_S)
        if how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if how == "os-exit":
            os._exit(1)
        time.sleep(30)  # phase_timeout and Ctrl-C stop it first

    return sleep_then


def _teardown_edit(edit: Callable[..., Any], how: str) -> Callable[..., Any]:
    stop = _tear_down(how)

    def fn(kv: np.ndarray, tokens: list[int]) -> Any:
        if tokens[0] == TARGET:
            stop()
        time.sleep(0.1)
        return edit(kv, tokens)

    return fn


@dataclass(frozen=True)
class Teardown:
    """A way the pool is torn down while one stream's fn runs."""

    #: What the target stream is reported as, or ``None``: the phase
    #: raises this instead and no stream commits (Ctrl-C).
    error: type[BaseException] | None
    says: str = ""
    phase_timeout: float | None = None


TEARDOWNS = {
    "sigkill": Teardown(TerminatedWorkerError, "SIGKILL"),
    "os-exit": Teardown(TerminatedWorkerError, "exited with code 1"),
    "phase-timeout": Teardown(
        PhaseTimeoutError, "phase timeout of 3.5s", phase_timeout=_TEARDOWN_AFTER_S + 2
    ),
    "ctrl-c": Teardown(None),
}
EDITS = {"same-tokens": _same_tokens, "new-tokens": _every_other}


@contextlib.contextmanager
def _ctrl_c_after(seconds: float) -> Iterator[None]:
    """SIGINT to this (main) thread ``seconds`` into the block, as Ctrl-C."""
    main = threading.get_ident()
    timer = threading.Timer(seconds, signal.pthread_kill, (main, signal.SIGINT))
    # Python's own handler, whatever the shell that started pytest set.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        timer.join(timeout=10)
        signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
@pytest.mark.parametrize("edit", list(EDITS))
@pytest.mark.parametrize("how", list(TEARDOWNS))
def test_a_torn_down_pool_keeps_every_committed_edit(
    how: str, edit: str, start_method: str, store: SharedMemoryKVStore
) -> None:
    """The pool is torn down while one stream's fn runs, after the others
    finished: a fresh process reads every stream reported committed with its
    edited KV, and the target (reported failed, or every stream after
    Ctrl-C) with its old KV; no staged chunk is left; the next phase runs."""
    case = TEARDOWNS[how]
    with lmc_batch.LMCacheBatchedStream(
        "process", mp_context=start_method, max_workers=2
    ) as batch:
        engine = FakeEngine(store)
        for i in range(6):
            batch.add(lmc_stream.create_request(store, engine, list(range(i, i + 12))))
        batch.prefill({})
        target = next(sid for sid, s in batch.streams.items() if s.tokens[0] == TARGET)
        before = {sid: s.state.copy() for sid, s in batch.streams.items()}
        old = {sid: _summary(store.retrieve(s.tokens)) for sid, s in before.items()}
        fn = _teardown_edit(EDITS[edit], how)

        if case.error is None:
            with pytest.raises(KeyboardInterrupt), _ctrl_c_after(_TEARDOWN_AFTER_S):
                batch.modify(fn)
            committed: list[str] = []
        else:
            with pytest.raises(LMCacheBatchedStreamError) as info:
                batch.modify(fn, phase_timeout=case.phase_timeout)
            assert list(info.value.failures) == [target]
            error = info.value.failures[target]
            assert isinstance(error, case.error) and target in str(error)
            assert case.says in str(error)
            committed = [sid for sid in batch.streams if sid != target]

        tokens = {sid: s.tokens for sid, s in batch.streams.items()}
        seen = _read_back(store, tokens)
        for sid in batch.streams:
            if sid in committed:
                kv = seen[sid]
                assert kv is not None and kv[0] == 7.0 * kv[1] * 2 * 2 * 4, sid
                assert batch.streams[sid].state != before[sid]
            else:
                assert batch.streams[sid].state == before[sid]
                assert seen[sid] == old[sid], f"{sid} lost its old KV"
        assert staged_names(store) == []

        batch.decode({"max_tokens": 2})
        assert batch.streams[target].decoded_tokens() == before[target].decoded + 2
