"""AttentionConfig and rerotate_keys: moving keys' RoPE."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_mp.edits import AttentionConfig, rerotate_keys

CONFIG = AttentionConfig(q_heads=6, kv_heads=2, head_dim=8, rope_theta=100.0)
LAYERS, TOKENS = 3, 10


def direct_rope(raw: np.ndarray, positions: np.ndarray, config: AttentionConfig) -> Any:
    """Rotate raw ``[T, kv_heads * head_dim]`` keys as transformers' Llama does,
    in float64: cos/sin of ``concat(p * inv_freq, p * inv_freq)``,
    ``k * cos + rotate_half(k) * sin``."""
    dim = config.head_dim
    inv = 1.0 / config.rope_theta ** (np.arange(0, dim, 2) / dim)
    if config.inv_freq is not None:
        inv = np.asarray(config.inv_freq)
    freqs = positions[:, None].astype(np.float64) * inv[None, :]
    emb = np.concatenate([freqs, freqs], axis=-1)[:, None, :]
    k = raw.astype(np.float64).reshape(len(positions), config.kv_heads, dim)
    rotate_half = np.concatenate([-k[..., dim // 2 :], k[..., : dim // 2]], axis=-1)
    out = k * np.cos(emb) + rotate_half * np.sin(emb)
    return out.reshape(raw.shape)


def rotated_kv(
    positions: np.ndarray, config: AttentionConfig = CONFIG, seed: int = 0
) -> np.ndarray:
    """A random KV whose keys are rotated for ``positions``."""
    rng = np.random.default_rng(seed)
    width = config.kv_heads * config.head_dim
    raw = rng.standard_normal((2, LAYERS, len(positions), width))
    kv: np.ndarray = raw.copy()
    for layer in range(LAYERS):
        kv[0, layer] = direct_rope(raw[0, layer], positions, config)
    return kv


def test_rerotated_keys_equal_keys_rotated_at_the_new_positions() -> None:
    """Keys rotated at t, moved to t', equal the raw keys rotated at t'."""
    old = np.arange(TOKENS) * 7 + 3
    new = np.arange(TOKENS)
    kv = rotated_kv(old)
    expected = rotated_kv(new)
    moved = rerotate_keys(kv.astype(np.float32), old, new, CONFIG)
    assert moved.dtype == np.float32
    np.testing.assert_allclose(moved[0], expected[0], rtol=0, atol=1e-5)


def test_values_are_untouched() -> None:
    """rerotate_keys copies V unchanged and leaves its input as it was."""
    kv = rotated_kv(np.arange(TOKENS) + 5)
    kv = kv.astype(np.float32)
    before = kv.copy()
    moved = rerotate_keys(kv, np.arange(TOKENS) + 5, np.arange(TOKENS), CONFIG)
    np.testing.assert_array_equal(moved[1], kv[1])
    np.testing.assert_array_equal(kv, before)


def test_equal_positions_are_the_identity() -> None:
    """Moving keys to the positions they are at returns them unchanged."""
    kv = rotated_kv(np.arange(TOKENS))
    kv = kv.astype(np.float32)
    pos = np.arange(TOKENS) * 3
    np.testing.assert_array_equal(rerotate_keys(kv, pos, pos, CONFIG), kv)


@settings(max_examples=30, deadline=None)
@given(
    st.lists(st.integers(0, 4000), min_size=3, max_size=3),
    st.integers(0, 2**31 - 1),
)
def test_moves_compose(hops: list[int], seed: int) -> None:
    """Moving a -> b -> c equals moving a -> c (in float64, to rounding)."""
    a, b, c = (np.full(TOKENS, h) + np.arange(TOKENS) for h in hops)
    kv = rotated_kv(a, seed=seed % 1000)
    two = rerotate_keys(rerotate_keys(kv, a, b, CONFIG), b, c, CONFIG)
    one = rerotate_keys(kv, a, c, CONFIG)
    np.testing.assert_allclose(two, one, rtol=0, atol=1e-4)


@pytest.mark.parametrize(
    ("dtype", "atol"),
    [(np.float16, 1e-2), (ml_dtypes.bfloat16, 6e-2)],
    ids=["float16", "bfloat16"],
)
def test_low_precision_is_rounded_once(dtype: Any, atol: float) -> None:
    """A float16/bfloat16 KV comes back in its dtype, within one rounding of
    the exact move."""
    old, new = np.arange(TOKENS) + 100, np.arange(TOKENS)
    kv = rotated_kv(old)
    low = kv.astype(dtype)
    moved = rerotate_keys(low, old, new, CONFIG)
    assert moved.dtype == np.dtype(dtype)
    exact = rerotate_keys(low.astype(np.float64), old, new, CONFIG)
    np.testing.assert_allclose(moved.astype(np.float64), exact, rtol=atol, atol=atol)
    assert np.array_equal(
        moved.astype(np.float64), exact.astype(dtype).astype(np.float64)
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_in_torch_out(dtype: torch.dtype) -> None:
    """A torch KV comes back as a torch tensor of its dtype, equal to the
    numpy result."""
    old, new = np.arange(TOKENS) + 9, np.arange(TOKENS)
    kv = rotated_kv(old)
    tensor = torch.from_numpy(kv.astype(np.float32)).to(dtype)
    moved = rerotate_keys(tensor, torch.from_numpy(old), new, CONFIG)
    assert isinstance(moved, torch.Tensor)
    assert moved.dtype == dtype
    numpy_kv = tensor.float().numpy()
    if dtype == torch.bfloat16:
        numpy_kv = numpy_kv.astype(ml_dtypes.bfloat16)
    expected = rerotate_keys(numpy_kv, old, new, CONFIG)
    np.testing.assert_array_equal(moved.float().numpy(), expected.astype(np.float32))


def test_inv_freq_overrides_theta() -> None:
    """A config with inv_freq (scaled RoPE) rotates by those frequencies."""
    inv = (1.0, 0.3, 0.02, 0.001)
    config = AttentionConfig(q_heads=2, kv_heads=2, head_dim=8, inv_freq=inv)
    np.testing.assert_array_equal(config.inverse_frequencies(), np.asarray(inv))
    old, new = np.arange(TOKENS) * 5, np.arange(TOKENS)
    kv = rotated_kv(old, config)
    expected = rotated_kv(new, config)
    moved = rerotate_keys(kv, old, new, config)
    np.testing.assert_allclose(moved[0], expected[0], rtol=0, atol=1e-5)


def test_default_frequencies_are_llamas() -> None:
    """Without inv_freq the frequencies are theta ** (-2i / head_dim)."""
    config = AttentionConfig(q_heads=9, kv_heads=3, head_dim=64, rope_theta=1e5)
    expected = 1.0 / 1e5 ** (np.arange(0, 64, 2) / 64)
    np.testing.assert_allclose(config.inverse_frequencies(), expected, rtol=1e-15)
    assert config.group == 3


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"q_heads": 6, "kv_heads": 4, "head_dim": 8}, "divide"),
        ({"q_heads": 4, "kv_heads": 4, "head_dim": 7}, "head_dim"),
        ({"q_heads": 0, "kv_heads": 1, "head_dim": 8}, "q_heads"),
        ({"q_heads": 4, "kv_heads": 4, "head_dim": 8, "rope_theta": 0.5}, "rope_theta"),
        ({"q_heads": 4, "kv_heads": 4, "head_dim": 8, "inv_freq": (1.0,)}, "inv_freq"),
    ],
)
def test_bad_config_names_the_field(fields: dict[str, Any], named: str) -> None:
    """An out-of-range AttentionConfig field raises ValueError naming it."""
    with pytest.raises(ValueError, match=named):
        AttentionConfig(**fields)


def test_config_is_hashable_with_a_list_of_frequencies() -> None:
    """inv_freq given as a list is stored as a tuple: the config hashes."""
    config = AttentionConfig(2, 1, 4, inv_freq=[1.0, 0.5])  # type: ignore[arg-type]
    assert hash(config) == hash(AttentionConfig(2, 1, 4, inv_freq=(1.0, 0.5)))


@pytest.mark.parametrize(
    ("kv_shape", "positions", "named"),
    [
        ((2, 1, 4, 12), 4, "width"),
        ((2, 1, 4, 16), 3, "old_positions"),
        ((1, 4, 16), 4, "shape"),
    ],
)
def test_bad_input_is_named(
    kv_shape: tuple[int, ...], positions: int, named: str
) -> None:
    """A KV of the wrong width or shape, or positions of the wrong length,
    raise ValueError saying which."""
    kv = np.zeros(kv_shape, dtype=np.float32)
    with pytest.raises(ValueError, match=named):
        rerotate_keys(kv, np.arange(positions), np.arange(4), CONFIG)


def test_the_toy_engines_attention_config_moves_its_keys() -> None:
    """EngineConfig.attention describes the toy model's RoPE: its layer-0 key
    of a token at position p, moved to p + 3, is its key computed at p + 3."""
    from lmcache_mp.engine import EngineConfig
    from lmcache_mp.engine._model import KVSequence

    config = EngineConfig()
    prompt = [5, 17, 99, 3, 42, 7]
    plain, shifted = KVSequence(config, 16), KVSequence(config, 16)
    plain.extend(prompt)
    shifted.extend([11, 12, 13, *prompt])
    layer0 = plain.prefix(len(prompt))[:, :1]
    moved = rerotate_keys(
        layer0, np.arange(len(prompt)), np.arange(len(prompt)) + 3, config.attention
    )
    expected = shifted.prefix(len(prompt) + 3)[:, :1, 3:]
    np.testing.assert_allclose(moved[0], expected[0], rtol=0, atol=1e-4)
