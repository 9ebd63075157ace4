"""The toy transformer: per-process weights and one sequence's forward pass."""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from lmcache_mp.engine._config import EngineConfig
from lmcache_mp.engine._fixed import (
    ACT_FRAC,
    ACT_LIMIT,
    F64,
    MLP_EXPANSION,
    attend,
    linear,
    rms_norm,
    snap_weights,
    to_grid,
)
from lmcache_mp.errors import KVConfigError

__all__ = ["KVSequence", "Weights", "weights_for"]

#: Spread of the logits: about one unit of standard deviation per gain unit.
_LOGIT_GAIN = 2.0
_ROPE_BASE = 10000.0


@dataclass(frozen=True)
class _Layer:
    """One block's weights, on the weight grid."""

    qkv: F64
    out: F64
    up: F64
    down: F64


@dataclass(frozen=True)
class Weights:
    """Every weight of one model, plus its rotary tables.

    Args:
        embed: ``[V, d]`` token embeddings (real values).
        layers: The blocks' weights.
        unembed: ``[d, V]`` output projection, on the weight grid.
        cos: ``[max_position, head_dim / 2]`` rotary cosines.
        sin: ``[max_position, head_dim / 2]`` rotary sines.
    """

    embed: F64
    layers: tuple[_Layer, ...]
    unembed: F64
    cos: F64
    sin: F64


_WEIGHTS: dict[tuple[int, ...], Weights] = {}
_WEIGHTS_LOCK = threading.Lock()


def _gaussian(rng: np.random.Generator, shape: tuple[int, int], std: float) -> F64:
    """Weights drawn from N(0, std**2), on the weight grid."""
    return snap_weights(rng.standard_normal(shape) * std)


def _build(config: EngineConfig) -> Weights:
    """Draw a model's weights from its seed."""
    rng = np.random.default_rng(config.seed)
    d, width, hidden = config.d_model, config.width, config.d_model * MLP_EXPANSION
    embed = to_grid(rng.standard_normal((config.vocab_size, d))) * 2.0**-ACT_FRAC
    layers = tuple(
        _Layer(
            qkv=_gaussian(rng, (d, 3 * width), 1 / math.sqrt(d)),
            out=_gaussian(rng, (width, d), 1 / math.sqrt(width)),
            # sqrt(2): ReLU halves the variance it passes on.
            up=_gaussian(rng, (d, hidden), math.sqrt(2 / d)),
            down=_gaussian(rng, (hidden, d), 1 / math.sqrt(hidden)),
        )
        for _ in range(config.layers)
    )
    unembed = _gaussian(rng, (d, config.vocab_size), _LOGIT_GAIN / math.sqrt(d))
    half = config.head_dim // 2
    freqs = _ROPE_BASE ** (-np.arange(half, dtype=np.float64) / half)
    angles = np.arange(config.max_position, dtype=np.float64)[:, None] * freqs
    weights = Weights(embed, layers, unembed, np.cos(angles), np.sin(angles))
    # Shared by every engine and thread of the process: make misuse loud.
    for array in (embed, unembed, weights.cos, weights.sin):
        array.flags.writeable = False
    for layer in layers:
        for array in (layer.qkv, layer.out, layer.up, layer.down):
            array.flags.writeable = False
    return weights


def weights_for(config: EngineConfig) -> Weights:
    """Return the model's weights, built once per process and shared.

    Args:
        config: The model's configuration.

    Returns:
        The (read-only) weights; KV dtype and EOS id do not affect them, so
        configs differing only in those share one copy.
    """
    key = (
        config.layers,
        config.kv_heads,
        config.head_dim,
        config.d_model,
        config.vocab_size,
        config.seed,
        config.max_position,
    )
    with _WEIGHTS_LOCK:
        weights = _WEIGHTS.get(key)
        if weights is None:
            weights = _WEIGHTS[key] = _build(config)
        return weights


