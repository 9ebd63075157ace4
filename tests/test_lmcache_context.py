"""lmcache_context: upstream LMCache's SDK context in process workers.

Run against upstream's real multiprocess server (``lmcache==0.5.6``) on
loopback, started by the module's fixture, with a KV layout registered the
way an engine would (tests/_lmcache_server.py).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import numpy as np
import pytest
import torch

from lmcache_mp.cache_kind import LMCacheSDKCacheKind
from lmcache_mp.errors import KVConfigError, KVStoreConnectionError
from lmcache_mp.kv import KVContext, _lmcache, lmcache_context
from tests._lmcache_server import CHUNK, LAYERS, MODEL, WIDTH, LMCacheServer, running
from tests._redis_server import free_port

#: Longest any wait on the server or a pool may take here.
WAIT = 60.0


@pytest.fixture(scope="module")
def server() -> Iterator[LMCacheServer]:
    """A real LMCache server for the module, with MODEL's layout registered."""
    with running() as srv:
        yield srv


@pytest.fixture
def spec(server: LMCacheServer) -> Iterator[_lmcache.LMCacheContext]:
    """A spec on the server; this process's upstream context closed after."""
    ctx = lmcache_context(server.url, server.http_url, MODEL, timeout=30.0)
    yield ctx
    ctx.close()


