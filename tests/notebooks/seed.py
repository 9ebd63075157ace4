# The seed's script (seeds/batch.md), written for upstream's Batched Stream
# SDK: one KV context, a numpy fn of (kv, tokens). Run on lmcache_mp, only
# its import lines change (tests/test_notebooks.py).
import json

import lmcache.sdk.batch as lmc_batch
import lmcache.sdk.stream as lmc_stream
import numpy as np
from deployment import ctx, post_completion, prompts


def drop_tokens(kv, tokens):
    """Keep every other token."""
    keep = np.arange(0, kv.shape[2], 2)
    return kv[:, :, keep], [tokens[i] for i in keep]


batch = lmc_batch.LMCacheBatchedStream()
for toks in prompts:
    batch.add(lmc_stream.create_request(ctx, post_completion, toks))
batch.prefill({"temperature": 1.0, "seed": 0})  # seeded: runs compare
batch.modify(drop_tokens)
results = batch.decode({"max_tokens": 8, "temperature": 0.0})
data = results.to_dict()
streams = [batch.get_stream(sid) for sid in batch.streams]
print(
    json.dumps(
        {
            "tokens": [s.tokens for s in streams],
            "outputs": [s.output_tokens() for s in streams],
            "kv_sums": [float(lmc_stream.get(s).sum()) for s in streams],
            "done": [s.is_done() for s in streams],
            "output_tokens": data["metrics"]["results"]["output_tokens"],
        }
    )
)
