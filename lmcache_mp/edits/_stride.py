"""Every n-th token: the cheap, overhead-bound benchmark workload."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from lmcache_mp.edits._base import EditResult, check_int
from lmcache_mp.edits._budget import TokenDrop
from lmcache_mp.hints import releases_gil

__all__ = ["Stride"]


@releases_gil
@dataclass(frozen=True)
class Stride(TokenDrop):
    """Keep every ``every``-th token, starting with the first.

    **A benchmark workload**: one strided copy of the KV, cheap beside
    moving the KV, so a modify phase with it costs mostly the
    retrieve, the store and the dispatch around the fn (the project's "keep
    every other token" row). Unlike :class:`~lmcache_mp.edits.Identity`, it
    changes the tokens, so the store writes new chunks rather than
    overwriting.

    Given ``keep`` or ``budget``, it keeps that many tokens evenly spread
    instead: position ``floor(i * T / kept)`` for ``i < kept`` (the first
    token included). ``rerotate`` moves the kept keys' RoPE.

    Args:
        keep: Fraction of all tokens to keep, instead of ``every``.
        budget: Tokens to keep, instead of ``every``.
        rerotate: Move the kept keys' RoPE: ``"compact"`` (or ``True``)
            to positions ``0 .. kept - 1``, ``"shift"`` each by
            ``-(T - kept)``.
        attention: The model's attention shape and RoPE (for ``rerotate``).
        every: Keep one token in ``every``, at least 1 (1 keeps all).

    Raises:
        ValueError: If ``every`` is out of range.
    """

    name: ClassVar[str] = "stride"
    default_keep: ClassVar[float | None] = None

    every: int = 2

    def __post_init__(self) -> None:
        """Check the parameters.

        Raises:
            ValueError: If ``every`` is out of range.
        """
        super().__post_init__()
        check_int(type(self).__name__, "every", self.every, 1)

    def _apply(self, kv: npt.NDArray[Any], tokens: list[int]) -> EditResult:
        total = len(tokens)
        if self.sized():
            kept = self.kept_count(total, 0)
            new_kv, new_tokens = self.gather(
                kv, tokens, np.arange(kept) * total // kept
            )
        elif self.rerotate:
            new_kv, new_tokens = self.gather(
                kv, tokens, np.arange(0, total, self.every)
            )
        else:
            # A strided view, no gather: the overhead-bound workload stays cheap.
            new_kv, new_tokens = kv[:, :, :: self.every], tokens[:: self.every]
        info = {"kept": len(new_tokens), "dropped": total - len(new_tokens)}
        return new_kv, new_tokens, info
