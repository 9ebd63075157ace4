"""``lmcache-mp eval --compare kvpress``: NVIDIA kvpress's presses on the
same model, prompts and budgets as lmcache_mp's edits.

kvpress (PyPI ``kvpress``) compresses inside the attention forward: a press
is a context manager that hooks every attention layer during the context's
prefill and keeps, per KV head, its own subset of the context's tokens;
the question and the answer then run after the compressed cache at the
positions they would have had uncompressed. This module runs each prompt
as kvpress's ``KVPressTextGenerationPipeline._forward`` does (the press
around ``model.model``'s prefill of the context, then the rest of the
prompt at its original positions and a greedy answer, or the teacher-forced
continuation the document eval scores), with the prompt's
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

import numpy as np
import numpy.typing as npt

from lmcache_mp._util.extras import import_extra
from lmcache_mp.eval._generate import end_speed, last_round

__all__ = [
    "PRESSES",
    "KvpressGeneration",
    "KvpressRun",
    "KvpressScores",
    "context_length",
    "counterpart",
    "decoding_press",
    "kvpress_answers",
    "kvpress_generation",
    "kvpress_scores",
    "make_press",
]

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


@dataclass(frozen=True)
class KvpressScores:
    """One press (or none) over the documents, scored teacher-forced.

    Args:
        logprobs: For each prompt, ``[len(continuation), V]`` float32
            log-probabilities of its continuation (as ``engine.score``
            gives them).
        kept: As :attr:`KvpressRun.kept`.
        prefill_s: As :attr:`KvpressRun.prefill_s`.
    """

    logprobs: list[npt.NDArray[np.float32]]
    kept: float
    prefill_s: float


@dataclass(frozen=True)
class KvpressGeneration:
    """One decoding press (or none) over the documents, compressing while
    generating.

    Args:
        logprobs: For each prompt, ``[generate, V]`` float32
            log-probabilities of the reference generation, teacher-forced
            one token per forward (as a decoding press sees tokens).
        outputs: Each prompt's free-running greedy generation.
        wall_s: Wall time of the free-running generations.
        end_tokens_per_s: Mean over prompts of ``1 /`` the mean time of a
            decoding step over the last round (against the largest cache).
        kv_tokens: Mean tokens in the cache after the last step.
    """

    logprobs: list[npt.NDArray[np.float32]]
    outputs: list[list[int]]
    wall_s: float
    end_tokens_per_s: float
    kv_tokens: float


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


def counterpart(edit: str | None, keep: float | None) -> tuple[Any, str]:
    """kvpress's counterpart of ``edit`` at ``keep``, and its rows' label.

    Args:
        edit: An lmcache_mp edit name, a key of :data:`PRESSES`; ``None``
            for kvpress's uncompressed model.
        keep: Fraction of the context's tokens kept; ``None`` with ``edit``.

    Returns:
        ``(press, label)``: the press (``None`` uncompressed) and
        ``"kvpress <Press>"`` (``"kvpress"`` uncompressed).

    Raises:
        KeyError: If kvpress has no counterpart of ``edit``.
        ImportError: Without ``kvpress`` (the ``compare`` extra).
    """
    if edit is None or keep is None:
        return None, "kvpress"
    return make_press(edit, keep), f"kvpress {PRESSES[edit]}"


def decoding_press(edit: str, budget: int, every: int) -> tuple[Any, str]:
    """kvpress's counterpart of ``edit`` compressing while generating, and
    its rows' label: a ``DecodingPress`` around the edit's press that, every
    ``every`` decoding steps, compresses the whole cache to ``budget``
    tokens, as ``batch.decode(compress=edit, every=every)`` does with an
    edit of that ``budget``.

    Args:
        edit: An lmcache_mp edit name, a key of :data:`PRESSES`.
        budget: Tokens kept at each compression (``target_size``).
        every: Decoding steps between compressions (``compression_interval``).

    Returns:
        ``(press, "kvpress DecodingPress(<Press>)")``.

    Raises:
        KeyError: If kvpress has no counterpart of ``edit``.
        ImportError: Without ``kvpress`` (the ``compare`` extra).
    """
    kvpress = import_extra("kvpress", "compare")
    # keep 1: the base press's own ratio stays 0, and DecodingPress sets the
    # ratio that meets target_size at each compression.
    press = kvpress.DecodingPress(
        base_press=make_press(edit, 1.0),
        compression_interval=every,
        target_size=budget,
    )
    return press, f"kvpress DecodingPress({PRESSES[edit]})"


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
    questions: Sequence[Sequence[int]],
    press: Any,
    answer_tokens: int,
    chunk_size: int,
) -> KvpressRun:
    """Answer each prompt greedily with its context compressed by ``press``.

    Args:
        engine: The eval's :class:`~lmcache_mp.engine.HFEngine`.
        prompts: The prompts' token ids, as the streams are prefilled.
        questions: Tokens sent after each prompt, uncompressed (the
            question a stream is sent after its modify; empty where the
            prompt holds it).
        press: A kvpress press, or ``None`` for the uncompressed model.
        answer_tokens: Tokens decoded as each answer (EOS ignored, as the
            eval's own greedy answers do).
        chunk_size: The store's tokens per chunk (sizes the context).

    Returns:
        The run.

    Raises:
        ImportError: Without ``transformers`` (the ``model`` extra).
    """
    answers, kept, prefill_s, answer_s = [], [], 0.0, 0.0
    with _pressing(engine, press):
        for prompt, question in zip(prompts, questions, strict=True):
            cache, context, seconds = _prefill(engine, prompt, press, chunk_size)
            answered = time.perf_counter()
            prefill_s += seconds
            kept.append(_kept(cache, len(prompt), context))
            # The rest of the prompt and the question, then the answer, at
            # the positions they have uncompressed (kvpress's
            # generate_answer).
            position, tokens = context, [*prompt[context:], *question]
            answer: list[int] = []
            for _ in range(answer_tokens):
                out = engine.forward(tokens, position, cache, 1)
                position += len(tokens)
                tokens = [int(out.logits[0, -1].argmax())]
                answer.append(tokens[0])
            answers.append(engine.decode(answer))
            answer_s += time.perf_counter() - answered
    return KvpressRun(answers, sum(kept) / len(kept), prefill_s, answer_s)


def kvpress_scores(
    engine: Any,
    prompts: Sequence[Sequence[int]],
    continuations: Sequence[Sequence[int]],
    press: Any,
    chunk_size: int,
) -> KvpressScores:
    """Teacher-force each continuation after its prompt, the prompt's
    context compressed by ``press``: what ``engine.score`` gives after an
    edited cache, for kvpress.

    Args:
        engine: The eval's :class:`~lmcache_mp.engine.HFEngine`.
        prompts: The prompts' token ids.
        continuations: Each prompt's continuation to score (at least one
            token each).
        press: A kvpress press, or ``None`` for the uncompressed model.
        chunk_size: The store's tokens per chunk (sizes the context).

    Returns:
        The scores.

    Raises:
        ImportError: Without ``transformers`` (the ``model`` extra).
    """
    logprobs, kept, prefill_s = [], [], 0.0
    with _pressing(engine, press):
        for prompt, continuation in zip(prompts, continuations, strict=True):
            cache, context, seconds = _prefill(engine, prompt, press, chunk_size)
            prefill_s += seconds
            kept.append(_kept(cache, len(prompt), context))
            # The rest of the prompt and the continuation but its last token
            # in one forward pass, at their uncompressed positions: row i is
            # the distribution continuation[i] was drawn from.
            tokens = [*prompt[context:], *continuation[:-1]]
            out = engine.forward(tokens, context, cache, len(continuation))
            logprobs.append(out.logits[0].float().log_softmax(dim=-1).numpy())
    return KvpressScores(logprobs, sum(kept) / len(kept), prefill_s)


def kvpress_generation(
    engine: Any,
    prompts: Sequence[Sequence[int]],
    references: Sequence[Sequence[int]],
    press: Any,
    every: int,
) -> KvpressGeneration:
    """Generate after each prompt with ``press`` (a decoding press) around
    the whole generation: teacher-forced along each reference generation,
    then free-running, as the eval's ``--generate`` scores an edit.

    The prompt is prefilled whole (a decoding press leaves the prefill
    alone), then one token per forward at its uncompressed position; the
    press compresses at the end of every ``every``-th such forward, so the
    token after a compression is predicted before it, where a stream's
    round is scored after its modify.

    Args:
        engine: The eval's :class:`~lmcache_mp.engine.HFEngine`.
        prompts: The prompts' token ids.
        references: Each prompt's uncompressed greedy generation (all of the
            same length, at least one token).
        press: A decoding press, or ``None`` for the uncompressed model.
        every: Tokens of the last round, for ``end_tokens_per_s``.

    Returns:
        The run.

    Raises:
        ImportError: Without ``transformers`` (the ``model`` extra).
    """
    logprobs, outputs, ends, kv, wall = [], [], [], [], 0.0
    steps = len(references[0])
    last = last_round(steps, every)
    with _pressing(engine, press):
        for prompt, reference in zip(prompts, references, strict=True):
            rows, _, _ = _decode(engine, prompt, press, steps, reference)
            logprobs.append(rows.log_softmax(dim=-1).numpy())
            begin = time.perf_counter()
            rows, gaps, cache = _decode(engine, prompt, press, steps, None)
            wall += time.perf_counter() - begin
            outputs.append([int(t) for t in rows.argmax(dim=-1)])
            ends.append(end_speed(gaps, last))
            kv.append(float(cache.get_seq_length()))
    return KvpressGeneration(
        logprobs, outputs, wall, float(np.mean(ends)), float(np.mean(kv))
    )


def _decode(
    engine: Any,
    prompt: Sequence[int],
    press: Any,
    steps: int,
    forced: Sequence[int] | None,
) -> tuple[Any, list[float], Any]:
    """Prefill ``prompt``, then decode ``steps`` tokens one forward each,
    ``press`` around it all: the ``[steps, V]`` float32 logits, each
    step's wall time after the prefill, and the cache. The tokens fed are
    ``forced``'s, or the greedy ones where it is ``None``."""
    import torch
    from transformers import DynamicCache

    cache = DynamicCache(config=engine.model.config)
    rows, gaps = [], []
    with contextlib.nullcontext() if press is None else press(engine.model):
        rows.append(engine.forward(prompt, 0, cache, 1).logits[0, -1].float())
        for step in range(steps - 1):
            token = int(rows[-1].argmax()) if forced is None else forced[step]
            begin = time.perf_counter()
            out = engine.forward([token], len(prompt) + step, cache, 1)
            gaps.append(time.perf_counter() - begin)
            rows.append(out.logits[0, -1].float())
    return torch.stack(rows), gaps, cache


def _prefill(
    engine: Any, prompt: Sequence[int], press: Any, chunk_size: int
) -> tuple[Any, int, float]:
    """The prompt's context prefilled with ``press`` inside: the cache, the
    context's length, and the prefill's wall time in seconds."""
    from transformers import DynamicCache

    context = context_length(len(prompt), chunk_size)
    cache = DynamicCache(config=engine.model.config)
    begin = time.perf_counter()
    with contextlib.nullcontext() if press is None else press(engine.model):
        engine.forward(prompt[:context], 0, cache, 1)
    return cache, context, time.perf_counter() - begin


def _kept(cache: Any, prompt_tokens: int, context: int) -> float:
    """The fraction of the prompt a stream would send after the press: the
    cache's tokens and the rest of the prompt."""
    return float(cache.get_seq_length() + prompt_tokens - context) / prompt_tokens


@contextlib.contextmanager
def _pressing(engine: Any, press: Any) -> Iterator[None]:
    """Run without autograd, in the attention the press needs."""
    import torch

    with (
        torch.inference_mode(),
        # A decoding press needs what the press it wraps needs.
        _attention(
            engine.model,
            type(getattr(press, "base_press", press)).__name__ in _EAGER,
        ),
    ):
        yield


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
