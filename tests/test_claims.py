"""Specification of the claims tasks take on their streams:
how a lost worker's streams are told apart, and how an engine's own retry
of a task is refused instead of running a stream twice."""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Iterator
from typing import Any

import cloudpickle
import pytest

import lmcache_mp
from lmcache_mp._core.phase import PhaseSpec, StreamJob, StreamOutcome
from lmcache_mp._core.records import StreamState
from lmcache_mp.errors import TerminatedWorkerError
from lmcache_mp.executors._claims import Claims, FileClaims, RedisClaims
from lmcache_mp.executors._worker import ShardTask, run_shard
from tests._fakes import FakeEngine, InMemoryKV


@pytest.fixture(params=["file", "redis"])
def claims(request: pytest.FixtureRequest, redis_server: Any) -> Iterator[Claims]:
    """Fresh claims in a private directory, or in a Redis store's namespace.

    Takes ``redis_server`` for both, so that the session's server is up
    before ``no_leaks`` lists the test's child processes.
    """
    if request.param == "file":
        made: Claims = FileClaims.create()
        yield made
        made.remove()
        return
    store = lmcache_mp.connect(request.getfixturevalue("redis_url"))
    made = RedisClaims.create(store)
    yield made
    made.remove()
    store.destroy()


def test_a_claim_is_exclusive_until_released(claims: Claims) -> None:
    """The first owner gets the claim; a second is told who holds it; after end() it is free again."""
    assert claims.begin(3, "worker-a") is None
    assert claims.begin(3, "worker-b") == "worker-a"
    assert claims.owners() == {3: "worker-a"}
    claims.end(3)
    assert claims.owners() == {}
    assert claims.begin(3, "worker-b") is None


def test_clear_releases_every_claim_and_remove_is_idempotent(claims: Claims) -> None:
    """clear() frees every job number; remove() may be called twice."""
    for no in range(3):
        claims.begin(no, f"w{no}")
    claims.clear()
    assert claims.owners() == {}
    claims.remove()
    claims.remove()


def test_claims_pickle_to_the_same_table(claims: Claims) -> None:
    """A pickled copy (what a worker gets) sees and takes the same claims."""
    copy: Claims = pickle.loads(pickle.dumps(claims))
    assert claims.begin(1, "parent-view") is None
    assert copy.begin(1, "worker") == "parent-view"


def _task(claims: Claims, spec_blob: bytes) -> bytes:
    state = StreamState(tokens=list(range(8)))
    job = StreamJob("s-1", "", 0, 0, state)
    digest = hashlib.blake2b(spec_blob, digest_size=16).hexdigest()
    task = ShardTask("", digest, [job], [0], True, claims)
    return pickle.dumps(task)


def test_an_engine_retry_of_a_claimed_stream_fails_it_naming_the_lost_worker(
    claims: Claims,
) -> None:
    """A task run again while its stream's claim is held returns TerminatedWorkerError naming the holder, and runs nothing."""
    kv = InMemoryKV(4)
    spec = PhaseSpec("generate", (kv,), (FakeEngine(kv),), {"max_tokens": 2})
    blob = cloudpickle.dumps(spec)
    claims.begin(0, "tcp://127.0.0.3:4000 (pid 42)")
    [raw] = run_shard(_task(claims, blob), blob, "tcp://127.0.0.2:5000 (pid 7)")
    outcome: StreamOutcome = pickle.loads(raw)
    assert isinstance(outcome.error, TerminatedWorkerError)
    assert "s-1" in str(outcome.error) and "127.0.0.3:4000" in str(outcome.error)
    assert outcome.state is None and outcome.perf is None


def test_a_task_releases_its_claims_when_its_streams_are_done(claims: Claims) -> None:
    """After a task's streams finish, none of their claims is held."""
    kv = InMemoryKV(4)
    spec = PhaseSpec("generate", (kv,), (FakeEngine(kv),), {"max_tokens": 2})
    blob = cloudpickle.dumps(spec)
    [raw] = run_shard(_task(claims, blob), blob, "w")
    assert pickle.loads(raw).error is None
    assert claims.owners() == {}
