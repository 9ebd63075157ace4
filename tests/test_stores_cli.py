"""``lmcache-mp stores``: lists this user's stores, reaps exactly what dead
processes left (dry run unless ``--yes``), never a live owner's store, and
removes a named store only when it is one and the user's."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from lmcache_mp.__main__ import main
from lmcache_mp._util.paths import shm_root
from lmcache_mp._util.proc import process_started
from lmcache_mp.kv import connect, list_stores, reap_stores

CHUNK = 16


def _kv(tokens: int) -> np.ndarray:
    return np.ones((2, 2, tokens, 8), np.float32)


@pytest.fixture
def dead_owner() -> str:
    """``<pid>-<started>`` of a process that ran and is gone."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    started = None
    deadline = time.monotonic() + 10
    while started is None and time.monotonic() < deadline:
        started = process_started(proc.pid)
    proc.kill()
    proc.wait(timeout=30)
    return f"{proc.pid}-{started}"


@pytest.fixture
def leftovers(dead_owner: str) -> Iterator[list[str]]:
    """A dead owner's temporary store and pool directory, as a SIGKILL of
    the owner and of its tracker would leave them."""
    user_prefix = os.path.basename(connect_path("x"))[: -len("x")]
    paths = [
        os.path.join(shm_root(), f"{user_prefix}tmp-{dead_owner}-0123abcd"),
        os.path.join(shm_root(), f"lmcache-mp-pool-{dead_owner}-zz"),
    ]
    for path in paths:
        os.mkdir(path, 0o700)
    Path(paths[1], "spec-0").write_bytes(b"a cloudpickled fn")
    yield paths
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)


def connect_path(name: str) -> str:
    """The directory of ``shm:///name``."""
    with connect(f"shm:///{name}", chunk_size=CHUNK) as kv:
        path = kv.path
        kv.destroy()
    return path


def test_lists_a_temporary_and_a_named_store_with_their_owner_and_size(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The listing gives each store's kind, chunks, bytes and owner."""
    name = f"stores-list-{os.getpid()}"
    with (
        connect(chunk_size=CHUNK) as tmp,
        connect(f"shm:///{name}", chunk_size=CHUNK) as named,
    ):
        try:
            tmp.store(_kv(64), list(range(64)))
            named.store(_kv(32), list(range(32)))
            infos = {i.path: i for i in list_stores()}
            mine = infos[tmp.path]
            assert mine.temporary and mine.owner_pid == os.getpid()
            assert mine.owner_alive is True and mine.chunks == 4
            assert mine.bytes == tmp.stats().bytes
            other = infos[named.path]
            assert not other.temporary and other.owner_pid is None
            assert other.chunks == 2
            assert main(["stores"]) == 0
            out = capsys.readouterr().out
            assert name in out and "named" in out and "temporary" in out
        finally:
            named.destroy()


def test_reap_is_a_dry_run_without_yes(leftovers: list[str]) -> None:
    """``--reap`` names a dead owner's temporary store and pool directory
    and removes nothing."""
    found = reap_stores()
    assert sorted(found) == sorted(leftovers)
    assert all(os.path.isdir(p) for p in leftovers)


def test_reap_yes_removes_exactly_the_dead_owners_leftovers(
    leftovers: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """``--reap --yes`` removes the dead owner's store and pool directory;
    a live owner's temporary store and a named store stay."""
    name = f"stores-keep-{os.getpid()}"
    with (
        connect(chunk_size=CHUNK) as live,
        connect(f"shm:///{name}", chunk_size=CHUNK) as named,
    ):
        try:
            live.store(_kv(16), list(range(16)))
            assert main(["stores", "--reap", "--yes"]) == 0
            out = capsys.readouterr().out
            assert all(f"removed {p}" in out for p in leftovers)
            assert not any(os.path.exists(p) for p in leftovers)
            assert os.path.isdir(live.path) and os.path.isdir(named.path)
            assert live.retrieve(list(range(16))) is not None
        finally:
            named.destroy()


def test_reap_removes_the_pins_of_a_dead_batch(dead_owner: str) -> None:
    """A pin left by a dead batch's process is stale: the dry run counts
    it, ``act=True`` removes it, and the store's chunks stay."""
    name = f"stores-pins-{os.getpid()}"
    with connect(f"shm:///{name}", chunk_size=CHUNK) as kv:
        try:
            kv.store(_kv(16), list(range(16)))
            chunk = next(n for n in os.listdir(kv.path) if n.endswith(".kv"))
            pin = Path(kv.path, f".pin-{dead_owner}-batch-stream")
            pin.write_text(chunk)
            assert f"{kv.path}: 1 stale pins" in reap_stores()
            assert pin.exists()
            reap_stores(act=True)
            assert not pin.exists()
            assert kv.retrieve(list(range(16))) is not None
        finally:
            kv.destroy()


def test_rm_destroys_a_named_store(capsys: pytest.CaptureFixture[str]) -> None:
    """``stores rm NAME`` removes the store's directory."""
    name = f"stores-rm-{os.getpid()}"
    with connect(f"shm:///{name}", chunk_size=CHUNK) as kv:
        kv.store(_kv(16), list(range(16)))
        path = kv.path
    assert main(["stores", "rm", name]) == 0
    assert not os.path.exists(path)
    assert f"removed {path}" in capsys.readouterr().out


@pytest.mark.parametrize("problem", ["foreign file", "group access", "missing"])
def test_rm_refuses_what_is_not_the_users_store(
    tmp_path: Path, problem: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A directory holding other files, one others can enter, or no
    directory at all: a typed error, exit status 1, nothing removed."""
    target = tmp_path / "victim"
    if problem != "missing":
        target.mkdir(mode=0o700)
        (target / "notes.txt").write_text("keep me")
        if problem == "group access":
            (target / "notes.txt").unlink()
            target.chmod(0o750)
    assert main(["stores", "rm", "victim", "--root", str(tmp_path)]) == 1
    assert "lmcache-mp stores: error:" in capsys.readouterr().err
    if problem == "foreign file":
        assert (target / "notes.txt").read_text() == "keep me"
    elif problem == "group access":
        assert target.is_dir()


def test_a_live_writer_is_never_reaped() -> None:
    """A writer creating, filling and closing temporary stores in a loop,
    raced against a reaper that acts in a loop, never loses a store."""
    writer = textwrap.dedent(
        f"""
        import numpy as np
        import lmcache_mp
        for i in range(40):
            with lmcache_mp.connect(chunk_size={CHUNK}) as kv:
                tokens = list(range(i, i + 64))
                kv.store(np.full((2, 2, 64, 8), i, np.float32), tokens)
                got = kv.retrieve(tokens)
                assert got is not None and (got == i).all(), i
        print("ok", flush=True)
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", writer], stdout=subprocess.PIPE, text=True
    )
    try:
        while proc.poll() is None:
            reap_stores(act=True)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=60)
    assert proc.returncode == 0 and out.strip() == "ok"
