"""Shared fixtures: fakes, stores, and the leak check run after every test."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import psutil
import pytest

from lmcache_mp._paths import shm_root
from tests._fakes import FakeEngine, InMemoryKV

#: multiprocessing helpers that live as long as the interpreter, by design.
_SESSION_HELPERS = ("resource_tracker", "forkserver")


def _children() -> set[int]:
    found = set()
    for child in psutil.Process().children(recursive=True):
        try:
            cmdline = " ".join(child.cmdline())
        except psutil.Error:
            continue
        if not any(name in cmdline for name in _SESSION_HELPERS):
            found.add(child.pid)
    return found


#: What lmcache_mp (store, pool) and multiprocessing (SharedMemory blocks,
#: named semaphores) leave in shared memory when they leak.
_SHM_PREFIXES = ("psm_", "sem.mp-", "wnsm_")


def _store_files() -> set[str]:
    return {
        name
        for name in os.listdir(shm_root())
        if "lmcache" in name or name.startswith(_SHM_PREFIXES)
    }


@pytest.fixture(autouse=True)
def no_leaks() -> Iterator[None]:
    """After every test: no new child process, store directory, or shared-memory segment."""
    before_children, before_files = _children(), _store_files()
    yield
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        left = _children() - before_children
        files = _store_files() - before_files
        if not left and not files:
            return
        time.sleep(0.05)
    assert not left, f"child processes left behind: {sorted(left)}"
    assert not files, f"files left behind in {shm_root()}: {sorted(files)}"


@pytest.fixture
def kv() -> InMemoryKV:
    """An in-memory KV context with 4-token chunks."""
    return InMemoryKV(chunk_size=4)


@pytest.fixture
def engine(kv: InMemoryKV) -> FakeEngine:
    """A fake post_completion bound to ``kv``."""
    return FakeEngine(kv)
