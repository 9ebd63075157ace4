"""How close an edited run's next-token distributions are to the
uncompressed run's, over the same teacher-forced continuation.

The uncompressed run's greedy continuation of each prompt is the reference;
after an edit, the engine scores that continuation after the edited cache
(``engine.score``: one forward pass, vLLM's ``prompt_logprobs``), and each
position counts as agreeing when its most likely token is the reference's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = [
    "Reference",
    "agreement",
    "agreement_of",
    "greedy_reference",
    "kl_divergence",
    "top1_agreement",
]

_F32 = npt.NDArray[np.float32]


def top1_agreement(logprobs: _F32, reference: Sequence[int]) -> npt.NDArray[np.bool_]:
    """Whether each row's most likely token is the reference's token.

    Args:
        logprobs: ``[N, V]`` log-probabilities (``engine.score``).
        reference: The ``N`` tokens of the reference continuation.

    Returns:
        ``[N]`` booleans.
    """
    hits: npt.NDArray[np.bool_] = logprobs.argmax(axis=1) == np.asarray(reference)
    return hits


def kl_divergence(reference: _F32, edited: _F32) -> npt.NDArray[np.float64]:
    """``KL(p_ref || p_edit)`` of each row, in nats (as llama.cpp's
    ``perplexity --kl-divergence`` reports it).

    Args:
        reference: ``[N, V]`` log-probabilities of the uncompressed run.
        edited: ``[N, V]`` log-probabilities after the edit.

    Returns:
        ``[N]`` divergences, each >= 0 (up to rounding).
    """
    ref = reference.astype(np.float64)
    kl: npt.NDArray[np.float64] = (np.exp(ref) * (ref - edited)).sum(axis=1)
    return kl


@dataclass(frozen=True)
class Reference:
    """The uncompressed run's continuation of each prompt.

    Args:
        tokens: Each prompt's greedy continuation.
        logprobs: Its ``[len(tokens), V]`` log-probabilities, teacher-forced.
    """

    tokens: list[list[int]]
    logprobs: list[_F32]


def greedy_reference(
    engine: Any, prompts: Sequence[Sequence[int]], tokens: int, salt: str = ""
) -> Reference:
    """Decode each prompt greedily over the cache as it is, in this process.

    Args:
        engine: A ``post_completion`` with ``score`` (``HFEngine``,
            ``EmbeddedEngine``).
        prompts: The prompts, their KV cached unedited.
        tokens: Tokens of each continuation (EOS ignored).
        salt: The prompts' cache salt.

    Returns:
        The continuations and their log-probabilities.
    """
    params = {"max_tokens": tokens, "temperature": 0.0, "ignore_eos": True}
    continuations = [
        [event.token_id for event in engine(list(p), params, salt)] for p in prompts
    ]
    return Reference(
        continuations,
        [engine.score(p, c, salt) for p, c in zip(prompts, continuations, strict=True)],
    )


def agreement(
    engine: Any,
    contexts: Sequence[Sequence[int]],
    reference: Reference,
    salt: str = "",
) -> dict[str, float]:
    """Score the reference continuations after the edited caches.

    Args:
        engine: The engine of :func:`greedy_reference`.
        contexts: What each stream sends next after the edit (its tokens,
            then its pending suffix), in the reference's order.
        reference: The uncompressed run's continuations.
        salt: The streams' cache salt.

    Returns:
        ``top1`` (the fraction of positions whose most likely token is the
        reference's), ``kl`` (mean ``KL(p_ref || p_edit)``, nats), and
        ``positions`` scored.
    """
    return agreement_of(
        reference,
        [
            engine.score(list(context), tokens, salt)
            for context, tokens in zip(contexts, reference.tokens, strict=True)
        ],
    )


def agreement_of(reference: Reference, logprobs: Sequence[_F32]) -> dict[str, float]:
    """Score log-probabilities of the reference continuations, however
    they were computed (:func:`agreement`'s result).

    Args:
        reference: The uncompressed run's continuations.
        logprobs: Each continuation's ``[N, V]`` log-probabilities, in the
            reference's order.

    Returns:
        As :func:`agreement`.
    """
    hits, kls = [], []
    for tokens, ref, edited in zip(
        reference.tokens, reference.logprobs, logprobs, strict=True
    ):
        hits.append(top1_agreement(edited, tokens))
        kls.append(kl_divergence(ref, edited))
    return {
        "top1": float(np.concatenate(hits).mean()),
        "kl": float(np.concatenate(kls).mean()),
        "positions": float(sum(len(t) for t in reference.tokens)),
    }
