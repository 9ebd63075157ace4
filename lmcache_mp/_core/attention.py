"""A model's attention shape and rotary embedding, which engines record
and the edits that score with queries or move keys' RoPE read."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["AttentionConfig"]


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(
            f"AttentionConfig.{name} must be an int >= 1, got {value!r} "
            f"({type(value).__name__})"
        )
    if value < 1:
        raise ValueError(f"AttentionConfig.{name} must be an int >= 1, got {value}")


@dataclass(frozen=True)
class AttentionConfig:
    """The attention shape and rotary embedding behind a KV.

    What the edits that score with queries need to group query heads onto
    their KV head (grouped-query attention: query head ``h`` reads KV head
    ``h // (q_heads // kv_heads)``, as upstream's SnapKV notebook groups
    them), and what :func:`rerotate_keys` needs to move keys' RoPE. The KV
    of ``T`` tokens is ``[2, L, T, kv_heads * head_dim]`` and the queries
    ``[1, L, T, q_heads * head_dim]``, heads side by side, keys and queries
    after RoPE in Llama's rotate-half convention (as ``transformers`` and
    vLLM's neox style apply it). For a ``transformers`` Llama-style model::

        AttentionConfig(
            q_heads=cfg.num_attention_heads,
            kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
            inv_freq=tuple(model.model.rotary_emb.inv_freq.tolist()),
        )

    (RoPE over a part of the head, ``partial_rotary_factor < 1``, is not
    expressible.) A rotary ``attention_scaling`` needs no field: a key's
    scale survives the relative rotation :func:`rerotate_keys` applies.

    Args:
        q_heads: Query heads per layer.
        kv_heads: Key/value heads per layer; divides ``q_heads``.
        head_dim: Channels per head; even (RoPE rotates channel pairs
            ``(i, i + head_dim / 2)``).
        rope_theta: RoPE base: the inverse frequencies are
            ``rope_theta ** (-2i / head_dim)`` for ``i < head_dim / 2``.
        inv_freq: The ``head_dim / 2`` inverse frequencies themselves,
            overriding ``rope_theta`` (so that scaled RoPE, e.g.
            Llama 3's, is expressible: pass the model's rotary embedding's
            ``inv_freq``).

    Raises:
        ValueError: If a field is out of range; the message names it.
    """

    q_heads: int
    kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    inv_freq: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        """Check the fields.

        Raises:
            ValueError: If a field is out of range; the message names it.
        """
        for name in ("q_heads", "kv_heads", "head_dim"):
            _check_positive_int(name, getattr(self, name))
            object.__setattr__(self, name, int(getattr(self, name)))
        if self.q_heads % self.kv_heads:
            raise ValueError(
                f"AttentionConfig: kv_heads ({self.kv_heads}) must divide "
                f"q_heads ({self.q_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"AttentionConfig.head_dim must be even (RoPE rotates channel "
                f"pairs), got {self.head_dim}"
            )
        theta = self.rope_theta
        if (
            isinstance(theta, bool)
            or not isinstance(theta, (int, float, np.integer, np.floating))
            or not math.isfinite(theta)
            or theta <= 1
        ):
            raise ValueError(
                f"AttentionConfig.rope_theta must be a finite number > 1, got {theta!r}"
            )
        object.__setattr__(self, "rope_theta", float(theta))
        if self.inv_freq is not None:
            freqs = np.asarray(self.inv_freq, dtype=np.float64).ravel()
            if freqs.size != self.head_dim // 2 or not np.all(np.isfinite(freqs)):
                raise ValueError(
                    f"AttentionConfig.inv_freq must be {self.head_dim // 2} finite "
                    f"numbers (head_dim / 2), got {freqs.size}"
                )
            # A tuple of floats keeps the config hashable whatever was given
            # (a list, a numpy array, a torch tensor's tolist()).
            object.__setattr__(self, "inv_freq", tuple(freqs.tolist()))

    @property
    def group(self) -> int:
        """Query heads sharing one KV head: ``q_heads // kv_heads``."""
        return self.q_heads // self.kv_heads

    def inverse_frequencies(self) -> npt.NDArray[np.float64]:
        """Return the ``head_dim / 2`` RoPE inverse frequencies, float64.

        Returns:
            ``inv_freq`` when given, else
            ``rope_theta ** (-arange(0, head_dim, 2) / head_dim)``.
        """
        if self.inv_freq is not None:
            return np.asarray(self.inv_freq, dtype=np.float64)
        exponents = np.arange(0, self.head_dim, 2, dtype=np.float64) / self.head_dim
        freqs: npt.NDArray[np.float64] = self.rope_theta**-exponents
        return freqs
