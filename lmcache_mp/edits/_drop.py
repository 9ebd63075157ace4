"""Random token dropping."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from lmcache_mp.edits._base import check_int
from lmcache_mp.edits._scored import ScoredDrop

__all__ = ["RandomDrop"]


@dataclass(frozen=True)
class RandomDrop(ScoredDrop):
    """Drop a random subset of the middle tokens.

    Keeps the first ``keep_first`` and last ``keep_last`` tokens, and a
    uniformly random subset of the tokens in between, so that about
    ``keep`` of all tokens remain (exactly ``round(keep * T)``, or
    ``budget``, unless the protected tokens alone are more); when
    ``T <= keep_first + keep_last`` every token is kept. The kept tokens
    stay in their original order.

    The random choice depends only on ``seed`` and the token ids: the same
    stream gets the same result on every call, in any thread or process,
    whatever was edited before; a different prompt gets a different choice.

    Args:
        keep: Fraction of all tokens to keep, in ``(0, 1]`` (default 0.5).
        budget: Tokens to keep, instead of ``keep``.
        rerotate: Move the kept keys' RoPE: ``"compact"`` (or ``True``)
            to positions ``0 .. kept - 1``, ``"shift"`` each by
            ``-(T - kept)``.
        attention: The model's attention shape and RoPE (for ``rerotate``).
        keep_first: Leading tokens always kept.
        keep_last: Trailing tokens always kept.
        seed: Non-negative seed of the random choice.

    Raises:
        ValueError: If a parameter is out of range; the message names it.
    """

    name: ClassVar[str] = "random"

    seed: int = 0

    def __post_init__(self) -> None:
        """Check the parameters.

        Raises:
            ValueError: If a parameter is out of range; the message names it.
        """
        super().__post_init__()
        check_int(type(self).__name__, "seed", self.seed, 0)

    def _priority(
        self, kv: npt.NDArray[Any], tokens: list[int], lo: int, hi: int
    ) -> npt.NDArray[Any]:
        # A digest of the tokens, not hash(): hash() of str/bytes varies per
        # process, and the choice must not depend on which process runs it.
        digest = hashlib.blake2b(
            np.asarray(tokens, dtype="<i8").tobytes(), digest_size=16
        ).digest()
        words = np.frombuffer(digest, dtype="<u4").tolist()
        rng = np.random.default_rng(np.random.SeedSequence([int(self.seed), *words]))
        return rng.random(hi - lo)
