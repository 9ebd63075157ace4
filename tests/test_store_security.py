"""The store's defences: private files, refused directories, no unpickling.

The checksum in every chunk protects against corruption, truncation and
torn or misplaced files. It is not a secret: someone able to write the
store directory could forge a valid chunk. What keeps other users out is
the directory itself (0700, owned by the user, never a symlink); what keeps
a forged chunk harmless is that chunks are raw numbers, never unpickled.
Tests taking ``any_ctx`` run on both backends (chunk files, Redis values).
"""

from __future__ import annotations

import os
import pickle
import shutil
import stat
import struct
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lmcache_mp.errors import CorruptChunkWarning, KVStoreError, KVStoreSecurityError
from lmcache_mp.kv import KVStore, SharedMemoryKVStore, _connect
from lmcache_mp.kv._chunk import FORMAT_VERSION, HEADER_SIZE, chunk_digest
from lmcache_mp.kv._keys import chunk_keys, token_array
from tests._store_util import RawChunks, StoreFactory, kv_of, unique_url

C = 4
TOKENS = list(range(7, 7 + 2 * C))


@pytest.fixture
def ctx(stores: StoreFactory) -> SharedMemoryKVStore:
    return stores.named(chunk_size=C)


@pytest.fixture
def any_ctx(store_url: str, stores: StoreFactory) -> KVStore:
    """A named store with 4-token chunks, of each backend."""
    store: KVStore = stores.connect(store_url, chunk_size=C)
    return store


def _mode(path: str) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def _shm_path(url: str) -> str:
    return _connect._shm_dir(url.removeprefix("shm:///"))


class _CreatesFile:
    """Unpickling this creates ``path``: the proof that a pickle ran."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, ...]:
        return (open, (self.path, "w"))


def test_directory_is_0700_and_files_are_0600(ctx: SharedMemoryKVStore) -> None:
    """The store directory is private, and so are its chunk and layout files."""
    ctx.store(kv_of(TOKENS), TOKENS)
    assert _mode(ctx.path) == 0o700
    files = [os.path.join(ctx.path, n) for n in os.listdir(ctx.path)]
    assert len(files) == 3  # two chunks and layout.json
    assert all(_mode(f) == 0o600 for f in files)
    assert all(os.lstat(f).st_uid == os.geteuid() for f in [ctx.path, *files])


@pytest.mark.parametrize("mode", [0o755, 0o750, 0o701, 0o770])
def test_directory_open_to_others_is_refused(stores: StoreFactory, mode: int) -> None:
    """An existing store directory that group or others can enter is refused."""
    url = unique_url()
    path = _shm_path(url)
    os.mkdir(path, 0o700)
    try:
        os.chmod(path, mode)
        with pytest.raises(KVStoreSecurityError, match=f"mode {mode:04o}"):
            stores.connect(url)
    finally:
        os.rmdir(path)


def test_symlinked_directory_is_refused(stores: StoreFactory, tmp_path: Path) -> None:
    """A store path that is a symlink is refused, even to a private dir."""
    target = tmp_path / "real"
    target.mkdir(mode=0o700)
    url = unique_url()
    path = _shm_path(url)
    os.symlink(target, path)
    try:
        with pytest.raises(KVStoreSecurityError, match="symlink"):
            stores.connect(url)
        assert list(target.iterdir()) == []
    finally:
        os.unlink(path)


def test_directory_owned_by_another_user_is_refused(
    stores: StoreFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store directory whose owner is not the current user is refused."""
    ctx = stores.named()
    ctx.close()
    me = os.geteuid()
    monkeypatch.setattr(os, "geteuid", lambda: me + 1)
    with pytest.raises(KVStoreSecurityError, match=f"owned by uid {me}"):
        _connect.connect(ctx.url)


def test_unpickled_copy_rechecks_the_directory(ctx: SharedMemoryKVStore) -> None:
    """A copy reconnecting to a directory opened up since is refused."""
    copy = pickle.loads(pickle.dumps(ctx))
    os.chmod(ctx.path, 0o755)
    try:
        with pytest.raises(KVStoreSecurityError):
            copy.retrieve(TOKENS)
    finally:
        os.chmod(ctx.path, 0o700)


def test_destroy_never_follows_a_symlink(
    ctx: SharedMemoryKVStore, tmp_path: Path
) -> None:
    """destroy() of a store path swapped for a symlink leaves the target alone."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("precious")
    moved = ctx.path + "-moved"
    os.rename(ctx.path, moved)
    os.symlink(victim, ctx.path)
    try:
        with pytest.raises(KVStoreSecurityError, match="symlink"):
            ctx.destroy()
        assert (victim / "keep.txt").read_text() == "precious"
    finally:
        os.unlink(ctx.path)
        shutil.rmtree(moved)


def _chunk_path(ctx: SharedMemoryKVStore, index: int) -> str:
    keys = list(chunk_keys(token_array(TOKENS), C, ""))
    return os.path.join(ctx.path, keys[index].hex() + ".kv")


def test_symlinked_chunk_is_never_followed(
    ctx: SharedMemoryKVStore, tmp_path: Path
) -> None:
    """A symlink planted at a chunk's name is a corrupt miss; its target is kept."""
    ctx.store(kv_of(TOKENS), TOKENS)
    first = _chunk_path(ctx, 0)
    outside = tmp_path / "chunk"
    shutil.copyfile(first, outside)
    os.unlink(first)
    os.symlink(outside, first)
    with pytest.warns(CorruptChunkWarning, match="symlink"):
        assert ctx.retrieve(TOKENS) is None
    assert outside.exists() and not os.path.lexists(first)


