"""Ready-made modify fns: token dropping, windows, quantization, workloads.

Each edit is a small frozen dataclass ``edit(kv, tokens) -> (new_kv,
new_tokens, info)`` taking a ``[2, L, T, D]`` numpy KV; it pickles by
reference, so it travels to worker processes for a few hundred bytes, and
its result depends only on its parameters and its input.

:class:`SnapKV` (in :data:`KIND_EDITS`) scores the KV with the prompt's
queries: it is the modify fn of a stream with a KV and a QUERY context,
called as ``edit({KV: kv, QUERY: queries}, tokens)``.
"""

from lmcache_mp.edits._base import Edit, EditResult
from lmcache_mp.edits._drop import RandomDrop
from lmcache_mp.edits._identity import Identity
from lmcache_mp.edits._quantize import Quantize
from lmcache_mp.edits._redundancy import RedundancyDrop
from lmcache_mp.edits._registry import EDITS, KIND_EDITS, make_edit
from lmcache_mp.edits._rope import AttentionConfig, rerotate_keys
from lmcache_mp.edits._scorer import PyTokenScorer
from lmcache_mp.edits._select import keep_count, keep_indices
from lmcache_mp.edits._snapkv import SnapKV
from lmcache_mp.edits._stride import Stride
from lmcache_mp.edits._window import RecentWindow

__all__ = [
    "EDITS",
    "KIND_EDITS",
    "AttentionConfig",
    "Edit",
    "EditResult",
    "Identity",
    "PyTokenScorer",
    "Quantize",
    "RandomDrop",
    "RecentWindow",
    "RedundancyDrop",
    "SnapKV",
    "Stride",
    "keep_count",
    "keep_indices",
    "make_edit",
    "rerotate_keys",
]
