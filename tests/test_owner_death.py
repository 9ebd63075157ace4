"""Nothing is left behind when the owner of a temporary store or a process
pool dies, by any cause: its temporary store, the pool's private
directories, multiprocessing's named semaphores and the pool's workers
are gone within a few seconds (``lmcache_mp._util.tracker``, and CPython's
``resource_tracker`` for the semaphores)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from lmcache_mp._util import tracker
from lmcache_mp._util.paths import private_tempdir, remove_tree, shm_root
from lmcache_mp.kv import connect

#: Seconds a dead owner's leftovers may take to go.
GONE_WITHIN_S = 10.0

#: The owner: a temporary store, then a batch on a spawn process pool;
#: it prints ``<moment>`` and waits when it reaches the moment to die at.
OWNER = textwrap.dedent(
    """
    import faulthandler, os, signal, sys, time
    # SIGUSR1 dumps every thread's stack: a test whose owner does not exit
    # shows where it is.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    # Ctrl-C's KeyboardInterrupt, as from a terminal: a test run in the
    # background of a non-interactive shell inherits SIGINT ignored, and
    # Python then installs no handler of its own.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import numpy as np
    import lmcache_mp
    from lmcache_mp.batch import LMCacheBatchedStream
    from lmcache_mp.engine import EmbeddedEngine
    from lmcache_mp.stream import create_request

    MOMENT, HOW = sys.argv[1], sys.argv[2]

    def reached(moment):
        if moment != MOMENT:
            return
        # One write per line: both workers may reach the moment at once.
        os.write(1, (moment + "\\n").encode())
        if HOW == "os._exit":
            os._exit(3)
        if HOW == "exception":
            raise RuntimeError("the owner fails")
        if HOW == "exit":
            sys.exit(0)
        time.sleep(120)

    def slow_edit(kv, tokens):
        reached("modify")
        return kv, tokens

    if __name__ == "__main__":
        kv = lmcache_mp.connect()
        print(kv.url, flush=True)
        engine = EmbeddedEngine(kv)
        reached("store")
        batch = LMCacheBatchedStream(max_workers=2)
        for seed in range(2):
            tokens = np.random.default_rng(seed).integers(0, 100, 512).tolist()
            batch.add(create_request(kv, engine, tokens))
        batch.prefill({"temperature": 0.0, "max_tokens": 1})
        reached("between")
        batch.modify(slow_edit)
    """
)

#: A script without the ``__main__`` guard: every spawned worker runs its
#: store-and-batch code while importing it, and dies there.
GUARDLESS = textwrap.dedent(
    """
    import numpy as np
    import lmcache_mp
    from lmcache_mp.batch import LMCacheBatchedStream
    from lmcache_mp.engine import EmbeddedEngine
    from lmcache_mp.stream import create_request

    kv = lmcache_mp.connect()
    print(kv.url, flush=True)
    engine = EmbeddedEngine(kv)
    batch = LMCacheBatchedStream(max_workers=2)
    for seed in range(2):
        tokens = np.random.default_rng(seed).integers(0, 100, 512).tolist()
        batch.add(create_request(kv, engine, tokens))
    batch.prefill({"temperature": 0.0, "max_tokens": 1})
    batch.modify(lambda kv, tokens: (kv, tokens))
    """
)


def _leftovers() -> set[str]:
    """This user's store, pool and claims directories and named semaphores."""
    names = set(os.listdir(shm_root()))
    return {n for n in names if "lmcache-mp" in n or n.startswith("sem.mp-")}


