"""Specification of the Redis store (``redis://``) beyond the semantics it
shares with the shared-memory store (those run on both backends in
test_store*.py): its keys, the server's capacity and eviction, staged
commits as one transaction, processes, connection errors and URLs.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import pickle
import socket
import sys
import threading
from collections.abc import Iterator
from multiprocessing.connection import Connection

import numpy as np
import pytest

from lmcache_mp import LMCacheSDKCacheKind
from lmcache_mp.errors import (
    CorruptChunkWarning,
    KVConfigError,
    KVStoreAuthError,
    KVStoreConnectionError,
    KVStoreError,
    KVStoreSecurityError,
)
from lmcache_mp.kv import RedisKVStore, connect
from lmcache_mp.kv._chunk import chunk_file_size
from tests._redis_server import PASSWORD, RedisServer, free_port, running
from tests._scripts import run_python
from tests._store_util import RawChunks, StoreFactory, bits, kv_of, staged_names

C = 4
TOKENS = list(range(50, 50 + 3 * C))
JOIN_TIMEOUT_S = 60
QUERY = LMCacheSDKCacheKind.QUERY


@pytest.fixture
def ctx(redis_url: str, stores: StoreFactory) -> RedisKVStore:
    """A Redis store with 4-token chunks on the session's server."""
    store: RedisKVStore = stores.connect(redis_url, chunk_size=C)
    return store


@pytest.fixture
def private_server() -> Iterator[RedisServer]:
    """A server of the test's own (stopped, or reconfigured, freely)."""
    with running() as server:
        yield server


def _prefix(ctx: RedisKVStore) -> str:
    return ctx.url.split("prefix=")[1]


def _keys(ctx: RedisKVStore, pattern: str = "*") -> list[str]:
    return sorted(k.decode() for k in ctx.client().keys(pattern))


def test_keys_live_under_the_prefix_by_kind(ctx: RedisKVStore) -> None:
    """Chunks are {prefix}:{kind}:c:{hex key}, the layout {prefix}:{kind}:layout."""
    ctx.store(kv_of(TOKENS), TOKENS)
    query = ctx.for_kind(QUERY)
    query.store(kv_of(TOKENS)[:1], TOKENS)
    prefix = _prefix(ctx)
    raw = RawChunks(ctx, TOKENS)
    assert _keys(ctx) == sorted(
        [f"{prefix}:kv:layout", f"{prefix}:query:layout"]
        + [f"{prefix}:kv:c:{key.hex()}" for key in raw.keys]
        + [f"{prefix}:query:c:{key.hex()}" for key in raw.keys]
    )
    assert query.url == ctx.url + "#query" and query.kind is QUERY


def test_a_value_is_exactly_a_chunk_file(
    ctx: RedisKVStore, stores: StoreFactory
) -> None:
    """The same KV gives the same bytes as a Redis value and as a chunk file."""
    shm = stores.connect(chunk_size=C)
    kv = kv_of(TOKENS, dtype=np.float16)
    ctx.store(kv, TOKENS)
    shm.store(kv, TOKENS)
    layout = ctx.layout
    assert layout is not None and layout == shm.layout
    for index in range(3):
        value = RawChunks(ctx, TOKENS).get(index)
        assert value is not None and len(value) == chunk_file_size(layout, C)
        assert value == RawChunks(shm, TOKENS).get(index)


def test_the_password_is_masked_in_repr_and_errors(ctx: RedisKVStore) -> None:
    """repr and error messages show *** for the password; url keeps it to reopen."""
    assert PASSWORD not in repr(ctx) and ":***@" in repr(ctx)
    assert PASSWORD in ctx.url
    ctx.close()
    with pytest.raises(KVStoreError) as err:
        ctx.retrieve(TOKENS)
    assert PASSWORD not in str(err.value) and ":***@" in str(err.value)


@pytest.mark.parametrize("password", ["wrong-password", ""])
def test_refused_credentials_are_an_auth_error(
    redis_server: RedisServer, password: str
) -> None:
    """A wrong or missing password: KVStoreAuthError naming authentication, at connect."""
    url = redis_server.url("test-auth", password=password)
    with pytest.raises(KVStoreAuthError, match="authentication") as err:
        connect(url)
    assert isinstance(err.value, KVStoreConnectionError)
    assert isinstance(err.value, KVStoreSecurityError)
    assert "wrong-password" not in str(err.value)


