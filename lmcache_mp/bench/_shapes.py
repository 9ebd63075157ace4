"""Real models' KV shapes, for ``lmcache-mp bench --shape NAME``.

The toy engine's default KV is a few MiB per stream; a real model keeps
far more (Llama-3-8B: 128 KiB per token, 512 MiB for a
4,096-token prompt). A preset sets the layers, KV heads, head size and
dtype of one model, as its Hugging Face ``config.json`` gives them
(``num_hidden_layers``, ``num_key_value_heads``, ``head_dim`` or
``hidden_size / num_attention_heads``, ``torch_dtype``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

__all__ = ["SHAPES", "Shape"]


@dataclass(frozen=True)
class Shape:
    """The KV shape of one model.

    Args:
        layers: Transformer blocks (``L`` of the KV layout).
        kv_heads: Key/value heads (grouped-query attention shares them).
        head_dim: Channels per head.
        dtype: The KV dtype the model serves in.
    """

    layers: int
    kv_heads: int
    head_dim: int
    dtype: str

    @property
    def bytes_per_token(self) -> int:
        """KV bytes of one token: K and V, every layer and head."""
        itemsize = 4 if self.dtype == "float32" else 2
        return 2 * self.layers * self.kv_heads * self.head_dim * itemsize


#: The presets, by the name ``--shape`` takes.
SHAPES: Mapping[str, Shape] = MappingProxyType(
    {
        # meta-llama/Meta-Llama-3-8B: 32 layers, 8 KV heads x 128, bf16
        # (128 KiB per token).
        "llama3-8b": Shape(layers=32, kv_heads=8, head_dim=128, dtype="bfloat16"),
        # Qwen/Qwen3-8B: 36 layers, 8 KV heads x 128, bf16 (144 KiB per token).
        "qwen3-8b": Shape(layers=36, kv_heads=8, head_dim=128, dtype="bfloat16"),
        # HuggingFaceTB/SmolLM2-135M: 30 layers, 3 KV heads x 64 (576 wide,
        # 9 heads), bf16 (22.5 KiB per token).
        "smollm2-135m": Shape(layers=30, kv_heads=3, head_dim=64, dtype="bfloat16"),
    }
)
