"""Every n-th token: the cheap, overhead-bound benchmark workload."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy.typing as npt

from lmcache_mp.edits._base import Edit, EditResult, check_int
from lmcache_mp.hints import releases_gil

__all__ = ["Stride"]


@releases_gil
@dataclass(frozen=True)
class Stride(Edit):
    """Keep every ``every``-th token, starting with the first.

    **A benchmark workload**: one strided copy of the KV, about a
    millisecond for 8 MiB, so a modify phase with it costs mostly the
    retrieve, the store and the dispatch around the fn (issue #12's "keep
    every other token" row). Unlike :class:`~lmcache_mp.edits.Identity`, it
    changes the tokens, so the store writes new chunks rather than
    overwriting.

    Args:
        every: Keep one token in ``every``, at least 1 (1 keeps all).

    Raises:
        ValueError: If ``every`` is out of range.
    """

    name: ClassVar[str] = "stride"

    every: int = 2

    def __post_init__(self) -> None:
        """Check the parameters.

        Raises:
            ValueError: If ``every`` is out of range.
        """
        check_int(type(self).__name__, "every", self.every, 1)

    def _apply(self, kv: npt.NDArray[Any], tokens: list[int]) -> EditResult:
        kept = tokens[:: self.every]
        info = {"kept": len(kept), "dropped": len(tokens) - len(kept)}
        return kv[:, :, :: self.every], kept, info