def test_a_server_that_is_down_is_a_connection_error_at_connect() -> None:
    """Nothing listening on the port: connect raises KVStoreConnectionError."""
    url = f"redis://:pw@127.0.0.1:{free_port()}/0?prefix=test-down&timeout=2"
    with pytest.raises(KVStoreConnectionError, match="cannot reach") as err:
        connect(url)
    assert isinstance(err.value, ConnectionError)
    assert "127.0.0.1" in str(err.value) and ":pw@" not in str(err.value)


def test_a_server_that_went_down_fails_ping_and_calls(
    private_server: RedisServer,
) -> None:
    """After the server stops, ping() and retrieve() raise KVStoreConnectionError."""
    ctx = connect(private_server.url("test-gone"), chunk_size=C)
    ctx.ping()
    private_server.stop()
    with pytest.raises(KVStoreConnectionError):
        ctx.ping()
    with pytest.raises(KVStoreConnectionError, match="prefix=test-gone"):
        ctx.retrieve(TOKENS)


def test_a_server_that_never_answers_times_out() -> None:
    """A listener that never replies: the URL's timeout bounds connect, no hang."""
    with socket.socket() as mute:
        mute.bind(("127.0.0.1", 0))
        mute.listen(8)
        url = f"redis://127.0.0.1:{mute.getsockname()[1]}/0?timeout=0.2"
        with pytest.raises(KVStoreConnectionError, match=r"within 0\.2 s"):
            connect(url)


@pytest.mark.parametrize(
    ("url", "needle"),
    [
        ("redis://127.0.0.1:6379/0?prefix=a:b", "bad store prefix"),
        ("redis://127.0.0.1:6379/0?prefix=", "bad store prefix"),
        ("redis://127.0.0.1:6379/0?prefix=.hidden", "bad store prefix"),
        ("redis://127.0.0.1:6379/0?prefix=a*", "bad store prefix"),
        ("redis://127.0.0.1:6379/0?timeout=0", "bad store timeout"),
        ("redis://127.0.0.1:6379/0?timeout=soon", "bad store timeout"),
        ("redis://127.0.0.1:6379/0?timeout=inf", "bad store timeout"),
        ("redis://127.0.0.1:6379/0?db=1", "unknown options: db"),
        ("redis://127.0.0.1:6379/zero", "expected redis://"),
        ("redis://127.0.0.1:6379/0#query", "expected redis://"),
        ("redis:///0", "expected redis://"),
        ("redis://127.0.0.1:99999/0", "bad store URL"),
    ],
)
def test_malformed_redis_urls_are_config_errors(url: str, needle: str) -> None:
    """Prefix, timeout, options, db, host and port are checked before connecting."""
    with pytest.raises(KVConfigError, match=needle):
        connect(url)


def test_capacity_argument_is_refused(redis_url: str) -> None:
    """connect(redis://, capacity_bytes=) is refused: the capacity is maxmemory."""
    with pytest.raises(KVConfigError, match="maxmemory"):
        connect(redis_url, capacity_bytes=1 << 20)


def test_capacity_is_the_servers_maxmemory(ctx: RedisKVStore) -> None:
    """capacity_bytes and stats() report the server's maxmemory (64 MiB here)."""
    assert ctx.capacity_bytes == 64 * 2**20
    assert ctx.stats().capacity_bytes == 64 * 2**20


def _acl_user(server: RedisServer, keys: str, commands: list[str]) -> str:
    """Add an ACL user allowed every command but ``commands`` on ``keys``;
    return a store URL (prefix ``mine``) that logs in as it."""
    server.client().acl_setuser(
        "limited",
        enabled=True,
        passwords=["+pw2"],
        keys=[keys],
        categories=["+@all"],
        commands=commands,
    )
    return f"redis://limited:pw2@127.0.0.1:{server.port}/0?prefix=mine"