def test_a_fifo_at_a_chunks_name_never_blocks_a_retrieve(
    ctx: SharedMemoryKVStore,
) -> None:
    """A FIFO planted at a chunk's name (no writer: opening it for reading
    would block forever) is a corrupt miss, read past at once."""
    ctx.store(kv_of(TOKENS), TOKENS)
    second = _chunk_path(ctx, 1)
    os.unlink(second)
    os.mkfifo(second, 0o600)
    got: list[Any] = []
    with pytest.warns(CorruptChunkWarning, match="expected"):
        # A daemon thread: were the open to block, the test fails, not hangs.
        reader = threading.Thread(
            target=lambda: got.append(ctx.retrieve(TOKENS)), daemon=True
        )
        reader.start()
        reader.join(timeout=30)
    assert not reader.is_alive(), "retrieve blocked on the FIFO"
    assert got[0] is not None and got[0].shape[2] == C


def test_chunk_with_crafted_payload_is_rejected(any_ctx: KVStore) -> None:
    """A valid header over a different payload fails the checksum."""
    any_ctx.store(kv_of(TOKENS), TOKENS)
    raw = RawChunks(any_ctx, TOKENS)
    header = (raw.get(0) or b"")[:HEADER_SIZE]
    raw.put(0, header + np.full(2 * 2 * C * 4, 42.0, np.float32).tobytes())
    with pytest.warns(CorruptChunkWarning, match="checksum"):
        assert any_ctx.retrieve(TOKENS) is None
    assert raw.get(0) is None


def test_chunk_renamed_to_another_key_is_rejected(any_ctx: KVStore) -> None:
    """A valid chunk moved to another key's name fails (the key is hashed in)."""
    any_ctx.store(kv_of(TOKENS), TOKENS)
    raw = RawChunks(any_ctx, TOKENS)
    raw.put(0, raw.get(1) or b"")
    with pytest.warns(CorruptChunkWarning, match="checksum"):
        assert any_ctx.retrieve(TOKENS) is None
    assert raw.get(0) is None


def _forge(key: bytes, payload: bytes) -> bytes:
    """A chunk with a correct header and digest around ``payload``."""
    fields = struct.pack(
        "<8sHHIIIQ", b"LMCMPKV\0", FORMAT_VERSION, 1, 2, C, 4, len(payload)
    )
    return fields + chunk_digest(key, fields, [memoryview(payload)]) + payload


def test_pickle_in_a_chunk_is_never_unpickled(any_ctx: KVStore, tmp_path: Path) -> None:
    """A forged chunk holding a malicious pickle comes back as raw numbers."""
    any_ctx.store(kv_of(TOKENS), TOKENS)
    marker = tmp_path / "pwned"
    evil = pickle.dumps(_CreatesFile(str(marker)))
    payload = evil.ljust(2 * 2 * C * 4 * 4, b"\0")
    raw = RawChunks(any_ctx, TOKENS)
    raw.put(0, _forge(raw.keys[0], payload))
    got = any_ctx.retrieve(TOKENS[:C])
    assert got is not None and got.dtype == np.float32
    assert got.tobytes() == payload
    assert not marker.exists()


def test_pickle_as_a_whole_chunk_is_never_unpickled(
    any_ctx: KVStore, tmp_path: Path
) -> None:
    """A chunk (file or value) that is just a pickle is a corrupt miss and never runs."""
    any_ctx.store(kv_of(TOKENS), TOKENS)
    marker = tmp_path / "pwned"
    raw = RawChunks(any_ctx, TOKENS)
    raw.put(0, pickle.dumps(_CreatesFile(str(marker))))
    with pytest.warns(CorruptChunkWarning):
        assert any_ctx.retrieve(TOKENS) is None
    assert not marker.exists()
    assert raw.get(0) is None


def test_pickled_layout_is_an_error_and_never_runs(
    any_ctx: KVStore, tmp_path: Path
) -> None:
    """A layout document replaced by a pickle is a KVStoreError; nothing runs."""
    marker = tmp_path / "pwned"
    RawChunks(any_ctx, TOKENS).put_layout(pickle.dumps(_CreatesFile(str(marker))))
    with pytest.raises(KVStoreError, match="not a valid store layout"):
        any_ctx.retrieve(TOKENS)
    assert not marker.exists()
    assert any_ctx.stats().chunks == 0
