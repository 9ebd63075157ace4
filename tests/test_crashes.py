"""The crash table: every way one stream can fail in a worker, once per start method.

For each case: the failed stream's error has the expected type and names the
stream and the cause; the other streams commit; the failed stream keeps its
state and its stored KV; and the next phase succeeds on a (rebuilt) pool.
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
from collections.abc import Callable
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
    RemoteTraceback,
    StreamInputError,
    TerminatedWorkerError,
)
from lmcache_mp.kv import SharedMemoryKVStore
from tests._fakes import BadEventEngine, FakeEngine, FlakyEngine

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
