"""How close an edited run's next-token distributions are to the
uncompressed run's, over the same teacher-forced continuation (issue #21)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

__all__ = ["kl_divergence", "top1_agreement"]

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
