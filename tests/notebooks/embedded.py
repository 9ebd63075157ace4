"""What a notebook's deployment gives it — contexts, an engine, prompts —
here the embedded store and engine (upstream: ``lmcache.sdk.connect`` to an
LMCache server and a vLLM ``post_completion``). Imported by the notebooks
in this folder in place of their deployment's module."""

from __future__ import annotations

import numpy as np

import lmcache_mp
from lmcache_mp import LMCacheSDKCacheKind
from lmcache_mp.engine import EmbeddedEngine, EngineConfig

MODEL = EngineConfig(layers=2, kv_heads=2, head_dim=8, d_model=32, seed=1)

#: The KV context (a temporary store, removed when this process exits)
#: and its QUERY namespace, which the engine fills with the prompts' queries.
kv_ctx = lmcache_mp.connect(
    chunk_size=16, layers=MODEL.layers, width=MODEL.width, dtype=MODEL.dtype
)
q_ctx = kv_ctx.for_kind(LMCacheSDKCacheKind.QUERY)
ctx = kv_ctx
post_completion = EmbeddedEngine(kv_ctx, MODEL, query_ctx=q_ctx)
prompts = [
    [int(t) for t in row]
    for row in np.random.default_rng(5).integers(1, MODEL.vocab_size, (4, 64))
]
