"""The embedded engine's configuration: model shape, seed, KV dtype."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from lmcache_mp._core.attention import AttentionConfig
from lmcache_mp.engine._fixed import (
    MAX_HEAD_DIM,
    MAX_MATMUL_DEPTH,
    MAX_POSITIONS,
    MLP_EXPANSION,
)
from lmcache_mp.errors import KVConfigError

__all__ = ["KV_DTYPES", "EngineConfig"]

#: The RoPE base the toy model rotates keys and queries with (``_model``'s
#: ``_ROPE_BASE``; tests/test_rope.py checks the stored keys against it).
_ROPE_THETA = 10000.0

#: KV dtypes the engine computes and stores its KV in.
KV_DTYPES = ("float16", "float32")


def _int_field(config: EngineConfig, name: str, least: int) -> None:
    """Raise unless the field is an int >= ``least``; store it as a plain int."""
    value = getattr(config, name)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise KVConfigError(
            f"EngineConfig.{name} is {value!r}, expected an int >= {least}"
        )
    if value < least:
        raise KVConfigError(
            f"EngineConfig.{name} is {value}, expected an int >= {least}"
        )
    # A numpy int would pickle bigger and print differently; same hash.
    object.__setattr__(config, name, int(value))


@dataclass(frozen=True)
class EngineConfig:
    """Shape and identity of the embedded toy transformer.

    The model is decoder-only with plain multi-head attention: the number of
    query heads equals ``kv_heads`` (no grouped-query sharing), each of
    ``head_dim`` channels, so a token's K (and V) in one layer is
    ``D = kv_heads * head_dim`` wide and the KV of ``T`` tokens is laid out
    ``[2, layers, T, D]``. Blocks are pre-norm (RMSNorm), attention uses
    rotary positions, the MLP is ReLU with a hidden width of
    ``4 * d_model``. Weights are drawn from ``np.random.default_rng(seed)``.

    Args:
        layers: Transformer blocks (``L`` of the KV layout).
        kv_heads: Attention heads (query heads == KV heads).
        head_dim: Channels per head; even (rotary positions pair them).
        d_model: Width of the residual stream.
        vocab_size: Tokens in the toy vocabulary.
        seed: Seed of the weights (not of sampling).
        dtype: The KV dtype, ``"float32"`` or ``"float16"``: computed K/V are
            cast to it before they are attended to and stored.
        eos_token_id: The end-of-sequence token id.
        max_position: Longest sequence (prompt + generated) the model takes.

    Raises:
        KVConfigError: If a field has an invalid value, or the shape is too
            large for the model's exact fixed-point arithmetic.
    """

    layers: int = 2
    kv_heads: int = 4
    head_dim: int = 16
    d_model: int = 64
    vocab_size: int = 512
    seed: int = 0
    dtype: str = "float32"
    eos_token_id: int = 0
    max_position: int = 8192

    def __post_init__(self) -> None:
        for name in ("layers", "kv_heads", "head_dim", "d_model", "max_position"):
            _int_field(self, name, 1)
        _int_field(self, "vocab_size", 2)
        _int_field(self, "seed", 0)
        _int_field(self, "eos_token_id", 0)
        if self.eos_token_id >= self.vocab_size:
            raise KVConfigError(
                f"EngineConfig.eos_token_id is {self.eos_token_id}, outside the "
                f"vocabulary [0, {self.vocab_size})"
            )
        self._check_dtype()
        self._check_exact_bounds()

    def _check_dtype(self) -> None:
        """Normalize ``dtype`` to its name; raise if it is not supported."""
        try:
            name = np.dtype(self.dtype).name
        except TypeError as exc:
            raise KVConfigError(
                f"EngineConfig.dtype is {self.dtype!r}, expected one of {KV_DTYPES}"
            ) from exc
        if name not in KV_DTYPES:
            raise KVConfigError(
                f"EngineConfig.dtype is {self.dtype!r}, expected one of {KV_DTYPES}"
            )
        # Normalized so that equal configs hash equal (np.float16 == "float16").
        object.__setattr__(self, "dtype", name)

    def _check_exact_bounds(self) -> None:
        """Raise if a reduction could leave float64's exact-integer range."""
        if self.head_dim % 2:
            raise KVConfigError(
                f"EngineConfig.head_dim is {self.head_dim}, expected an even number "
                "(rotary positions rotate channel pairs)"
            )
        if self.head_dim > MAX_HEAD_DIM:
            raise KVConfigError(
                f"EngineConfig.head_dim is {self.head_dim}, at most {MAX_HEAD_DIM} "
                "keeps attention scores exact"
            )
        depth = max(self.d_model * MLP_EXPANSION, self.width)
        if depth > MAX_MATMUL_DEPTH:
            raise KVConfigError(
                f"EngineConfig: d_model={self.d_model}, kv_heads*head_dim="
                f"{self.width} give a matmul depth of {depth}; at most "
                f"{MAX_MATMUL_DEPTH} keeps the arithmetic exact (d_model <= "
                f"{MAX_MATMUL_DEPTH // MLP_EXPANSION})"
            )
        if self.max_position > MAX_POSITIONS:
            raise KVConfigError(
                f"EngineConfig.max_position is {self.max_position}, at most "
                f"{MAX_POSITIONS} keeps attention sums exact"
            )

    @property
    def attention(self) -> AttentionConfig:
        """The model's attention shape and RoPE, for the edits' ``attention=``.

        One query head per KV head (no grouped-query sharing), keys and
        queries rotated in the rotate-half convention with base 10000, as
        :func:`lmcache_mp.edits.rerotate_keys` expects.
        """
        return AttentionConfig(
            q_heads=self.kv_heads,
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            rope_theta=_ROPE_THETA,
        )

    @property
    def width(self) -> int:
        """``D``: the KV width of one token in one layer."""
        return self.kv_heads * self.head_dim

    @property
    def kv_dtype(self) -> np.dtype[Any]:
        """The KV dtype as a numpy dtype."""
        return np.dtype(self.dtype)
