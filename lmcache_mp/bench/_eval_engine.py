"""The engines ``lmcache-mp eval`` scores edits on: a trained model through
``transformers``, or the toy model (issue #21)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from lmcache_mp.bench._config import TOY
from lmcache_mp.edits import AttentionConfig
from lmcache_mp.engine import EmbeddedEngine, HFEngine
from lmcache_mp.executors import Preload
from lmcache_mp.kv import KVContext

__all__ = ["TOY", "EvalEngine", "open_engine"]



@dataclass(frozen=True)
class EvalEngine:
    """An engine the eval drives, and what it needs of it.

    Args:
        engine: The ``post_completion``; has ``score(prompt, continuation,
            cache_salt)`` (:meth:`HFEngine.score`).
        encode: Text to prompt token ids.
        decode: Token ids to text.
        attention: The model's heads and RoPE, for the edits.
        preload: What each worker process calls as it starts.
    """

    engine: Any
    encode: Callable[[str], list[int]]
    decode: Callable[[Sequence[int]], str]
    attention: AttentionConfig
    preload: tuple[Preload, ...]


def open_engine(name: str, ctx: KVContext, query_ctx: KVContext | None) -> EvalEngine:
    """Build the engine named by ``--engine`` over the eval's contexts.

    Args:
        name: ``"toy"`` for :class:`EmbeddedEngine` (its default model);
            otherwise what :meth:`HFEngine.from_pretrained` takes
            (``"smollm2-135m"``, a model directory or a GGUF file).
        ctx: The KV context.
        query_ctx: The QUERY context the edits scored with queries need.

    Returns:
        The engine, a trained model loaded in this process. Prompts are
        encoded as plain text, without a chat template: the passkey probe
        is a completion (SmolLM2-135M-Instruct answers it in the plain form
        at haystack lengths where its chat form already fails).

    Raises:
        ModelLoadError: If the model cannot be found or loaded.
        ImportError: Without the ``model`` extra, for a trained model.
    """
    if name == TOY:
        toy = EmbeddedEngine(ctx, query_ctx=query_ctx)
        return EvalEngine(
            toy,
            toy.tokenize,
            toy.detokenize,
            toy.config.attention,
            ("lmcache_mp.engine", "lmcache_mp.edits"),
        )
    hf = HFEngine.from_pretrained(name, ctx, query_ctx=query_ctx)

    def encode(text: str) -> list[int]:
        return hf.encode(text, chat=False)

    return EvalEngine(hf, encode, hf.decode, hf.attention, (hf.load,))
