"""Ready-made modify fns: token dropping, windows, quantization, workloads.

Each edit is a small frozen dataclass ``edit(kv, tokens) -> (new_kv,
new_tokens, info)`` taking a ``[2, L, T, D]`` numpy KV; it pickles by
reference, so it travels to worker processes for a few hundred bytes, and
its result depends only on its parameters and its input.

:class:`SnapKV`, :class:`TOVA`, :class:`H2O`, :class:`RKV` and
:class:`ExpectedAttention` (in
:data:`KIND_EDITS`) score the KV with the prompt's queries: each is the
modify fn of a stream with a KV and a QUERY context, called as
``edit({KV: kv, QUERY: queries}, tokens)``.

Every token-dropping edit takes ``keep`` (a fraction) or ``budget``
(tokens), and ``rerotate`` with the model's :class:`AttentionConfig`
(``attention=``), which also groups query heads onto KV heads (GQA);
:func:`rerotate_keys` moves keys' RoPE to new positions. Decoding goes on
at position ``kept``, the edited cache's length, as vLLM and LMCache count
positions. ``rerotate="compact"`` (or ``True``) moves the kept keys to
``0 .. kept - 1``; ``rerotate="shift"`` moves every kept key by
``-(T - kept)``, which keeps each key's distance to every later token as
it was, as kvpress's presses do by keeping original positions; the default
``False`` leaves keys rotated for their original positions, so decoding
sees each ``T - kept`` tokens nearer than it was.

PyramidKV (Cai et al., 2024) is left out on purpose: it gives each layer
its own budget (more tokens in the lower layers), but a stream's KV has one
token axis and one token list for every layer, so one token subset per
stream cannot hold a different number of tokens per layer; forcing one
shared subset would make it SnapKV's selection again.
"""

from lmcache_mp._core.attention import AttentionConfig
from lmcache_mp.edits._base import Edit, EditResult
from lmcache_mp.edits._drop import RandomDrop
from lmcache_mp.edits._expected import ExpectedAttention
from lmcache_mp.edits._h2o import H2O
from lmcache_mp.edits._identity import Identity
from lmcache_mp.edits._keydiff import KeyDiff
from lmcache_mp.edits._knorm import KeyNorm
from lmcache_mp.edits._quantize import Quantize
from lmcache_mp.edits._redundancy import RedundancyDrop
from lmcache_mp.edits._registry import EDITS, KIND_EDITS, make_edit
from lmcache_mp.edits._rkv import RKV
from lmcache_mp.edits._rope import rerotate_keys
from lmcache_mp.edits._scorer import PyTokenScorer
from lmcache_mp.edits._select import keep_count, keep_indices
from lmcache_mp.edits._snapkv import SnapKV
from lmcache_mp.edits._stride import Stride
from lmcache_mp.edits._tova import TOVA
from lmcache_mp.edits._window import RecentWindow, StreamingLLM

__all__ = [
    "EDITS",
    "H2O",
    "KIND_EDITS",
    "RKV",
    "TOVA",
    "AttentionConfig",
    "Edit",
    "EditResult",
    "ExpectedAttention",
    "Identity",
    "KeyDiff",
    "KeyNorm",
    "PyTokenScorer",
    "Quantize",
    "RandomDrop",
    "RecentWindow",
    "RedundancyDrop",
    "SnapKV",
    "StreamingLLM",
    "Stride",
    "keep_count",
    "keep_indices",
    "make_edit",
    "rerotate_keys",
]
