"""Sampling parameters (validated like vLLM's) and the token sampler."""

from __future__ import annotations

import math
from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from lmcache_mp.errors import SamplingParamsError

__all__ = ["Sampler", "SamplingParams"]


def _is_int(value: Any) -> bool:
    """Whether ``value`` is an int (numpy ints too), bool excluded."""
    return not isinstance(value, (bool, np.bool_)) and isinstance(
        value, (int, np.integer)
    )


def _is_number(value: Any) -> bool:
    """Whether ``value`` is a finite real number, bool excluded."""
    return _is_int(value) or (
        isinstance(value, (float, np.floating)) and math.isfinite(float(value))
    )


def _bad(key: str, value: Any, expected: str) -> SamplingParamsError:
    """The error for one invalid parameter."""
    return SamplingParamsError(
        f"sampling param {key!r} is {value!r}, expected {expected}"
    )


@dataclass(frozen=True)
class SamplingParams:
    """The sampling parameters the embedded engine understands.

    Args:
        max_tokens: Most tokens to generate.
        temperature: ``0`` for greedy decoding (argmax, ties to the lowest
            id); otherwise the softmax temperature.
        top_p: Sample only from the smallest set of most likely tokens whose
            probability reaches ``top_p``.
        seed: Seed of the sampling RNG; ``None`` draws fresh entropy (as
            vLLM does), so only a seeded or greedy call is reproducible.
        ignore_eos: Keep generating past the EOS token.
        stop_token_ids: Token ids that end generation (not yielded).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: frozenset[int] = frozenset()

    @classmethod
    def from_mapping(cls, params: Mapping[str, Any]) -> SamplingParams:
        """Validate a request's sampling params; unknown keys are ignored.

        A key whose value is ``None`` counts as absent (OpenAI clients send
        ``null`` for unset fields).

        Args:
            params: E.g. ``{"max_tokens": 8, "temperature": 0}``.

        Returns:
            The validated parameters.

        Raises:
            SamplingParamsError: Naming the first key with an invalid value.
        """
        if not isinstance(params, Mapping):
            raise SamplingParamsError(
                f"sampling params are {type(params).__name__}, expected a mapping"
            )
        given = {k: v for k, v in params.items() if v is not None}
        max_tokens = given.get("max_tokens", cls.max_tokens)
        if not _is_int(max_tokens) or max_tokens < 1:
            raise _bad("max_tokens", max_tokens, "an int >= 1")
        temperature = given.get("temperature", cls.temperature)
        if not _is_number(temperature) or temperature < 0:
            raise _bad("temperature", temperature, "a finite number >= 0")
        top_p = given.get("top_p", cls.top_p)
        if not _is_number(top_p) or not 0 < top_p <= 1:
            raise _bad("top_p", top_p, "a number in (0, 1]")
        seed = given.get("seed")
        if seed is not None and not _is_int(seed):
            raise _bad("seed", seed, "an int")
        ignore_eos = given.get("ignore_eos", cls.ignore_eos)
        if not isinstance(ignore_eos, (bool, np.bool_)):
            raise _bad("ignore_eos", ignore_eos, "a bool")
        stops = given.get("stop_token_ids", ())
        if not isinstance(stops, (list, tuple)) or not all(_is_int(t) for t in stops):
            raise _bad("stop_token_ids", stops, "a list of ints")
        return cls(
            max_tokens=int(max_tokens),
            temperature=float(temperature),
            top_p=float(top_p),
            seed=None if seed is None else int(seed),
            ignore_eos=bool(ignore_eos),
            stop_token_ids=frozenset(int(t) for t in stops),
        )

    def stops_at(self, token_id: int, eos_token_id: int | AbstractSet[int]) -> bool:
        """Whether generating ``token_id`` ends the request (unyielded).

        Args:
            token_id: The sampled token.
            eos_token_id: The model's EOS id, or its set of them (a trained
                model's generation config may name several).

        Returns:
            True for EOS (unless ``ignore_eos``) and for a stop token id.
        """
        eos = {eos_token_id} if isinstance(eos_token_id, int) else eos_token_id
        if token_id in eos and not self.ignore_eos:
            return True
        return token_id in self.stop_token_ids


class Sampler:
    """Turns logits into tokens for one request.

    Args:
        params: The request's sampling parameters.
    """

    def __init__(self, params: SamplingParams) -> None:
        self._params = params
        seed = params.seed
        # default_rng rejects negative seeds; any int is a valid vLLM seed.
        self._rng = np.random.default_rng(None if seed is None else seed % 2**64)

    def sample(self, logits: npt.NDArray[np.float64]) -> int:
        """Pick the next token.

        Args:
            logits: ``[V]`` float64 logits.

        Returns:
            The token id.
        """
        p = self._params
        if p.temperature == 0:
            # argmax returns the first maximum: ties go to the lowest id.
            return int(np.argmax(logits))
        weights = np.exp((logits - logits.max()) / p.temperature)
        probs = weights / weights.sum()
        # Most likely first; a stable sort keeps ties in id order.
        order = np.argsort(-probs, kind="stable")
        ranked = probs[order]
        cumulative = np.cumsum(ranked)
        keep = len(ranked)
        if p.top_p < 1:
            keep = int(np.searchsorted(cumulative, p.top_p * cumulative[-1])) + 1
            keep = min(keep, len(ranked))
        draw = self._rng.random() * cumulative[keep - 1]
        pick = int(np.searchsorted(cumulative[:keep], draw, side="right"))
        return int(order[min(pick, keep - 1)])
