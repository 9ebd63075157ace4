"""An attention implementation that records the queries a prefill attends with.

``transformers`` hands an attention function the query after the model's own
positional encoding (RoPE for Llama), the tensor upstream LMCache's vLLM
patch exports as the QUERY kind. Registering a function that
notes it and then runs PyTorch's SDPA, exactly as ``"sdpa"`` does, records
it for any architecture without re-implementing RoPE, and leaves the
numbers of every forward unchanged.

Recording is per thread: a worker runs its shard's streams on threads over
one model, and only the thread inside :func:`recording` keeps its queries.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["ATTENTION", "recording", "register"]

#: The name the attention function is registered under.
ATTENTION = "lmcache_mp_sdpa"

_local = threading.local()
_registered = False
_register_lock = threading.Lock()


def _attention(
    module: Any,
    query: Any,
    key: Any,
    value: Any,
    attention_mask: Any,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Any, Any]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    sink: list[Any] | None = getattr(_local, "queries", None)
    if sink is not None:
        # [batch, q_heads, new tokens, head_dim], after RoPE.
        sink[module.layer_idx] = query.detach()
    # dropout by position too: kvpress wraps every registered attention
    # function in one that passes it so (its attention_patch).
    out: tuple[Any, Any] = sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, **kwargs
    )
    return out


def register() -> None:
    """Register :data:`ATTENTION` with ``transformers`` (once per process).

    Its masks are SDPA's, so a model loaded with it computes what a model
    loaded with ``attn_implementation="sdpa"`` computes.
    """
    global _registered
    with _register_lock:
        if _registered:
            return
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        AttentionInterface.register(ATTENTION, _attention)
        AttentionMaskInterface.register(ATTENTION, sdpa_mask)
        _registered = True


@contextlib.contextmanager
def recording(layers: int) -> Iterator[list[Any]]:
    """Record, on this thread, each layer's query of the forwards run inside.

    Args:
        layers: The model's layer count.

    Yields:
        A list with one slot per layer, filled by each forward with that
        layer's ``[batch, q_heads, tokens, head_dim]`` query (the last
        forward's, where several run).
    """
    sink: list[Any] = [None] * layers
    _local.queries = sink
    try:
        yield sink
    finally:
        _local.queries = None
