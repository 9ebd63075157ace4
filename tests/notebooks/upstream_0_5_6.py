# A notebook written for upstream lmcache==0.5.6: multi-kind contexts, a
# torch fn of {kind: tensor}, 0.5.6's names. Run on lmcache_mp, only its
# import lines change (tests/test_notebooks.py).
import json

import lmcache.sdk.batch as lmc_batch
import lmcache.sdk.request as lmc_request
import torch
from deployment import kv_ctx, post_completion, prompts, q_ctx
from lmcache.sdk.cache_kind import LMCacheSDKCacheKind


def keep_attended(tensors, tokens):
    """Keep the half of the keys the last 8 queries score highest."""
    kv = tensors[LMCacheSDKCacheKind.KV]
    q = tensors[LMCacheSDKCacheKind.QUERY]
    scores = torch.einsum("lwd,ltd->t", q[0, :, -8:].float(), kv[0].float())
    keep = torch.topk(scores, kv.shape[2] // 2).indices.sort().values
    return kv[:, :, keep], [tokens[i] for i in keep.tolist()]


batch = lmc_batch.LMCacheBatchedStream()
for prompt in prompts:
    batch.add(lmc_request.create_request([kv_ctx, q_ctx], post_completion, prompt))
batch.prefill({"temperature": 0.0})
batch.modify(keep_attended)
results = batch.decode({"max_tokens": 8, "temperature": 0.0})
streams = [batch.get_request_stream(sid) for sid in batch.request_streams]
print(
    json.dumps(
        {
            "tokens": [s.tokens for s in streams],
            "outputs": [s.output_tokens for s in streams],
            "kv_sums": [
                float(s.retrieve(kind=LMCacheSDKCacheKind.KV).sum()) for s in streams
            ],
            "done": [s.is_done for s in streams],
            "output_tokens": results.to_dict()["metrics"]["results"]["output_tokens"],
        }
    )
)