def _wait_gone(before: set[str], pids: list[int]) -> tuple[set[str], list[int]]:
    """Wait until nothing new is left and every pid is gone (or the time is
    up); return what is still there."""
    deadline = time.monotonic() + GONE_WITHIN_S
    while True:
        left = _leftovers() - before
        alive = [p for p in pids if psutil.pid_exists(p) and _running(p)]
        if (not left and not alive) or time.monotonic() > deadline:
            return left, alive
        time.sleep(0.1)


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _read_line(proc: subprocess.Popen[str], timeout: float = 120.0) -> str:
    """The owner's next line of output, within ``timeout`` seconds."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None and not proc.stdout.readable():
            break
        line = proc.stdout.readline()
        if line:
            return line.strip()
        if proc.poll() is not None:
            break
    raise AssertionError(f"the owner printed nothing (exit {proc.returncode})")


KILLS = [
    pytest.param(moment, how, id=f"{how}-{moment}")
    for moment in ("store", "between", "modify")
    for how in ("SIGKILL", "SIGTERM")
] + [
    pytest.param("between", how, id=f"{how}-between")
    for how in ("SIGINT", "os._exit", "exception", "exit")
]


@pytest.mark.parametrize(("moment", "how"), KILLS)
def test_a_dead_owner_leaves_nothing(tmp_path: Path, moment: str, how: str) -> None:
    """Killed or exiting at each moment, the owner leaves no temporary
    store, no pool or claims directory, no named semaphore and no worker."""
    script = tmp_path / "owner.py"
    script.write_text(OWNER)
    before = _leftovers()
    errors = tmp_path / "owner.err"
    with errors.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, str(script), moment, how],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
    try:
        url = _read_line(proc)
        assert url.startswith("shm:///tmp-")
        assert _read_line(proc) == moment
        workers = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        if how.startswith("SIG"):
            proc.send_signal(getattr(signal, how))
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGUSR1)
            time.sleep(2)
            pytest.fail(
                f"the owner did not exit within 60 s ({how} at {moment}); its "
                f"stderr and stacks:\n{errors.read_text()}"
            )
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=60)
    left, alive = _wait_gone(before, workers)
    assert not left, f"left behind: {sorted(left)}"
    assert not alive, f"workers still alive: {alive}"


def test_a_guardless_script_on_spawn_leaves_nothing(tmp_path: Path) -> None:
    """A script without ``if __name__ == "__main__":`` makes every spawned
    worker create a store while importing it and die there: when the run
    ends, no store, directory, semaphore or worker is left."""
    script = tmp_path / "guardless.py"
    script.write_text(GUARDLESS)
    before = _leftovers()
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    workers: set[int] = set()
    try:
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                children = psutil.Process(proc.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                break
            workers.update(c.pid for c in children)
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=60)
    assert proc.returncode != 0
    left, alive = _wait_gone(before, sorted(workers))
    assert not left, f"left behind: {sorted(left)}"
    assert not alive, f"workers still alive: {alive}"


def test_a_named_store_written_by_a_killed_process_stays_readable(
    tmp_path: Path,
) -> None:
    """A named store is never the tracker's: a writer SIGKILLed while it
    stores leaves the store in place, and every chunk it holds reads back
    whole (the chunk files are renamed into place complete)."""
    name = f"owner-death-{os.getpid()}"
    writer = textwrap.dedent(
        f"""
        import numpy as np
        import lmcache_mp
        kv = lmcache_mp.connect("shm:///{name}", chunk_size=16)
        print("writing", flush=True)
        rng = np.random.default_rng(0)
        for i in range(100000):
            tokens = rng.integers(0, 1000, 64).tolist()
            kv.store(np.full((2, 2, 64, 8), i % 97, np.float32), tokens)
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", writer], stdout=subprocess.PIPE, text=True
    )
    try:
        assert _read_line(proc) == "writing"
        time.sleep(1.0)
        proc.kill()
        proc.wait(timeout=60)
        rng = np.random.default_rng(0)
        with connect(f"shm:///{name}", chunk_size=16) as kv:
            try:
                assert kv.stats().chunks > 0
                first = kv.retrieve(rng.integers(0, 1000, 64).tolist())
                assert first is not None and first.shape == (2, 2, 64, 8)
                assert (first == 0).all()
                for i in range(1, 200):
                    kv_i = kv.retrieve(rng.integers(0, 1000, 64).tolist())
                    assert kv_i is None or (kv_i == i % 97).all()
                assert kv.stats().corrupt == 0
            finally:
                kv.destroy()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=60)


def test_a_forked_child_does_not_take_its_parents_paths() -> None:
    """A forked child's tracker is its own: what the parent registered is
    not the child's to remove, and the parent's stays when the child dies."""
    path = private_tempdir("lmcache-mp-test-")
    try:
        pid = os.fork()
        if pid == 0:
            os._exit(0 if not tracker.tracked() else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        time.sleep(0.5)
        assert os.path.isdir(path)
        assert path in tracker.tracked()
    finally:
        remove_tree(path)
    assert path not in tracker.tracked()