def test_capacity_is_read_from_info_when_acl_refuses_config(
    private_server: RedisServer,
) -> None:
    """An ACL user that may not run CONFIG still gets maxmemory (from INFO)."""
    url = _acl_user(private_server, "*", ["-config"])
    with connect(url) as ctx:
        assert ctx.capacity_bytes == 64 * 2**20


def test_a_server_whose_acl_hides_its_memory_is_warned_unknown(
    private_server: RedisServer,
) -> None:
    """An ACL refusing CONFIG and INFO: connect warns, capacity and evictions read 0."""
    url = _acl_user(private_server, "*", ["-config", "-info"])
    with pytest.warns(RuntimeWarning, match="eviction policy are unknown"):
        ctx = connect(url, chunk_size=C)
    assert ctx.capacity_bytes == 0
    ctx.store(kv_of(TOKENS), TOKENS)
    stats = ctx.stats()
    assert (stats.capacity_bytes, stats.evictions, stats.chunks) == (0, 0, 3)


def test_a_command_the_acl_refuses_is_a_security_error(
    private_server: RedisServer,
) -> None:
    """A user whose keys exclude the prefix: store raises KVStoreSecurityError."""
    url = _acl_user(private_server, "other:*", [])
    with pytest.raises(KVStoreSecurityError, match="ACL refused"):
        connect(url, chunk_size=C).store(kv_of(TOKENS), TOKENS)


def test_eviction_policies_that_keep_chunks_are_refused(
    private_server: RedisServer,
) -> None:
    """Under a maxmemory, only allkeys-lru/lfu are accepted; without one, any policy."""
    client = private_server.client()
    url = private_server.url("test-policy")
    for policy in ("noeviction", "volatile-lru", "volatile-lfu", "allkeys-random"):
        client.config_set("maxmemory-policy", policy)
        with pytest.raises(KVConfigError, match=f"maxmemory-policy {policy}"):
            connect(url)
    client.config_set("maxmemory", 0)
    connect(url).close()  # noeviction, but unbounded: never full
    client.config_set("maxmemory-policy", "allkeys-lfu")
    client.config_set("maxmemory", 2**20)
    with connect(url) as ctx:
        assert ctx.capacity_bytes == 2**20


def test_an_unbounded_server_reports_capacity_0(private_server: RedisServer) -> None:
    """A server without maxmemory (never evicts) reports capacity_bytes 0."""
    private_server.client().config_set("maxmemory", 0)
    with connect(private_server.url("test-unbounded")) as ctx:
        assert ctx.capacity_bytes == 0 and ctx.stats().capacity_bytes == 0


def test_eviction_keeps_every_prefix_consistent_and_is_counted() -> None:
    """Over a tiny maxmemory the server evicts; each retrieve is then exactly the
    chunks left at the head of its prompt, and stats count the evictions."""
    with running(maxmemory="3mb") as server:
        ctx = connect(server.url("test-evict"), chunk_size=C)
        prompts = [[n] * (4 * C) for n in range(120)]
        for n, toks in enumerate(prompts):
            # 4 chunks of 2 x 8 x 4 x 1024 float32 = 64 KiB each: 30 MiB in all.
            ctx.store(kv_of(toks, layers=8, width=1024, seed=n), toks)
        stats = ctx.stats()
        assert stats.capacity_bytes == 3 * 2**20
        assert stats.evictions > 0 and 0 < stats.chunks < 4 * len(prompts)
        # Which chunks survive is the server's choice (its LRU is sampled, on
        # a 1 s clock); lifting the limit freezes them for the check.
        server.client().config_set("maxmemory", "64mb")
        kept = 0
        for n, toks in enumerate(prompts):
            raw = RawChunks(ctx, toks)
            head = next((i for i in range(4) if raw.get(i) is None), 4)
            got = ctx.retrieve(toks)
            assert (0 if got is None else got.shape[2]) == head * C
            if got is not None:
                want = kv_of(toks, layers=8, width=1024, seed=n)[:, :, : head * C]
                assert np.array_equal(bits(got), bits(want))
            kept += head
        assert kept <= stats.chunks
        fresh = [999] * (4 * C)
        assert ctx.store(kv_of(fresh, layers=8, width=1024), fresh)
        got = ctx.retrieve(fresh)
        assert got is not None and got.shape[2] == 4 * C


