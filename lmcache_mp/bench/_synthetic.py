"""The engine of the real-shape benchmarks: a real model's KV, no model.

The embedded engine is an exact toy transformer: its arithmetic caps the
model width (``d_model`` at most 256, float16/float32 KV) and its causal
attention, run in float64, takes minutes per stream for a 4,096-token
prompt at Llama-3-8B's shape (it grows with the square of the prompt).
What ``--shape`` measures is the modify phase —
moving and editing a real model's KV — so its prefill and decode run this
stand-in instead: the KV of a token is a row of a small seeded table,
picked by the token id (a gather, at memory speed), and each reply's tokens
are drawn from a sum of the cached KV's bits, so that executors whose edits
wrote different KV decode different tokens (the bench's agreement check).

It loads and offloads the KV a chunk at a time (the store's ``start=``),
as a real engine moves it between GPU and store, so that a request holds
one chunk of host memory, not its whole KV: with every stream of a batch in
flight, the whole KV would be gigabytes per worker at Llama-3-8B's shape.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from lmcache_mp.hints import releases_gil
from lmcache_mp.kv import KVStore, resolve_dtype
from lmcache_mp.stream import TokenEvent

__all__ = ["SYNTHETIC_VOCAB", "SyntheticEngine"]

#: Token ids the engine takes and yields; 0 is EOS and never yielded.
SYNTHETIC_VOCAB = 512
#: Rows of the KV table: tokens whose ids agree modulo this share a KV row,
#: as repeated tokens' keys resemble each other in a real model.
_TABLE_ROWS = 64


# Its work is numpy gathers and sums and the store's copies, which release
# the GIL (the project's hints); auto runs its phases on threads.
@releases_gil
class SyntheticEngine:
    """A ``post_completion`` with a real model's KV layout and no model.

    Each call retrieves the prompt's longest cached prefix, makes the KV of
    the rest from the table, stores the prompt's full chunks (as LMCache
    offloads after prefill), a chunk at a time, and yields ``max_tokens``
    tokens, the first carrying ``cached_tokens``. Token ``i`` of a reply is
    ``1 + (s + 7 i) mod (vocab - 1)`` with ``s`` the sum of the prompt's KV
    bits and ids.

    Args:
        ctx: The store to retrieve from and store to.
        layers: ``L`` of the KV layout.
        width: ``D``: KV heads x head size.
        dtype: The KV dtype (``"bfloat16"`` needs ml_dtypes).
        seed: Seed of the table.

    Raises:
        KVConfigError: If ``dtype`` is not a KV dtype.
    """

    def __init__(
        self, ctx: KVStore, layers: int, width: int, dtype: str, seed: int = 0
    ) -> None:
        self._ctx = ctx
        self._args = (layers, width, dtype, seed)
        dt = resolve_dtype(dtype)
        rng = np.random.default_rng(seed)
        table = rng.standard_normal((2, layers, _TABLE_ROWS, width), np.float32)
        self._table: npt.NDArray[Any] = table.astype(dt)

    def __reduce__(self) -> tuple[Any, ...]:
        # The table is rebuilt from the seed: a worker gets a few bytes.
        return (type(self), (self._ctx, *self._args))

    def __call__(
        self,
        prompt_token_ids: Sequence[int],
        sampling_params: Mapping[str, Any],
        cache_salt: str = "",
    ) -> Iterator[TokenEvent]:
        """Reply to the prompt; see the class docstring.

        Args:
            prompt_token_ids: The prompt's token ids.
            sampling_params: ``max_tokens`` (default 16); the rest is
                ignored (the reply is deterministic).
            cache_salt: Isolation salt passed to the context.

        Returns:
            An iterator of :class:`TokenEvent`.
        """
        prompt = [int(t) for t in prompt_token_ids]
        return self._generate(
            prompt, int(sampling_params.get("max_tokens", 16)), cache_salt
        )

    def _generate(
        self, prompt: list[int], max_tokens: int, salt: str
    ) -> Iterator[TokenEvent]:
        size = self._ctx.chunk_size
        toks = np.asarray(prompt, dtype=np.int64)
        total = sum(prompt)
        reused = 0
        while reused + size <= len(toks):
            part = self._ctx.retrieve(toks[: reused + size], salt, start=reused)
            if part is None:
                break
            total += _bit_sum(part)
            reused += size
        for begin in range(reused, len(toks), size):
            end = min(begin + size, len(toks))
            ids = toks[begin:end] % _TABLE_ROWS
            fresh = np.take(self._table, ids, axis=2)
            total += _bit_sum(fresh)
            if end - begin == size:
                self._ctx.store(fresh, toks[:end], salt, start=begin)
        for i in range(max_tokens):
            token = 1 + (total + 7 * i) % (SYNTHETIC_VOCAB - 1)
            yield TokenEvent(token, f"<{token}>", reused if i == 0 else None)


def _bit_sum(kv: npt.NDArray[Any]) -> int:
    """The sum of the KV's elements read as unsigned ints: exact, any order."""
    flat = np.ascontiguousarray(kv).reshape(-1)
    return int(flat.view(f"u{flat.dtype.itemsize}").sum(dtype=np.uint64))
