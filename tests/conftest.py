"""Shared fixtures: fakes, stores, and the leak check run after every test."""

from __future__ import annotations

import gc
import os
import re
import secrets
import time
from collections.abc import Iterator

import psutil
import pytest

from lmcache_mp._util.paths import shm_root
from lmcache_mp.kv import SharedMemoryKVStore, connect
from tests._clusters import (
    DaskHosts,
    RayHosts,
    descendants_of_clusters,
)
from tests._fakes import FakeEngine, InMemoryKV
from tests._redis_server import RedisServer, running
from tests._store_util import StoreFactory, unique_url

#: multiprocessing helpers that live as long as the interpreter, by design.
_SESSION_HELPERS = ("resource_tracker", "forkserver")


def _children() -> set[int]:
    found = set()
    clusters = descendants_of_clusters()
    for child in psutil.Process().children(recursive=True):
        if child.pid in clusters:
            continue
        try:
            cmdline = " ".join(child.cmdline())
        except psutil.Error:
            continue
        if not any(name in cmdline for name in _SESSION_HELPERS):
            found.add(child.pid)
    return found


#: What multiprocessing's SharedMemory blocks are named in /dev/shm.
_SHM_PREFIXES = ("psm_", "wnsm_")
#: multiprocessing's named semaphores (a pool's queues): unlinked when
#: their objects are collected, which pytest delays until after a test's
#: teardown (it holds the fixture values), so they are checked per session.
_SEMAPHORE_PREFIX = "sem.mp-"


#: A private directory's owner: the pid after its prefix
#: (``lmcache_mp._util.paths.private_tempdir``).
_OWNER = re.compile(r"^lmcache-mp-[a-z-]+?-(\d+)-\d+-")


def _ours(name: str) -> bool:
    """Whether ``name`` can be this session's: not a directory whose owner
    is another live process outside this one's tree (a second test run or
    a benchmark of the same user on the machine)."""
    owner = _OWNER.match(name)
    if owner is None:
        return True
    pid = int(owner.group(1))
    if pid == os.getpid() or not psutil.pid_exists(pid):
        return True
    try:
        return any(p.pid == os.getpid() for p in psutil.Process(pid).parents())
    except psutil.Error:
        return True


def _store_files() -> set[str]:
    return {
        name
        for name in os.listdir(shm_root())
        if ("lmcache" in name or name.startswith(_SHM_PREFIXES)) and _ours(name)
    }


def _semaphores() -> set[str]:
    return {n for n in os.listdir(shm_root()) if n.startswith(_SEMAPHORE_PREFIX)}


@pytest.fixture(autouse=True, scope="session")
def no_leaked_semaphores() -> Iterator[None]:
    """After the whole session: no named semaphore left behind by a pool."""
    before = _semaphores()
    yield
    gc.collect()
    left = _semaphores() - before
    assert not left, f"semaphores left behind in {shm_root()}: {sorted(left)}"


@pytest.fixture(autouse=True)
def no_leaks() -> Iterator[None]:
    """After every test: no new child process, store directory or shared-memory block."""
    before_children, before_files = _children(), _store_files()
    yield
    deadline = time.monotonic() + 10.0
    while True:
        left = _children() - before_children
        files = _store_files() - before_files
        if not (left or files) or time.monotonic() > deadline:
            break
        # Named semaphores of spawn/forkserver queues are unlinked when their
        # objects are collected, which a reference cycle can delay. Only
        # then: a collection costs ~0.15 s once torch, Ray and Dask are
        # imported, 3 minutes over the suite if run after every test.
        gc.collect()
        time.sleep(0.05)
    assert not left, f"child processes left behind: {sorted(left)}"
    assert not files, f"files left behind in {shm_root()}: {sorted(files)}"


@pytest.fixture
def store() -> Iterator[SharedMemoryKVStore]:
    """A fresh shared-memory store with 4-token chunks, destroyed afterwards."""
    ctx = connect(chunk_size=4)
    yield ctx
    ctx.destroy()


@pytest.fixture
def stores() -> Iterator[StoreFactory]:
    """Makes stores on demand; destroys every one (and checks it is gone)."""
    factory = StoreFactory()
    yield factory
    factory.destroy_all()


@pytest.fixture
def kv() -> InMemoryKV:
    """An in-memory KV context with 4-token chunks."""
    return InMemoryKV(chunk_size=4)


@pytest.fixture
def engine(kv: InMemoryKV) -> FakeEngine:
    """A fake post_completion bound to ``kv``."""
    return FakeEngine(kv)


# --- Redis: one real server for the redis:// store tests -----------------

#: The (server, prefix) of each redis_url a test took, for no_redis_leaks.
_REDIS_PREFIXES = pytest.StashKey[list[tuple[RedisServer, str]]]()


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """A redis-server (password, 64 MB maxmemory, allkeys-lru) for the session."""
    with running() as server:
        yield server


@pytest.fixture
def redis_url(request: pytest.FixtureRequest, redis_server: RedisServer) -> str:
    """A redis:// URL (password included) whose prefix no other test uses."""
    prefix = f"test-{secrets.token_hex(6)}"
    request.node.stash.setdefault(_REDIS_PREFIXES, []).append((redis_server, prefix))
    return redis_server.url(prefix)


@pytest.fixture(autouse=True)
def no_redis_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    """After a test that took a redis_url: its stores destroyed, no key outside its prefix.

    Autouse, so that it is set up first and checks last, after every other
    fixture of the test (``stores`` among them) has destroyed its stores.
    """
    yield
    for server, prefix in request.node.stash.get(_REDIS_PREFIXES, []):
        server.check_clean(prefix)


@pytest.fixture(params=["shm", "redis"])
def store_url(request: pytest.FixtureRequest, redis_server: RedisServer) -> str:
    """The URL of a fresh named store, of each backend (tests taking it run twice).

    Takes ``redis_server`` for both, so that the session's server is up
    before ``no_leaks`` lists the test's child processes.
    """
    if request.param == "redis":
        url: str = request.getfixturevalue("redis_url")
        return url
    return unique_url()


# --- Scale-out: a Dask cluster of three loopback hosts, Ray nodes --------


@pytest.fixture(scope="session")
def dask_hosts() -> Iterator[DaskHosts]:
    """A Dask scheduler and 3 workers on 127.0.0.2-4, shared by the session."""
    hosts = DaskHosts(3)
    yield hosts
    hosts.close()


@pytest.fixture
def own_dask_hosts() -> Iterator[DaskHosts]:
    """A Dask cluster of 3 loopback hosts for one test (which may kill one)."""
    hosts = DaskHosts(3)
    yield hosts
    hosts.close()


@pytest.fixture(scope="session")
def ray_hosts() -> Iterator[RayHosts]:
    """A Ray head and 2 single-CPU nodes on 127.0.0.1, this process its driver."""
    hosts = RayHosts(2)
    yield hosts
    hosts.close()