def _commands(server: RedisServer, out: list[str]) -> None:
    """Record the commands the server runs (MONITOR) up to the first EXEC;
    give up after the client's 5 s socket timeout."""
    with server.client().monitor() as monitor, contextlib.suppress(Exception):
        while not out or out[-1] != "EXEC":
            out.append(monitor.next_command()["command"].split()[0].upper())


def test_a_staged_edit_is_committed_in_one_transaction(
    private_server: RedisServer,
) -> None:
    """commit() runs RENAME+PERSIST of every chunk inside one MULTI/EXEC."""
    ctx = connect(private_server.url("test-multi"), chunk_size=C)
    ctx.store(kv_of(TOKENS), TOKENS)
    staged = ctx.stage(kv_of(TOKENS, seed=1), TOKENS)
    seen: list[str] = []
    watcher = threading.Thread(target=_commands, args=(private_server, seen))
    watcher.start()
    while "PING" not in seen and watcher.is_alive():  # until MONITOR is on
        ctx.ping()
    staged.commit()
    watcher.join(JOIN_TIMEOUT_S)
    verbs = [verb for verb in seen if verb != "PING"]
    start = verbs.index("MULTI")
    assert verbs[start : start + 8] == ["MULTI"] + ["RENAME", "PERSIST"] * 3 + ["EXEC"]
    for key in RawChunks(ctx, TOKENS).keys:
        assert ctx.client().ttl(ctx._chunk_key(key)) == -1  # no expiry left
    np.testing.assert_array_equal(
        bits(ctx.retrieve(TOKENS)), bits(kv_of(TOKENS, seed=1))
    )


def test_staged_chunks_expire_and_a_lost_one_fails_the_commit(
    ctx: RedisKVStore,
) -> None:
    """Staged keys expire in 10 minutes; if one is gone, commit raises and changes nothing."""
    ctx.store(kv_of(TOKENS), TOKENS)
    staged = ctx.stage(kv_of(TOKENS, seed=1), TOKENS)
    ttls = [ctx.client().ttl(name) for name in staged_names(ctx)]
    assert len(ttls) == 3 and all(0 < t <= 600 for t in ttls)
    ctx.client().delete(staged.moves[1][0])  # evicted, or expired
    with pytest.raises(
        KVStoreError, match="1 of 3 staged chunks expired or were evicted"
    ):
        staged.commit()
    np.testing.assert_array_equal(bits(ctx.retrieve(TOKENS)), bits(kv_of(TOKENS)))
    assert staged_names(ctx) == []


def test_discard_after_commit_keeps_the_edit(ctx: RedisKVStore) -> None:
    """A commit then a discard (or a second commit) leaves the edited KV in place."""
    ctx.store(kv_of(TOKENS), TOKENS)
    staged = ctx.stage(kv_of(TOKENS, seed=1), TOKENS)
    staged.commit()
    staged.discard()
    staged.commit()
    np.testing.assert_array_equal(
        bits(ctx.retrieve(TOKENS)), bits(kv_of(TOKENS, seed=1))
    )


def test_a_planted_value_of_another_type_is_replaced(ctx: RedisKVStore) -> None:
    """A hash at a chunk's key is a miss; the next store replaces it, warned as corrupt."""
    ctx.store(kv_of(TOKENS[:C]), TOKENS[:C])
    name = ctx._chunk_key(RawChunks(ctx, TOKENS).keys[1])
    ctx.client().hset(name, "x", "y")
    got = ctx.retrieve(TOKENS)
    assert got is not None and got.shape[2] == C
    with pytest.warns(CorruptChunkWarning, match="a Redis hash"):
        assert ctx.store(kv_of(TOKENS), TOKENS)
    got = ctx.retrieve(TOKENS)
    assert got is not None and got.shape[2] == 3 * C
    assert ctx.stats().corrupt == 1


