"""The ready-made edits by name."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from lmcache_mp.edits._base import Edit
from lmcache_mp.edits._drop import RandomDrop
from lmcache_mp.edits._expected import ExpectedAttention
from lmcache_mp.edits._h2o import H2O
from lmcache_mp.edits._identity import Identity
from lmcache_mp.edits._keydiff import KeyDiff
from lmcache_mp.edits._knorm import KeyNorm
from lmcache_mp.edits._quantize import Quantize
from lmcache_mp.edits._redundancy import RedundancyDrop
from lmcache_mp.edits._rkv import RKV
from lmcache_mp.edits._scorer import PyTokenScorer
from lmcache_mp.edits._snapkv import SnapKV
from lmcache_mp.edits._stride import Stride
from lmcache_mp.edits._tova import TOVA
from lmcache_mp.edits._window import RecentWindow, StreamingLLM

__all__ = ["EDITS", "KIND_EDITS", "make_edit"]

#: Edit name (as used by ``make_edit`` and the benchmark) to edit class: the
#: single-kind edits, ``fn(kv, tokens)``.
EDITS: Mapping[str, type[Edit]] = MappingProxyType(
    {
        cls.name: cls
        for cls in (
            RandomDrop,
            RecentWindow,
            RedundancyDrop,
            Quantize,
            PyTokenScorer,
            Identity,
            Stride,
            KeyNorm,
            KeyDiff,
            StreamingLLM,
        )
    }
)

#: Edit name to edit class of the edits over several cache kinds, called as
#: ``fn({KV: kv, QUERY: queries}, tokens)`` by a stream with a context of
#: each kind. Apart from :data:`EDITS`, whose edits take a bare KV (as the
#: benchmark's KV-only streams give them).
KIND_EDITS: Mapping[str, type[Edit]] = MappingProxyType(
    {cls.name: cls for cls in (SnapKV, TOVA, H2O, RKV, ExpectedAttention)}
)


def make_edit(name: str, **params: Any) -> Edit:
    """Build a ready-made edit from its name and parameters.

    Args:
        name: A key of :data:`EDITS`: ``"random"``, ``"window"``,
            ``"redundancy"``, ``"quantize"``, ``"pyscore"``,
            ``"identity"``, ``"stride"``, ``"knorm"``, ``"keydiff"`` or
            ``"streamingllm"``; or of :data:`KIND_EDITS`: ``"snapkv"``,
            ``"tova"``, ``"h2o"``, ``"rkv"`` or ``"expected_attention"``.
        **params: The edit's parameters (its class's fields).

    Returns:
        The edit, a picklable ``fn(kv, tokens) -> (new_kv, new_tokens, info)``
        (``fn({KV: kv, QUERY: queries}, tokens)`` for a :data:`KIND_EDITS`
        one).

    Raises:
        ValueError: If ``name`` is unknown (the message lists the known
            names) or a parameter value is out of range (the message names
            it).
        TypeError: If a parameter is not one of the edit's (the message
            names it and lists the accepted ones).
    """
    cls = EDITS.get(name) or KIND_EDITS.get(name)
    if cls is None:
        known = sorted({*EDITS, *KIND_EDITS})
        raise ValueError(f"unknown edit {name!r}; known edits: {', '.join(known)}")
    accepted = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise TypeError(
            f"edit {name!r} has no parameter {', '.join(map(repr, unknown))}; "
            f"its parameters: {', '.join(accepted) or '(none)'}"
        )
    return cls(**params)
