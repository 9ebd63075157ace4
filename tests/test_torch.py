"""Specification of torch modify fns: ``array="torch"``.

torch is the optional ``torch`` extra; ``.ci/run`` and the README's test
command install its CPU wheel, so these tests always run there. torch is
imported inside the tests, not at collection, so that the rest of the suite
runs without it loaded (it slowed every other test's process start).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import lmcache_mp.batch as lmc_batch
import lmcache_mp.stream as lmc_stream
from lmcache_mp._util.arrays import as_type
from lmcache_mp.errors import LMCacheBatchedStreamError
from lmcache_mp.kv import SharedMemoryKVStore, connect

C = 4
PROMPTS = [list(range(i, i + 8)) for i in range(1, 4)]


def _no_engine(*args: Any) -> Any:
    raise AssertionError("these tests run no engine")


def halve_in_torch(kv: Any, tokens: list[int]) -> tuple[Any, list[int], str]:
    """A torch-only edit: keep every other token from the second, doubled."""
    import torch

    assert isinstance(kv, torch.Tensor)
    return kv[:, :, 1::2] * 2, tokens[1::2], str(kv.dtype)


def numpy_twin(kv: np.ndarray, tokens: list[int]) -> tuple[np.ndarray, list[int]]:
    """The same edit in numpy, for the expected result."""
    return kv[:, :, 1::2] * 2, tokens[1::2]


def negate_same_tokens(kv: Any, tokens: list[int]) -> tuple[Any, list[int]]:
    """A same-token torch edit (it overwrites the cached chunks)."""
    return -kv, tokens


def returns_numpy(kv: Any, tokens: list[int]) -> tuple[Any, list[int]]:
    """A torch-handed fn may give numpy back."""
    return kv.numpy()[:, :, ::2], tokens[::2]


def _kv(seed: int, dtype: Any) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((2, 2, 8, 4)).astype(dtype)


@pytest.fixture(params=[np.float32, ml_dtypes.bfloat16], ids=["float32", "bfloat16"])
def dtype(request: pytest.FixtureRequest) -> Any:
    """The KV dtypes a torch fn must see exactly."""
    return request.param


@pytest.fixture
def filled(dtype: Any) -> Iterator[SharedMemoryKVStore]:
    """A store holding each prompt's KV in ``dtype``."""
    store = connect(chunk_size=C)
    for seed, prompt in enumerate(PROMPTS):
        store.store(_kv(seed, dtype), prompt)
    yield store
    store.destroy()


def _batch(
    store: SharedMemoryKVStore, executor: str, **opts: Any
) -> lmc_batch.LMCacheBatchedStream:
    batch = lmc_batch.LMCacheBatchedStream(executor, **opts)
    for prompt in PROMPTS:
        batch.add(lmc_stream.create_request(store, _no_engine, prompt))
    return batch


def test_as_type_shares_memory_with_the_numpy_buffer(dtype: Any) -> None:
    """The tensor a fn gets is a view: its bits are the numpy KV's bits, and
    writing it writes the numpy KV."""
    import torch

    arr = _kv(0, dtype)
    tensor = as_type(arr, "torch")
    assert tensor.dtype == (torch.float32 if dtype is np.float32 else torch.bfloat16)
    bits = np.int32 if dtype is np.float32 else np.int16
    twin = torch.int32 if dtype is np.float32 else torch.int16
    np.testing.assert_array_equal(tensor.view(twin).numpy(), arr.view(bits))
    tensor[0, 0, 0, 0] = 7.0
    assert float(arr[0, 0, 0, 0]) == 7.0


@pytest.mark.parametrize(
    "opts",
    [
        {"executor": "thread"},
        {"executor": "process", "mp_context": "forkserver", "preload": ["torch"]},
        {"executor": "process", "mp_context": "spawn"},
    ],
    ids=["thread", "process-forkserver", "process-spawn"],
)
def test_torch_fn_runs_unchanged_and_lands_exactly(
    filled: SharedMemoryKVStore, dtype: Any, opts: dict[str, Any]
) -> None:
    """A torch fn gets torch tensors of the KV's dtype; what it returns is
    stored exactly as the same edit in numpy would be."""
    opts = dict(opts)
    executor = opts.pop("executor")
    with _batch(filled, executor, array="torch", max_workers=2, **opts) as batch:
        batch.modify(halve_in_torch)
        infos = {m.info for m in batch.modify_metrics.values()}
        assert infos == {"torch.float32" if dtype is np.float32 else "torch.bfloat16"}
        for seed, (sid, stream) in enumerate(batch.streams.items()):
            expected, tokens = numpy_twin(_kv(seed, dtype), PROMPTS[seed])
            assert stream.tokens == tokens, sid
            got = filled.retrieve(tokens)
            assert got is not None
            np.testing.assert_array_equal(got.view(np.uint8), expected.view(np.uint8))


def test_same_token_torch_edit_overwrites_bit_exactly(
    filled: SharedMemoryKVStore, dtype: Any
) -> None:
    """A torch edit that keeps the tokens replaces the cached chunks with its
    exact bits (staged and committed, as numpy edits are)."""
    with _batch(filled, "process", array="torch", max_workers=2) as batch:
        batch.modify(negate_same_tokens)
    for seed, prompt in enumerate(PROMPTS):
        got = filled.retrieve(prompt)
        assert got is not None
        np.testing.assert_array_equal(
            got.view(np.uint8), (-_kv(seed, dtype)).view(np.uint8)
        )


def test_per_phase_array_overrides_the_batch() -> None:
    """modify(array="torch") on a numpy batch hands torch for that phase only;
    a torch-handed fn may return numpy."""
    store = connect(chunk_size=C)
    for seed, prompt in enumerate(PROMPTS):
        store.store(_kv(seed, np.float32), prompt)
    with store, _batch(store, "thread") as batch:
        batch.modify(returns_numpy, array="torch")
        assert [s.tokens for s in batch.streams.values()] == [p[::2] for p in PROMPTS]
        with pytest.raises(LMCacheBatchedStreamError, match="AssertionError"):
            batch.modify(halve_in_torch)  # numpy again: the fn's assert fails


def test_unknown_array_type_is_refused_before_anything_runs() -> None:
    """array= must be numpy or torch; the error lists both."""
    with pytest.raises(ValueError, match="numpy, torch"):
        lmc_batch.LMCacheBatchedStream("thread", array="jax")


def test_torch_without_torch_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    """Asking for torch where it is not installed says which extra to add."""
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(ImportError, match=r"lmcache-mp\[torch\]"):
        lmc_batch.LMCacheBatchedStream("thread", array="torch")