def _use_in_child(ctx: RedisKVStore, tokens: list[int], pipe: Connection) -> None:
    """Store and retrieve ``tokens`` through ``ctx``; send back the KV's bytes
    and the id of the pool used (an object inherited by fork keeps its id)."""
    ctx.store(kv_of(tokens, seed=7), tokens)
    got = ctx.retrieve(tokens)
    assert got is not None
    pipe.send((bytes(bits(got)), id(ctx.client().connection_pool)))


def _run_child(method: str, ctx: RedisKVStore, tokens: list[int]) -> tuple[bytes, int]:
    """Run :func:`_use_in_child` in a child started by ``method``; return
    what it sent (every wait bounded by JOIN_TIMEOUT_S)."""
    mp = multiprocessing.get_context(method)
    mine, theirs = mp.Pipe()
    child = mp.Process(target=_use_in_child, args=(ctx, tokens, theirs))
    child.start()
    try:
        assert mine.poll(JOIN_TIMEOUT_S), "the child sent nothing"
        got: tuple[bytes, int] = mine.recv()
    finally:
        child.join(JOIN_TIMEOUT_S)
        mine.close()
        theirs.close()
    assert child.exitcode == 0
    return got


def test_a_spawned_process_uses_the_pickled_store(ctx: RedisKVStore) -> None:
    """A spawned child given the pickled store writes chunks the parent then reads."""
    assert len(pickle.dumps(ctx)) < 1000
    other = list(range(900, 900 + 2 * C))
    got, _ = _run_child("spawn", ctx, other)
    assert got == bytes(bits(kv_of(other, seed=7)))
    np.testing.assert_array_equal(bits(ctx.retrieve(other)), bits(kv_of(other, seed=7)))


def test_a_forked_child_opens_its_own_connections(ctx: RedisKVStore) -> None:
    """A forked child using the inherited handle gets a pool of its own; the parent's still works."""
    ctx.store(kv_of(TOKENS), TOKENS)
    parent_pool = ctx.client().connection_pool
    other = list(range(700, 700 + 2 * C))
    got, child_pool_id = _run_child("fork", ctx, other)
    assert child_pool_id != id(parent_pool)
    assert got == bytes(bits(kv_of(other, seed=7)))
    assert ctx.client().connection_pool is parent_pool
    np.testing.assert_array_equal(bits(ctx.retrieve(TOKENS)), bits(kv_of(TOKENS)))


def test_destroy_deletes_every_key_of_its_prefix_only(
    redis_url: str, stores: StoreFactory
) -> None:
    """destroy() of the KV context removes all kinds, staging and claims; another
    prefix is untouched; a QUERY context's destroy removes that kind only."""
    ctx = stores.connect(redis_url, chunk_size=C)
    neighbour = stores.connect(redis_url + "x", chunk_size=C)
    for store in (ctx, neighbour, ctx.for_kind(QUERY)):
        store.store(kv_of(TOKENS)[: store.kind.planes], TOKENS)
    ctx.stage(kv_of(TOKENS, seed=1), TOKENS)
    ctx.client().hset(ctx.claims_key("phase"), "0", "worker")
    query = ctx.for_kind(QUERY)
    query.destroy()
    assert _keys(ctx, f"{_prefix(ctx)}:query:*") == []
    assert ctx.retrieve(TOKENS) is not None
    ctx.destroy()
    assert _keys(neighbour, f"{_prefix(ctx)}:*") == []
    assert neighbour.retrieve(TOKENS) is not None
    ctx.destroy()  # idempotent


def test_importing_the_package_does_not_import_redis() -> None:
    """redis is an optional extra: import lmcache_mp / lmcache_mp.kv leaves it unloaded."""
    script = (
        "import sys, lmcache_mp, lmcache_mp.kv\n"
        "from lmcache_mp.kv import RedisKVStore, connect\n"
        "print('redis' in sys.modules)\n"
    )
    done = run_python(script, timeout=JOIN_TIMEOUT_S)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_a_missing_redis_package_names_the_extra(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the redis package, opening a redis:// store says what to install."""
    monkeypatch.setitem(sys.modules, "redis", None)
    with pytest.raises(KVConfigError, match=r"pip install 'lmcache-mp\[redis\]'"):
        connect(redis_url)
