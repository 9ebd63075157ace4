"""A token scorer in pure Python: the GIL-bound benchmark workload."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from lmcache_mp.edits._base import check_int, check_layers, resolve_layers
from lmcache_mp.edits._scored import ScoredDrop
from lmcache_mp.hints import gil_bound

__all__ = ["PyTokenScorer"]


@gil_bound
@dataclass(frozen=True)
class PyTokenScorer(ScoredDrop):
    """Keep the tokens with the largest keys, scored in a pure-Python loop.

    **A benchmark workload**, standing for the many research edits written
    as plain Python loops. A token's score is the L1 norm of the first
    ``span`` channels of its key in each of ``layers``, summed over those
    layers; the loop runs ``work`` times over the same values (the score is
    then ``work`` times the norm, which ranks tokens alike). The values are
    Python floats and the arithmetic is interpreted bytecode, so the edit
    holds the GIL throughout: threads cannot run two streams' scoring at
    once, processes can. Its cost grows linearly with
    ``T * len(layers) * min(span, D) * work``.

    The first ``keep_first`` and last ``keep_last`` tokens are always kept,
    and the highest-scored tokens in between, so that ``round(keep * T)``
    (or ``budget``) tokens remain (more when the protected ones alone are more; all when
    ``T <= keep_first + keep_last``).

    Args:
        keep: Fraction of all tokens to keep, in ``(0, 1]`` (default 0.5).
        budget: Tokens to keep, instead of ``keep``.
        rerotate: Move the kept keys' RoPE: ``"compact"`` (or ``True``)
            to positions ``0 .. kept - 1``, ``"shift"`` each by
            ``-(T - kept)``.
        attention: The model's attention shape and RoPE (for ``rerotate``).
        keep_first: Leading tokens always kept.
        keep_last: Trailing tokens always kept.
        work: Passes of the scoring loop, at least 1.
        layers: Layer indices whose keys are scored (negative from the
            last).
        span: Leading key channels scored per layer, at least 1.

    Raises:
        ValueError: If a parameter is out of range; the message names it.
            At call time, if ``layers`` does not fit the KV.
    """

    name: ClassVar[str] = "pyscore"

    work: int = 16
    layers: Sequence[int] = (0,)
    span: int = 256

    def __post_init__(self) -> None:
        """Check the parameters.

        Raises:
            ValueError: If a parameter is out of range; the message names it.
        """
        super().__post_init__()
        owner = type(self).__name__
        check_int(owner, "work", self.work, 1)
        # A tuple keeps the frozen edit hashable when given a list.
        object.__setattr__(self, "layers", check_layers(owner, self.layers))
        check_int(owner, "span", self.span, 1)

    def _priority(
        self, kv: npt.NDArray[Any], tokens: list[int], lo: int, hi: int
    ) -> npt.NDArray[Any]:
        layers = resolve_layers(type(self).__name__, tuple(self.layers), kv.shape[1])
        scores = [0.0] * (hi - lo)
        for layer in layers:
            # float32 first: tolist() of float16/bfloat16 must give floats.
            rows = kv[0, layer, lo:hi, : self.span].astype(np.float32).tolist()
            for i, row in enumerate(rows):
                score = scores[i]
                for _ in range(self.work):
                    for value in row:
                        score += abs(value)
                scores[i] = score
        return np.asarray(scores)