def _wait_until(check: Any, what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {WAIT}s: {what}")
        time.sleep(0.1)


@contextlib.contextmanager
def _pool(method: str = "spawn", workers: int = 2) -> Iterator[ProcessPoolExecutor]:
    """A process pool, shut down after; its workers killed first when the
    block failed (a worker stuck past a result's timeout must not hang the
    shutdown)."""
    pool = ProcessPoolExecutor(workers, mp_context=mp.get_context(method))
    try:
        yield pool
    except BaseException:
        for proc in list((pool._processes or {}).values()):
            proc.kill()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _kv(tokens: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(2, LAYERS, tokens, WIDTH, generator=gen)


# --- what the workers run (module level: spawn imports them) ------------


def _use(spec: _lmcache.LMCacheContext) -> tuple[int, int]:
    """Use ``spec``; return this worker's pid and its upstream instance id."""
    assert spec.chunk_size == CHUNK
    return os.getpid(), _lmcache._upstream(spec._key).instance_id


def _store(spec: _lmcache.LMCacheContext, n: int, seed: int, salt: str) -> bool:
    # A numpy KV, as lmcache_mp's streams store it.
    return spec.store(_kv(n, seed).numpy(), list(range(n)), salt)


def _retrieve(spec: _lmcache.LMCacheContext, n: int, salt: str) -> Any:
    return spec.retrieve(list(range(n)), salt)


def _copies(blob: bytes, copies: int) -> tuple[int, int, int]:
    """Unpickle ``copies`` copies, use each from a thread; return
    (pid, distinct upstream contexts seen, contexts this process holds)."""
    specs = [pickle.loads(blob) for _ in range(copies)]
    seen: list[int] = []
    barrier = threading.Barrier(copies, timeout=WAIT)

    def run(s: _lmcache.LMCacheContext) -> None:
        barrier.wait()
        assert s.chunk_size == CHUNK
        seen.append(id(_lmcache._upstream(s._key)))

    threads = [threading.Thread(target=run, args=(s,)) for s in specs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    assert len(seen) == copies
    return os.getpid(), len(set(seen)), _lmcache._live()


# --- pickling and laziness ----------------------------------------------


def test_pickles_by_its_arguments_only() -> None:
    """A spec pickles to a few hundred bytes of its arguments, and unpickles equal."""
    spec = lmcache_context(
        "tcp://127.0.0.1:1", "http://127.0.0.1:2", "m", kind=LMCacheSDKCacheKind.QUERY
    )
    blob = pickle.dumps(spec)
    assert len(blob) < 400
    assert b"zmq" not in blob and b"socket" not in blob
    copy = pickle.loads(blob)
    assert copy == spec
    assert repr(copy) == repr(spec)
    assert copy.kind is LMCacheSDKCacheKind.QUERY


def test_pickle_of_a_used_spec_holds_no_socket(
    spec: _lmcache.LMCacheContext,
) -> None:
    """After its upstream context is built, a spec still pickles to its arguments alone."""
    before = pickle.dumps(spec)
    assert spec.chunk_size == CHUNK
    after = pickle.dumps(spec)
    assert after == before
    assert len(after) < 400
    assert b"zmq" not in after and b"instance_id" not in after


def test_nothing_is_opened_at_construction_or_unpickling(
    server: LMCacheServer,
) -> None:
    """Making or unpickling a spec opens nothing; the first use builds the context."""
    registered, live = server.registered(), _lmcache._live()
    spec = pickle.loads(
        pickle.dumps(lmcache_context(server.url, server.http_url, MODEL))
    )
    assert _lmcache._live() == live
    assert server.registered() == registered
    try:
        assert spec.chunk_size == CHUNK
        assert _lmcache._live() == live + 1
        assert len(server.registered() - registered) == 1
    finally:
        spec.close()


def test_is_a_kv_context_of_its_kind(spec: _lmcache.LMCacheContext) -> None:
    """A spec is a KVContext whose .kind is lmcache_mp's enum member.

    (Before Python 3.12, ``isinstance`` on the protocol reads ``chunk_size``,
    which builds the context: hence a spec on the real server.)
    """
    assert isinstance(spec, KVContext)
    assert spec.kind is LMCacheSDKCacheKind.KV


def test_upstream_context_gets_upstreams_kind_of_the_same_value(
    server: LMCacheServer,
) -> None:
    """A QUERY spec builds upstream's context with upstream's QUERY kind."""
    from lmcache.sdk.cache_kind import LMCacheSDKCacheKind as UpstreamKind

    spec = lmcache_context(
        server.url, server.http_url, MODEL, kind=LMCacheSDKCacheKind.QUERY
    )
    try:
        assert spec.chunk_size == CHUNK
        assert _lmcache._upstream(spec._key).kind is UpstreamKind.QUERY
    finally:
        spec.close()


# --- one upstream context per process -----------------------------------


def test_one_upstream_context_per_process_for_all_copies_and_threads(
    spec: _lmcache.LMCacheContext, server: LMCacheServer
) -> None:
    """Eight copies used at once from eight threads share one upstream context."""
    registered, live = server.registered(), _lmcache._live()
    _pid, distinct, held = _copies(pickle.dumps(spec), 8)
    assert distinct == 1
    assert held == live + 1
    assert len(server.registered() - registered) == 1


def test_each_worker_builds_one_context_for_many_copies(
    server: LMCacheServer,
) -> None:
    """Copies pickled to 2 spawn workers, 12 tasks: one upstream context per worker."""
    spec = lmcache_context(server.url, server.http_url, MODEL)
    blob = pickle.dumps(spec)
    with _pool() as pool:
        results = list(pool.map(_copies, [blob] * 6, [4] * 6, timeout=WAIT))
        ids = set(pool.map(_use, [spec] * 6, timeout=WAIT))
    # Each task, in whichever worker: its copies shared one context, and
    # the worker held no other.
    assert all(distinct == 1 and held == 1 for _pid, distinct, held in results)
    # The same worker answered every later task with the same context.
    assert len(ids) == len({pid for pid, _ in ids})


# --- store and retrieve from process workers ----------------------------


def test_store_in_one_worker_retrieve_in_another(server: LMCacheServer) -> None:
    """A KV stored from one spawn worker is retrieved, equal, from another."""
    spec = lmcache_context(server.url, server.http_url, MODEL)
    n, salt = 3 * CHUNK + 5, "store-retrieve"
    with _pool(workers=1) as writer, _pool(workers=1) as reader:
        assert reader.submit(_retrieve, spec, n, salt).result(WAIT) is None
        assert writer.submit(_store, spec, n, 1, salt).result(WAIT) is True
        got = reader.submit(_retrieve, spec, n, salt).result(WAIT)
    assert isinstance(got, torch.Tensor)
    assert got.shape == (2, LAYERS, 3 * CHUNK, WIDTH)
    assert torch.equal(got, _kv(n, 1)[:, :, : 3 * CHUNK])


def test_retrieve_keeps_salts_apart(spec: _lmcache.LMCacheContext) -> None:
    """KV stored under one salt is not retrieved under another."""
    n = 2 * CHUNK
    assert spec.store(_kv(n, 2), list(range(n)), "salt-a")
    assert spec.retrieve(list(range(n)), "salt-b") is None
    got = spec.retrieve(list(range(n)), "salt-a")
    assert got is not None and torch.equal(got, _kv(n, 2))


def test_store_of_a_mismatched_kv_is_a_config_error(
    spec: _lmcache.LMCacheContext,
) -> None:
    """A KV whose token axis is not len(tokens) is refused with KVConfigError."""
    with pytest.raises(KVConfigError, match="does not hold 3 tokens"):
        spec.store(np.zeros((2, LAYERS, 4, WIDTH), np.float32), [1, 2, 3])


def test_fork_worker_of_a_parent_holding_a_context_builds_its_own(
    spec: _lmcache.LMCacheContext,
) -> None:
    """A fork worker of a parent with an open context stores and retrieves; so does the parent.

    Upstream's shared ZMQ polling thread is not copied by fork: the child
    must not wait on the parent's.
    """
    n, salt = CHUNK, "forked"
    assert spec.retrieve(list(range(n)), salt) is None  # the parent's is open
    with _pool("fork", workers=1) as pool:
        assert pool.submit(_store, spec, n, 3, salt).result(WAIT) is True
        got = pool.submit(_retrieve, spec, n, salt).result(WAIT)
    assert got is not None and torch.equal(got, _kv(n, 3))
    mine = spec.retrieve(list(range(n)), salt)
    assert mine is not None and torch.equal(mine, _kv(n, 3))


# --- closed at exit -----------------------------------------------------


@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_worker_contexts_are_closed_when_the_workers_exit(
    server: LMCacheServer, method: str
) -> None:
    """Pool workers' contexts are unregistered from the server when the pool shuts down.

    fork workers leave by ``os._exit`` (no atexit): their close runs as a
    multiprocessing finalizer.
    """
    spec = lmcache_context(server.url, server.http_url, MODEL)
    with _pool(method) as pool:
        ids = {iid for _pid, iid in pool.map(_use, [spec] * 4, timeout=WAIT)}
        assert ids <= server.registered()
    _wait_until(lambda: not ids & server.registered(), f"{ids} unregistered")


def test_a_process_context_is_closed_at_interpreter_exit(
    server: LMCacheServer,
) -> None:
    """A plain script's context is unregistered when it exits normally (atexit)."""
    script = (
        "import sys; from lmcache_mp.kv import lmcache_context, _lmcache\n"
        "s = lmcache_context(*sys.argv[1:4])\n"
        "assert s.chunk_size\n"
        "print(_lmcache._upstream(s._key).instance_id)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, server.url, server.http_url, MODEL],
        capture_output=True,
        text=True,
        timeout=WAIT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    iid = int(done.stdout.split()[-1])
    _wait_until(lambda: iid not in server.registered(), f"{iid} unregistered")


def test_close_unregisters_and_a_later_use_builds_anew(
    server: LMCacheServer,
) -> None:
    """close() drops this process's context; the next use builds a new one."""
    spec = lmcache_context(server.url, server.http_url, MODEL)
    try:
        _pid, first = _use(spec)
        spec.close()
        assert first not in server.registered()
        _pid, second = _use(spec)
        assert second != first and second in server.registered()
    finally:
        spec.close()


# --- typed errors, never a hang -----------------------------------------


def test_missing_lmcache_is_a_config_error_naming_the_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without lmcache installed, first use raises KVConfigError with the pip line."""
    for name in ("lmcache.sdk.context", "lmcache.sdk.cache_kind"):
        monkeypatch.setitem(sys.modules, name, None)
    spec = lmcache_context("tcp://127.0.0.1:1", "http://127.0.0.1:2", "m")
    with pytest.raises(KVConfigError, match=r"pip install --no-deps lmcache==0\.5\.6"):
        _ = spec.chunk_size


def test_refused_server_is_a_connection_error_naming_the_url() -> None:
    """Nothing listening: KVStoreConnectionError with the URL, at once."""
    http_url = f"http://127.0.0.1:{free_port()}"
    spec = lmcache_context(f"tcp://127.0.0.1:{free_port()}", http_url, "m", timeout=5)
    start = time.monotonic()
    with pytest.raises(KVStoreConnectionError, match=http_url):
        spec.retrieve([1, 2, 3])
    assert time.monotonic() - start < 5
    assert spec._key not in _lmcache._contexts


def test_silent_server_is_a_connection_error_within_the_timeout() -> None:
    """A server that accepts but never answers fails after ``timeout``, not a hang."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        http_url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        spec = lmcache_context(
            f"tcp://127.0.0.1:{free_port()}", http_url, "m", timeout=1.0
        )
        start = time.monotonic()
        with pytest.raises(KVStoreConnectionError, match=http_url):
            spec.store(np.zeros((2, 1, 4, 2), np.float32), [1, 2, 3, 4])
        assert time.monotonic() - start < 10


def test_model_without_a_layout_is_a_config_error(server: LMCacheServer) -> None:
    """A model no engine registered raises KVConfigError naming it."""
    spec = lmcache_context(server.url, server.http_url, "no-such-model")
    live = _lmcache._live()
    with pytest.raises(KVConfigError, match="no-such-model"):
        _ = spec.chunk_size
    assert _lmcache._live() == live


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"url": ""}, "url"),
        ({"model_name": ""}, "model_name"),
        ({"timeout": 0}, "timeout"),
        ({"kind": "keys"}, "cache kind"),
    ],
)
def test_bad_arguments_are_config_errors(kwargs: dict[str, Any], match: str) -> None:
    """Bad arguments fail at construction with KVConfigError."""
    args: dict[str, Any] = {
        "url": "tcp://127.0.0.1:1",
        "http_url": "http://127.0.0.1:2",
        "model_name": "m",
    }
    args.update(kwargs)
    with pytest.raises(KVConfigError, match=match):
        lmcache_context(**args)


