"""Property tests: the store behaves as a dict keyed by (salt, token prefix).

Each example makes its own store inside the test body (function-scoped
fixtures are not reset between hypothesis examples) and destroys it. The
reference-model test runs on both backends: a Redis example's prefix
extends the test's own ``redis_url`` prefix, so the leak check covers it.
"""

from __future__ import annotations

import hashlib
import itertools
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmcache_mp.kv import KVStore, connect
from lmcache_mp.kv._chunk import chunk_digest
from lmcache_mp.kv._keys import chunk_keys, token_array
from tests._store_util import bits

DTYPES = [np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)]
SALTS = st.sampled_from(["", "a", "b", "ü"])
# A small vocabulary makes shared prefixes, and so shared chunks, common.
TOKEN_LISTS = st.lists(st.integers(0, 3), max_size=14)
SETTINGS = settings(
    max_examples=100,
    deadline=None,
    # base_url is one per test on purpose: each example extends it.
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


@pytest.fixture
def base_url(store_url: str) -> str | None:
    """None (a temporary shared-memory store per example), or a Redis URL
    whose prefix each example extends."""
    return store_url if store_url.startswith("redis://") else None


@contextmanager
def fresh_store(chunk_size: int, base_url: str | None = None) -> Iterator[KVStore]:
    url = None if base_url is None else f"{base_url}-{secrets.token_hex(4)}"
    ctx = connect(url, chunk_size=chunk_size)
    try:
        yield ctx
    finally:
        ctx.destroy()


class Model:
    """The reference: chunk arrays keyed by (salt, every token up to it)."""

    def __init__(self, chunk_size: int) -> None:
        self.chunk_size = chunk_size
        self.chunks: dict[tuple[str, tuple[int, ...]], np.ndarray] = {}

    def store(self, kv: np.ndarray, tokens: list[int], salt: str) -> bool:
        wrote = False
        for end in range(self.chunk_size, len(tokens) + 1, self.chunk_size):
            key = (salt, tuple(tokens[:end]))
            if key not in self.chunks:
                self.chunks[key] = kv[:, :, end - self.chunk_size : end]
                wrote = True
        return wrote

    def retrieve(self, tokens: list[int], salt: str) -> np.ndarray | None:
        parts = []
        for end in range(self.chunk_size, len(tokens) + 1, self.chunk_size):
            chunk = self.chunks.get((salt, tuple(tokens[:end])))
            if chunk is None:
                break
            parts.append(chunk)
        return np.concatenate(parts, axis=2) if parts else None


OPS = st.lists(
    st.tuples(st.sampled_from(["store", "retrieve"]), TOKEN_LISTS, SALTS),
    min_size=1,
    max_size=12,
)


@SETTINGS
@given(
    chunk_size=st.integers(1, 4),
    layers=st.integers(1, 3),
    width=st.integers(1, 3),
    dtype=st.sampled_from(DTYPES),
    ops=OPS,
    seed=st.integers(0, 2**16),
)
def test_store_matches_the_reference_model(
    base_url: str | None,
    chunk_size: int,
    layers: int,
    width: int,
    dtype: np.dtype[Any],
    ops: list[tuple[str, list[int], str]],
    seed: int,
) -> None:
    """Any sequence of stores and retrieves gives what the dict model gives."""
    rng = np.random.default_rng(seed)
    model = Model(chunk_size)
    with fresh_store(chunk_size, base_url) as ctx:
        for op, tokens, salt in ops:
            if op == "store":
                kv = rng.standard_normal((2, layers, len(tokens), width)).astype(dtype)
                assert ctx.store(kv, tokens, salt) == model.store(kv, tokens, salt)
            else:
                got, want = ctx.retrieve(tokens, salt), model.retrieve(tokens, salt)
                if want is None:
                    assert got is None
                else:
                    assert got is not None and got.dtype == dtype
                    assert np.array_equal(bits(got), bits(want))


@SETTINGS
@given(
    stored=st.lists(TOKEN_LISTS, min_size=1, max_size=5),
    asked=st.lists(TOKEN_LISTS, max_size=5),
    salts=st.lists(SALTS, min_size=2, max_size=2, unique=True),
    chunk_size=st.integers(1, 3),
)
def test_no_salt_sees_another_salts_chunks(
    stored: list[list[int]],
    asked: list[list[int]],
    salts: list[str],
    chunk_size: int,
) -> None:
    """Whatever is stored under salt B, a retrieve under salt A finds nothing."""
    salt_a, salt_b = salts
    with fresh_store(chunk_size) as ctx:
        for tokens in stored:
            kv = np.ones((2, 1, len(tokens), 2), np.float32)
            ctx.store(kv, tokens, cache_salt=salt_b)
        for tokens in stored + asked:
            assert ctx.retrieve(tokens, cache_salt=salt_a) is None


@SETTINGS
@given(
    prefix=TOKEN_LISTS,
    tail_a=TOKEN_LISTS,
    tail_b=TOKEN_LISTS,
    chunk_size=st.integers(1, 4),
    salt=SALTS,
)
def test_chunk_key_depends_on_every_token_up_to_its_end(
    prefix: list[int],
    tail_a: list[int],
    tail_b: list[int],
    chunk_size: int,
    salt: str,
) -> None:
    """Two token lists share chunk i's key exactly when they agree up to its end."""
    a, b = prefix + tail_a, prefix + tail_b
    keys_a = list(chunk_keys(token_array(a), chunk_size, salt))
    keys_b = list(chunk_keys(token_array(b), chunk_size, salt))
    assert len(keys_a) == len(a) // chunk_size
    for i, (key_a, key_b) in enumerate(zip(keys_a, keys_b, strict=False)):
        end = (i + 1) * chunk_size
        assert (key_a == key_b) == (a[:end] == b[:end])


def _reference_digest(key: bytes, fields: bytes, payload: bytes) -> bytes:
    """The format's digest by its definition (format version 3): keyed
    BLAKE2b-128 of the fields and the u64 sums of each 4 KiB block of the
    zero-padded payload."""
    padded = payload + bytes(-len(payload) % 4096)
    words = np.frombuffer(padded, "<u8").reshape(-1, 512)
    sums = words.sum(axis=1, dtype="<u8").tobytes()
    digest = hashlib.blake2b(digest_size=16, key=key, person=b"lmcache-mp/kvchk")
    digest.update(fields + sums)
    return digest.digest()


@SETTINGS
@given(
    blocks=st.integers(1, 6),
    tail=st.sampled_from([0, 8, 1000]),
    cuts=st.lists(st.integers(0, 6 * 4096 + 1000), max_size=5),
    seed=st.integers(0, 2**32 - 1),
)
def test_a_chunks_digest_is_over_its_whole_payload_however_it_is_split(
    blocks: int, tail: int, cuts: list[int], seed: int
) -> None:
    """The digest of a payload given in pieces (pieces summed as they come
    while whole blocks, the rest joined) equals the format's digest of the
    joined payload: chunks written or read piece by piece verify against
    chunks of earlier versions."""
    payload = np.random.default_rng(seed).bytes(blocks * 4096 + tail)
    bounds = sorted({0, len(payload), *(c for c in cuts if c < len(payload))})
    pieces = [memoryview(payload)[a:b] for a, b in itertools.pairwise(bounds)]
    key, fields = b"k" * 32, b"f" * 32
    assert chunk_digest(key, fields, pieces) == _reference_digest(key, fields, payload)