class KVSequence:
    """One request's KV cache and forward pass, preallocated to its capacity.

    ``kv`` holds the KV in the stored form (``[2, L, capacity, D]`` in the
    config's dtype); attention always reads that form, through grid copies
    of it, so a KV loaded from the store and a KV computed here are the same
    bits.

    The grid copies are float64, four times a bf16 KV, so they are kept only
    once a second pass needs them (at Llama-3-8B's shape, 2 GiB
    per 4,096-token prefill that decodes nothing more). The first pass over
    an empty sequence grids one layer at a time and keeps none; a pass
    starting later grids the positions before it, then keeps its own.

    Args:
        config: The model's configuration.
        capacity: Most tokens the sequence will hold.
    """

    def __init__(self, config: EngineConfig, capacity: int) -> None:
        self._config = config
        self._weights = weights_for(config)
        self.kv: npt.NDArray[Any] = np.zeros(
            (2, config.layers, capacity, config.width), dtype=config.kv_dtype
        )
        self._grid: F64 | None = None
        #: Positions whose grid copies are in ``_grid``, in every layer.
        self._gridded = 0
        self._scale = 1 / math.sqrt(config.head_dim)
        self.length = 0

    def load(self, cached: npt.NDArray[Any], limit: int) -> int:
        """Adopt a retrieved KV as the KV of the first positions.

        Args:
            cached: A ``[2, L, T, D]`` KV from the context.
            limit: Use at most this many of its tokens.

        Returns:
            How many tokens were adopted: ``min(T, limit)``.

        Raises:
            KVConfigError: If the KV's layers or width are not the model's,
                or it holds non-finite values.
        """
        cfg = self._config
        if (
            cached.ndim != 4
            or cached.shape[0] != 2
            or (cached.shape[1] != cfg.layers or cached.shape[3] != cfg.width)
        ):
            raise KVConfigError(
                f"the context returned a KV of shape {tuple(cached.shape)}, but "
                f"the engine's model needs [2, {cfg.layers}, T, {cfg.width}] "
                f"(layers={cfg.layers}, kv_heads*head_dim={cfg.width})"
            )
        count = min(int(cached.shape[2]), limit)
        part = cached[:, :, :count]
        if not np.isfinite(part).all():
            raise KVConfigError(
                f"the context returned a KV of {count} tokens with NaN or "
                "infinite values"
            )
        self.kv[:, :, :count] = part
        self.length = count
        return count

    def _layer_grid(self, index: int, start: int, end: int) -> F64:
        """Layer ``index``'s ``[2, H, end, hd]`` grid copy of positions
        ``0 .. end-1``.

        Args:
            index: The layer.
            start: Where this pass's new positions begin.
            end: Where they end.

        Returns:
            A view of the kept grid, or for a first pass a fresh copy.
        """
        if self._grid is None:
            return self._gridded_kv(index, 0, end)
        self._grid[:, index, :, start:end] = self._gridded_kv(index, start, end)
        return self._grid[:, index, :, :end]

    def _keep_grid(self, end: int) -> None:
        """Keep the grid copies of positions ``0 .. end-1`` in every layer."""
        if self._grid is None:
            cfg = self._config
            self._grid = np.zeros(
                (2, cfg.layers, cfg.kv_heads, self.kv.shape[2], cfg.head_dim)
            )
        # A layer at a time: gridding all at once would hold a second copy.
        for index in range(self._config.layers):
            self._grid[:, index, :, self._gridded : end] = self._gridded_kv(
                index, self._gridded, end
            )
        self._gridded = end

    def _gridded_kv(self, index: int, start: int, end: int) -> F64:
        """Layer ``index``'s stored K/V of ``start .. end-1``, on the grid."""
        cfg = self._config
        stored = self.kv[:, index, start:end]
        stored = stored.reshape(2, end - start, cfg.kv_heads, cfg.head_dim)
        # Head-major rows, as attention's matmuls read them.
        return to_grid(np.ascontiguousarray(stored.transpose(0, 2, 1, 3)))

    def _rotate(self, x: F64, start: int, end: int) -> F64:
        """Apply rotary positions ``start .. end-1`` to ``[H, M, hd]``."""
        cos = self._weights.cos[start:end]
        sin = self._weights.sin[start:end]
        half = x.shape[-1] // 2
        a, b = x[..., :half], x[..., half:]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)

    def extend(
        self, tokens: Sequence[int], queries: npt.NDArray[Any] | None = None
    ) -> F64:
        """Run the model over ``tokens`` at the next positions.

        Args:
            tokens: Token ids to append (at least one).
            queries: An optional ``[L, >= end, D]`` output buffer: row
                ``p`` of each layer receives position ``p``'s rotated query
                (what attention scores the keys with), clipped to the range
                attention reads and cast to the buffer's dtype, for the
                appended positions only.

        Returns:
            The ``[V]`` logits of the last appended position.
        """
        logits: F64 = self.extend_logits(tokens, queries, last=1)[0]
        return logits

    def extend_logits(
        self,
        tokens: Sequence[int],
        queries: npt.NDArray[Any] | None = None,
        *,
        last: int,
    ) -> F64:
        """Run the model over ``tokens`` at the next positions, as
        :meth:`extend`, keeping the logits of several positions.

        Args:
            tokens: Token ids to append (at least one).
            queries: As :meth:`extend`.
            last: How many of the appended positions' logits to return
                (1 to ``len(tokens)``); each row is the same whatever
                ``last`` is (rows are computed independently).

        Returns:
            ``[last, V]`` logits of the last ``last`` appended positions.
        """
        cfg, w = self._config, self._weights
        start = self.length
        end = start + len(tokens)
        rows = end - start
        if start:
            self._keep_grid(start)
        x = w.embed[np.asarray(tokens, dtype=np.intp)]
        for index, layer in enumerate(w.layers):
            qkv = linear(rms_norm(x), layer.qkv)
            q, k, v = qkv.reshape(rows, 3, cfg.kv_heads, cfg.head_dim).transpose(
                1, 2, 0, 3
            )
            fresh = np.stack([self._rotate(k, start, end), v])
            # The stored form (clipped, cast to the KV dtype) is what every
            # later step attends to, cached or not.
            self.kv[:, index, start:end] = (
                np.clip(fresh, -ACT_LIMIT, ACT_LIMIT)
                .transpose(0, 2, 1, 3)
                .reshape(2, rows, cfg.width)
            )
            grid = self._layer_grid(index, start, end)
            rotated = self._rotate(q, start, end)
            if queries is not None:
                # Laid out as a KV row ([M, D], heads side by side), and
                # clipped as to_grid clips it, so a stored query is the one
                # attention used.
                queries[index, start:end] = (
                    np.clip(rotated, -ACT_LIMIT, ACT_LIMIT)
                    .transpose(1, 0, 2)
                    .reshape(rows, cfg.width)
                )
            mixed = attend(rotated, grid[0], grid[1], start, self._scale)
            x = x + linear(mixed.transpose(1, 0, 2).reshape(rows, cfg.width), layer.out)
            hidden = np.maximum(linear(rms_norm(x), layer.up), 0.0)
            x = x + linear(hidden, layer.down)
        self.length = end
        if self._grid is not None:
            self._gridded = end
        logits: F64 = linear(rms_norm(x[-last:]), w.unembed)
        return logits

    def prefix(self, count: int) -> npt.NDArray[Any]:
        """Return a contiguous copy of the KV of the first ``count`` tokens.

        Args:
            count: Tokens wanted (at most ``length``).

        Returns:
            ``[2, L, count, D]`` in the config's dtype.
        """
        return np.ascontiguousarray(self.kv[:, :, :count])
