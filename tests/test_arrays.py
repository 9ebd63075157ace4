"""Specification of array conversion: numpy is the array type, torch is optional."""

from __future__ import annotations

import sys
import types
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from lmcache_mp._util.arrays import as_numpy


class FakeTensor:
    """Quacks like a torch tensor: detach(), cpu(), numpy(), view(), dtype."""

    def __init__(self, array: np.ndarray, dtype: str) -> None:
        self.array, self.dtype = array, dtype

    def detach(self) -> FakeTensor:
        return self

    def cpu(self) -> FakeTensor:
        return self

    def numpy(self) -> np.ndarray:
        if self.dtype == "torch.bfloat16":
            raise TypeError("Got unsupported ScalarType BFloat16")
        return self.array

    def view(self, dtype: Any) -> FakeTensor:
        return FakeTensor(self.array.view(np.int16), "torch.int16")


def test_numpy_arrays_pass_through_without_a_copy() -> None:
    """A numpy array is returned as is."""
    arr = np.zeros((2, 1, 4, 8), np.float16)
    assert as_numpy(arr) is arr


def test_tensors_are_converted_through_numpy() -> None:
    """A tensor-like (detach/cpu/numpy) becomes its numpy array."""
    arr = np.ones((2, 1, 4, 8), np.float32)
    assert as_numpy(FakeTensor(arr, "torch.float32")) is arr


def test_bfloat16_tensors_keep_their_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch bfloat16 (which numpy() refuses) arrives as ml_dtypes.bfloat16 with the same bits."""
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(int16="int16"))
    values = np.array([1.5, -2.0, 3.25], dtype=ml_dtypes.bfloat16)
    out = as_numpy(FakeTensor(values, "torch.bfloat16"))
    assert out.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(out.astype(np.float32), values.astype(np.float32))


@pytest.mark.parametrize(
    "value", [None, 3.0, "kv", {"a": 1}, [[1], [2, 3]], ["a", "b"]]
)
def test_non_arrays_are_a_type_error(value: Any) -> None:
    """None, scalars, strings and ragged or object data are refused."""
    with pytest.raises(TypeError, match="expected"):
        as_numpy(value)
