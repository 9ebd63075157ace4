"""The engines ``lmcache-mp eval`` scores edits on: a trained model through
``transformers``, the toy model, or either served over HTTP."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from lmcache_mp._harness.options import TOY
from lmcache_mp.edits import AttentionConfig
from lmcache_mp.engine import EmbeddedEngine, HFEngine
from lmcache_mp.engine.http.openai import post_completion, served_models
from lmcache_mp.errors import CacheKindError, KVConfigError, LMCacheStreamError
from lmcache_mp.executors import Preload
from lmcache_mp.kv import KVContext, KVStore

__all__ = ["TOY", "EvalEngine", "open_engine", "served_engine"]


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
        vocab_size: The model's vocabulary size.
    """

    engine: Any
    encode: Callable[[str], list[int]]
    decode: Callable[[Sequence[int]], str]
    attention: AttentionConfig
    preload: tuple[Preload, ...]
    vocab_size: int


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
            toy.config.vocab_size,
        )
    hf = HFEngine.from_pretrained(name, ctx, query_ctx=query_ctx)

    def encode(text: str) -> list[int]:
        return hf.encode(text, chat=False)

    vocab = int(hf.model.config.vocab_size)
    return EvalEngine(hf, encode, hf.decode, hf.attention, (hf.load,), vocab)


def served_engine(
    local: EvalEngine, url: str, store: KVStore, queries: Sequence[str]
) -> EvalEngine:
    """The same model served at ``url``: prefill, decode and scoring go there.

    Args:
        local: The model loaded here (tokenizer, attention, vocabulary).
        url: The server's base URL.
        store: The store the eval opened, which the server must share.
        queries: The edits that read the prompt's queries, which the
            server's prefill must record.

    Returns:
        ``local`` with its engine the OpenAI client of the server's one
        model (scoring with ``prompt_logprobs``, 20 tokens per position).

    Raises:
        LMCacheStreamError: If the server cannot be reached, or serves
            other than one model.
        KVConfigError: If the server reports a vocabulary size, store or
            chunk size other than the eval's.
        CacheKindError: If ``queries`` names edits and the server does not
            say it records queries (``lmcache-mp serve --record-queries``).
    """
    cards = served_models(url)
    if len(cards) != 1:
        raise LMCacheStreamError(
            f"{url} serves {len(cards)} models ({[c.get('id') for c in cards]}); "
            "the eval scores one"
        )
    card = cards[0]
    mine = {
        "vocab_size": local.vocab_size,
        "chunk_size": store.chunk_size,
        "kv_store": store.url,
    }
    for key, value in mine.items():
        # Where the server says (lmcache-mp serve does): a mismatch would
        # only show later, as misses and timeouts.
        if card.get(key, value) != value:
            raise KVConfigError(
                f"{url} serves {card.get('id')!r} with {key} {card[key]!r}, "
                f"but the eval has {value!r}: start it with the same --store, "
                "--chunk-size and model"
            )
    if queries and card.get("records_queries") is not True:
        # The QUERY kind is filled by the engine's prefill, which runs on the
        # server: without it the modify would wait for queries in vain.
        raise CacheKindError(
            f"{', '.join(queries)} read the prompt's queries, which the server at "
            f"{url} does not record: start it with lmcache-mp serve "
            "--record-queries, or choose edits that read the KV only"
        )
    client = post_completion(url, str(card["id"]), vocab_size=local.vocab_size)
    return dataclasses.replace(
        local, engine=client, preload=("lmcache_mp.engine", "lmcache_mp.edits")
    )
