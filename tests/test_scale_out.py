"""Specification of scale-out: the same batch on Dask and Ray,
with the shared-memory store or Redis.

The clusters are real: a Dask scheduler and three ``dask worker``
processes, each its own "host" on 127.0.0.2-4, and a Ray head with one Ray
node (raylet and workers) per "host" on 127.0.0.1 (``tests/_clusters.py``).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from functools import partial
from typing import Any

import numpy as np
import pytest

import lmcache_mp
import lmcache_mp.batch as lmc_batch
import lmcache_mp.stream as lmc_stream
from lmcache_mp.__main__ import main
from lmcache_mp.bench._engines import fresh_store_url
from lmcache_mp.edits import make_edit
from lmcache_mp.engine import EmbeddedEngine, EngineConfig
from lmcache_mp.errors import (
    KVStoreAuthError,
    KVStoreConnectionError,
    LMCacheBatchedStreamError,
    TerminatedWorkerError,
)
from tests._clusters import DaskHosts, RayHosts
from tests._redis_server import running

CHUNK = 16
PROMPT = 64
N_STREAMS = 6


def _prompts(n: int = N_STREAMS) -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [rng.integers(1, 512, PROMPT).tolist() for _ in range(n)]


def _executor(name: str, request: pytest.FixtureRequest) -> Any:
    """The ``executor=`` argument for ``name``, starting its cluster."""
    if name == "dask":
        return request.getfixturevalue("dask_hosts").client()
    if name == "ray":
        request.getfixturevalue("ray_hosts")
        return "ray"
    return name


def _seed_pipeline(executor: Any, url: str) -> list[tuple[Any, ...]]:
    """The seed's block: prefill, drop KV, decode; what each stream ends with."""
    ctx = lmcache_mp.connect(url, chunk_size=CHUNK)
    try:
        engine = EmbeddedEngine(ctx, EngineConfig())
        with lmc_batch.LMCacheBatchedStream(executor) as batch:
            for toks in _prompts():
                batch.add(lmc_stream.create_request(ctx, engine, toks))
            batch.prefill({"temperature": 0.0})
            batch.modify(make_edit("window", sinks=CHUNK, window=CHUNK))
            batch.decode({"max_tokens": 8, "temperature": 0.0})
            ends = []
            for s in batch.streams.values():
                kv = ctx.retrieve(s.tokens)
                assert kv is not None
                ends.append((s.tokens, s.output_tokens(), float(kv.sum())))
            return ends
    finally:
        ctx.destroy()


@pytest.fixture(scope="module")
def reference() -> list[tuple[Any, ...]]:
    """The serial run on a fresh shared-memory store."""
    return _seed_pipeline("serial", f"shm:///scale-ref-{os.getpid()}")


@pytest.mark.parametrize("store_kind", ["shm", "redis"])
@pytest.mark.parametrize("executor_name", ["serial", "process", "dask", "ray"])
def test_seed_pipeline_is_identical_on_every_executor_and_store(
    executor_name: str,
    store_kind: str,
    reference: list[tuple[Any, ...]],
    redis_server: Any,
    request: pytest.FixtureRequest,
) -> None:
    """Tokens, KV sums and decoded tokens equal the serial run's on every executor, with either store."""
    executor = _executor(executor_name, request)
    if store_kind == "redis":
        url = request.getfixturevalue("redis_url")
    else:
        url = f"shm:///scale-{executor_name}-{os.getpid()}"
    try:
        assert _seed_pipeline(executor, url) == reference
    finally:
        if executor_name == "dask":
            executor.close()


def test_dask_phase_ships_states_and_spec_not_kv(
    dask_hosts: DaskHosts, redis_url: str
) -> None:
    """A Dask modify moves ≤ 0.1 MiB through Dask while the KV goes through Redis."""
    ctx = lmcache_mp.connect(redis_url, chunk_size=CHUNK)
    client = dask_hosts.client()
    try:
        engine = EmbeddedEngine(ctx, EngineConfig())
        with lmc_batch.LMCacheBatchedStream(client) as batch:
            for toks in _prompts():
                batch.add(lmc_stream.create_request(ctx, engine, toks))
            batch.prefill({})
            report = batch.modify(make_edit("random", keep=0.5)).to_dict()
        transport = report["metrics"]["transport"]
        shipped = transport["pickled_bytes_sent"] + transport["pickled_bytes_received"]
        assert shipped <= 0.1 * 2**20
        kv_bytes = N_STREAMS * ctx.retrieve(_prompts()[0]).nbytes  # type: ignore[union-attr]
        assert kv_bytes > 4 * shipped
    finally:
        client.close()
        ctx.destroy()