# --- the batch through a real server ---------------------------------------


def _pipeline(ctx: Any, executor: str) -> list[tuple[Any, ...]]:
    """prefill -> modify (sinks + window) -> decode of 4 streams; what each
    stream ends with."""
    import lmcache_mp.batch as lmc_batch
    import lmcache_mp.stream as lmc_stream
    from lmcache_mp.edits import make_edit
    from lmcache_mp.engine import EmbeddedEngine, EngineConfig

    model = EngineConfig(layers=LAYERS, kv_heads=1, head_dim=WIDTH, d_model=16)
    engine = EmbeddedEngine(ctx, model)
    rng = np.random.default_rng(3)
    with lmc_batch.LMCacheBatchedStream(executor, max_workers=2) as batch:
        for _ in range(4):
            prompt = rng.integers(1, model.vocab_size, 3 * CHUNK).tolist()
            batch.add(lmc_stream.create_request(ctx, engine, prompt))
        batch.prefill({"temperature": 0.0})
        batch.modify(make_edit("window", sinks=CHUNK, window=CHUNK))
        decoded = batch.decode({"max_tokens": 4, "temperature": 0.0})
        assert decoded.to_dict()["metrics"]["cache"]["cache_hit_tokens"] > 0
        return [
            (s.tokens, s.output_tokens(), float(as_sum(ctx.retrieve(s.tokens))))
            for s in batch.streams.values()
        ]


def as_sum(kv: Any) -> float:
    """The sum of a retrieved KV, torch or numpy."""
    return float(np.asarray(kv).astype(np.float64).sum())


def test_the_seed_pipeline_runs_through_the_server_from_process_workers(
    spec: _lmcache.LMCacheContext,
) -> None:
    """prefill -> modify -> decode on the process pool, with the KV in the real LMCache server, ends exactly as on the embedded store."""
    from lmcache_mp.kv import connect

    through_server = _pipeline(spec, "process")
    with connect(chunk_size=CHUNK) as embedded:
        assert through_server == _pipeline(embedded, "process")
    assert all(len(tokens) == 2 * CHUNK + 1 + 4 for tokens, _, _ in through_server)
