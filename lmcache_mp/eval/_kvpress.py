"""``lmcache-mp eval --tasks ... --compare kvpress``: NVIDIA kvpress's presses
on the same model, prompts and budgets as lmcache_mp's edits.

kvpress (PyPI ``kvpress``) compresses inside the attention forward: a press
is a context manager that hooks every attention layer during the context's
prefill and keeps, per KV head, its own subset of the context's tokens;
the question and the answer then run after the compressed cache at the
positions they would have had uncompressed. This module runs each prompt
as kvpress's ``KVPressTextGenerationPipeline._forward`` does (the press
around ``model.model``'s prefill of the context, then the rest of the
prompt at its original positions and a greedy answer), with the prompt's
token ids as lmcache_mp's streams see them: the context is the stream's
chunk-aligned cached prefix, the part an lmcache_mp edit compresses, and
the rest of the prompt is what a stream keeps as its suffix.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from lmcache_mp._util.extras import import_extra

__all__ = ["PRESSES", "KvpressRun", "context_length", "kvpress_answers", "make_press"]

#: The lmcache_mp edit each kvpress press is set beside (kvpress has no
#: recent-window press apart from StreamingLLM, and no R-KV).
PRESSES = {
    "random": "RandomPress",
    "streamingllm": "StreamingLLMPress",
    "knorm": "KnormPress",
    "keydiff": "KeyDiffPress",
    "tova": "TOVAPress",
    "snapkv": "SnapKVPress",
    "h2o": "ObservedAttentionPress",
    "expected_attention": "ExpectedAttentionPress",
}
#: Presses scored from the attention weights themselves, which only the
#: eager attention returns (kvpress's ObservedAttentionPress asserts it).
_EAGER = frozenset({"ObservedAttentionPress"})


@dataclass(frozen=True)
class KvpressRun:
    """One press (or none) over a cell's prompts.

    Args:
        answers: Each prompt's greedy answer, decoded.
        kept: Mean fraction of each prompt's tokens left in the cache
            after the context's prefill (the rest of the prompt counted as
            kept, as a stream's suffix is).
        prefill_s: Wall time of the contexts' prefills, the press's
            compression inside them.
        answer_s: Wall time of the rest: each prompt's tail and answer.
    """

    answers: list[str]
    kept: float
    prefill_s: float
    answer_s: float


def make_press(edit: str, keep: float, seed: int = 0) -> Any:
    """kvpress's counterpart of ``edit``, keeping ``keep`` of the context.

    Args:
        edit: An lmcache_mp edit name, a key of :data:`PRESSES`.
        keep: Fraction of the context's tokens kept (kvpress's
            ``compression_ratio`` is ``1 - keep``).
        seed: RandomPress's seed.

    Returns:
        The press.

    Raises:
        KeyError: If kvpress has no counterpart of ``edit``.
        ImportError: Without ``kvpress`` (the ``compare`` extra).
    """
    kvpress = import_extra("kvpress", "compare")
    cls = getattr(kvpress, PRESSES[edit])
    if edit == "random":
        return cls(compression_ratio=1.0 - keep, seed=seed)
    return cls(compression_ratio=1.0 - keep)


def context_length(prompt_tokens: int, chunk_size: int) -> int:
    """The tokens of a prompt that an lmcache_mp edit is given: its
    chunk-aligned cached prefix, short of the last token (which an engine
    always computes, its logits starting the answer).

    Args:
        prompt_tokens: The prompt's length.
        chunk_size: The store's tokens per chunk.

    Returns:
        The context's length, at least 1 where the prompt has 2 tokens.
    """
    aligned = prompt_tokens // chunk_size * chunk_size
    return max(1, min(aligned, prompt_tokens - 1))


def kvpress_answers(
    engine: Any,
    prompts: Sequence[Sequence[int]],
    press: Any,
    answer_tokens: int,
    chunk_size: int,
) -> KvpressRun:
    """Answer each prompt greedily with its context compressed by ``press``.

    Args:
        engine: The eval's :class:`~lmcache_mp.engine.HFEngine`.
        prompts: The prompts' token ids.
        press: A kvpress press, or ``None`` for the uncompressed model.
        answer_tokens: Tokens decoded as each answer (EOS ignored, as the
            eval's own greedy answers do).
        chunk_size: The store's tokens per chunk (sizes the context).

    Returns:
        The run.

    Raises:
        ImportError: Without ``transformers`` (the ``model`` extra).
    """
    import torch
    from transformers import DynamicCache

    answers, kept, prefill_s, answer_s = [], [], 0.0, 0.0
    model = engine.model
    with torch.inference_mode(), _attention(model, type(press).__name__ in _EAGER):
        for prompt in prompts:
            context = context_length(len(prompt), chunk_size)
            cache = DynamicCache(config=model.config)
            begin = time.perf_counter()
            with contextlib.nullcontext() if press is None else press(model):
                engine.forward(prompt[:context], 0, cache, 1)
            answered = time.perf_counter()
            prefill_s += answered - begin
            kept.append((cache.get_seq_length() + len(prompt) - context) / len(prompt))
            # The rest of the prompt, then the answer, at the positions they
            # have in the uncompressed prompt (kvpress's generate_answer).
            position, tokens = context, list(prompt[context:])
            answer: list[int] = []
            for _ in range(answer_tokens):
                out = engine.forward(tokens, position, cache, 1)
                position += len(tokens)
                tokens = [int(out.logits[0, -1].argmax())]
                answer.append(tokens[0])
            answers.append(engine.decode(answer))
            answer_s += time.perf_counter() - answered
    return KvpressRun(answers, sum(kept) / len(kept), prefill_s, answer_s)


@contextlib.contextmanager
def _attention(model: Any, eager: bool) -> Iterator[None]:
    """Run the model with the eager attention inside, where ``eager``."""
    if not eager:
        yield
        return
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        yield
    finally:
        model.set_attn_implementation(previous)