def dask_host() -> str:
    """The loopback address of the Dask worker running this task."""
    import distributed

    return str(distributed.get_worker().address.split("://")[1].split(":")[0])


def ray_node() -> str:
    """The id of the Ray node running this task."""
    import ray

    return str(ray.get_runtime_context().get_node_id())


def sleepy_window(
    kv: np.ndarray, tokens: list[int], *, signals: str, where: Any
) -> tuple[np.ndarray, list[int]]:
    """Announces its host (``where()``) in a file named by the first token, then takes 3 s."""
    with open(os.path.join(signals, f"{where()}-{tokens[0]}"), "w"):
        pass
    time.sleep(3.0)
    return kv[:, :, :CHUNK], tokens[:CHUNK]


def _kill_when_started(kill: Any, signals: str, host: str, killed: list[str]) -> None:
    """Calls ``kill()`` once a stream has started on ``host``, listing the
    streams that had (their signal files)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        started = [n for n in os.listdir(signals) if n.startswith(f"{host}-")]
        if started:
            kill()
            killed.extend(started)
            return
        time.sleep(0.02)


def _modify_losing_a_host(
    executor: Any, url: str, where: Any, host: str, kill: Any, signals: str
) -> None:
    """Kills ``host`` mid-modify; checks the streams it ran failed naming it,
    kept state and KV, the others committed, and decode runs on the rest."""
    ctx = lmcache_mp.connect(url, chunk_size=CHUNK)
    try:
        engine = EmbeddedEngine(ctx, EngineConfig())
        with lmc_batch.LMCacheBatchedStream(executor) as batch:
            for toks in _prompts():
                batch.add(lmc_stream.create_request(ctx, engine, toks))
            batch.prefill({})
            before = {sid: s.state.copy() for sid, s in batch.streams.items()}
            killed: list[str] = []
            killer = threading.Thread(
                target=_kill_when_started, args=(kill, signals, host, killed)
            )
            killer.start()
            fn = partial(sleepy_window, signals=signals, where=where)
            with pytest.raises(LMCacheBatchedStreamError) as info:
                batch.modify(fn, phase_timeout=120)
            killer.join(60)
            lost = {
                sid
                for sid, s in batch.streams.items()
                if f"{host}-{s.tokens[0]}" in killed
            }
            assert lost and set(info.value.failures) == lost
            for sid in lost:
                error = info.value.failures[sid]
                assert isinstance(error, TerminatedWorkerError)
                assert host[:12] in str(error) and sid in str(error)
                assert batch.streams[sid].state == before[sid]
                assert ctx.retrieve(batch.streams[sid].tokens).shape[2] == PROMPT  # type: ignore[union-attr]
            for sid in set(batch.streams) - lost:
                assert len(batch.streams[sid].tokens) == CHUNK
            decoded = batch.decode({"max_tokens": 2})
            assert decoded.to_dict()["metrics"]["results"]["output_tokens"] > 0
    finally:
        ctx.destroy()


def test_a_lost_dask_host_fails_only_its_streams(
    own_dask_hosts: DaskHosts, redis_url: str, tmp_path: Any
) -> None:
    """Killing a Dask host mid-modify fails the streams it ran, naming it; they keep state and KV, the others commit, decode runs on the rest."""
    client = own_dask_hosts.client()
    try:
        _modify_losing_a_host(
            client,
            redis_url,
            dask_host,
            "127.0.0.3",
            partial(own_dask_hosts.kill_host, "127.0.0.3"),
            str(tmp_path),
        )
    finally:
        client.close()


def test_a_lost_ray_host_fails_only_its_streams(
    ray_hosts: RayHosts, redis_url: str, tmp_path: Any
) -> None:
    """Killing a Ray node (its raylet and workers) mid-modify fails the streams it ran, naming it; the others commit, decode runs on the rest."""
    node = ray_hosts.add_host()
    _modify_losing_a_host(
        "ray",
        redis_url,
        ray_node,
        RayHosts.node_id(node),
        partial(ray_hosts.kill_host, node),
        str(tmp_path),
    )


def crash_on_marked(kv: np.ndarray, tokens: list[int]) -> tuple[np.ndarray, list[int]]:
    """Kills its own worker process for the stream whose prompt starts with 1."""
    if tokens[0] == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return kv[:, :, :CHUNK], tokens[:CHUNK]


def test_a_dead_ray_worker_fails_only_its_stream(ray_hosts: RayHosts) -> None:
    """A Ray worker killed mid-modify fails its stream with TerminatedWorkerError; the others commit."""
    ctx = lmcache_mp.connect(chunk_size=CHUNK)
    try:
        engine = EmbeddedEngine(ctx, EngineConfig())
        prompts = _prompts(4)
        prompts[2][0] = 1
        with lmc_batch.LMCacheBatchedStream("ray") as batch:
            for toks in prompts:
                batch.add(lmc_stream.create_request(ctx, engine, toks))
            batch.prefill({})
            marked = next(s for s, st in batch.streams.items() if st.tokens[0] == 1)
            before = batch.streams[marked].state.copy()
            with pytest.raises(LMCacheBatchedStreamError) as info:
                batch.modify(crash_on_marked, phase_timeout=120)
            assert list(info.value.failures) == [marked]
            error = info.value.failures[marked]
            assert isinstance(error, TerminatedWorkerError) and "ray worker" in str(
                error
            )
            assert batch.streams[marked].state == before
            others = [s for sid, s in batch.streams.items() if sid != marked]
            assert all(len(s.tokens) == CHUNK for s in others)
    finally:
        ctx.destroy()


def _prefilled_on(
    url: str, executor: Any
) -> tuple[Any, lmc_batch.LMCacheBatchedStream]:
    ctx = lmcache_mp.connect(url, chunk_size=CHUNK)
    batch = lmc_batch.LMCacheBatchedStream(executor)
    for toks in _prompts(3):
        batch.add(
            lmc_stream.create_request(ctx, EmbeddedEngine(ctx, EngineConfig()), toks)
        )
    batch.prefill({})
    return ctx, batch


@pytest.mark.parametrize("failure", ["down", "password changed"])
def test_a_redis_lost_before_a_phase_fails_it_at_start(
    failure: str, dask_hosts: DaskHosts
) -> None:
    """A Redis that is down or refuses the password fails the phase at its start, naming every stream, and nothing commits."""
    client = dask_hosts.client()
    with running() as server:
        ctx, batch = _prefilled_on(server.url("down-test"), client)
        before = {sid: s.state.copy() for sid, s in batch.streams.items()}
        try:
            if failure == "down":
                server.stop()
            else:
                # As a restart with a new password: every connection drops.
                server.client().config_set("requirepass", "another-password")
                server.password = "another-password"
                server.client().client_kill_filter(_type="normal", skipme=True)
            with pytest.raises(LMCacheBatchedStreamError) as info:
                batch.modify(make_edit("random", keep=0.5))
            assert set(info.value.failures) == set(batch.streams)
            expected = KVStoreConnectionError if failure == "down" else KVStoreAuthError
            assert all(isinstance(e, expected) for e in info.value.failures.values())
            assert {sid: s.state for sid, s in batch.streams.items()} == before
        finally:
            # The server and its keys go with the block.
            batch.close()
            client.close()
            ctx.close()


def test_fresh_store_urls_name_a_new_store_under_the_given_one() -> None:
    """Each bench run gets its own prefix (Redis) or name (shm) under the URL given."""
    first = fresh_store_url("redis://:pw@127.0.0.1:6379/0?prefix=bench&timeout=3")
    second = fresh_store_url("redis://:pw@127.0.0.1:6379/0?prefix=bench&timeout=3")
    assert first != second
    assert first.startswith("redis://:pw@127.0.0.1:6379/0?prefix=bench-")
    assert "timeout=3" in first
    assert fresh_store_url("shm:///runs").startswith("shm:///runs-")


def test_bench_runs_dask_and_ray_beside_the_pool_on_redis(
    dask_hosts: DaskHosts,
    ray_hosts: RayHosts,
    redis_url: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``bench --executors process,dask,ray --scheduler --store redis://`` prints every phase of each, with identical decode outputs, and leaves no key."""
    status = main(
        [
            "bench",
            "--engine=toy",
            "--streams=3",
            "--prompt-tokens=64",
            "--layers=1",
            "--kv-heads=2",
            "--head-dim=8",
            "--max-tokens=4",
            "--chunk-size=16",
            "--edit=random",
            "--executors=process,dask,ray",
            f"--scheduler={dask_hosts.address}",
            f"--store={redis_url}",
        ]
    )
    out = capsys.readouterr().out
    assert status == 0
    rows = [line.split()[:2] for line in out.splitlines()]
    for phase in ("prefill", "modify", "decode"):
        for name in ("process", "dask", "ray"):
            assert [phase, name] in rows
    assert "decode outputs: identical across executors" in out
