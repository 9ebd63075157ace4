"""The edit that changes nothing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy.typing as npt

from lmcache_mp.edits._base import Edit, EditResult
from lmcache_mp.hints import releases_gil

__all__ = ["Identity"]


@releases_gil
@dataclass(frozen=True)
class Identity(Edit):
    """Return the KV and tokens unchanged.

    The baseline benchmark workload: a modify phase with this edit costs
    only the retrieve, the store and the dispatch around the fn, so it
    measures the executor's overhead. The KV returned is the input array
    itself, not a copy.
    """

    name: ClassVar[str] = "identity"

    def _apply(self, kv: npt.NDArray[Any], tokens: list[int]) -> EditResult:
        return kv, tokens, {"kept": len(tokens), "dropped": 0}
