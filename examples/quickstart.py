"""The seed's usage block, run end to end on the embedded store and engine.

The block below is upstream's (``seeds/batch.md``) with ``lmcache_mp``
module names and ``ctx = lmcache_mp.connect()``; each phase's report is
printed. Run it with ``python examples/quickstart.py``.
"""

from __future__ import annotations

import numpy as np

import lmcache_mp
import lmcache_mp.batch as lmc_batch
import lmcache_mp.stream as lmc_stream
from lmcache_mp.edits import make_edit
from lmcache_mp.engine import EmbeddedEngine, EngineConfig

N_PROMPTS = 8
PROMPT_TOKENS = 1024


def main() -> None:
    """Prefill, drop half of every stream's KV, decode; print the reports."""
    ctx = lmcache_mp.connect()
    post_completion = EmbeddedEngine(ctx, EngineConfig())
    rng = np.random.default_rng(0)
    vocab = post_completion.config.vocab_size
    prompts = [rng.integers(1, vocab, PROMPT_TOKENS).tolist() for _ in range(N_PROMPTS)]
    drop_tokens = make_edit("random", keep=0.5)

    batch = lmc_batch.LMCacheBatchedStream()
    for toks in prompts:
        batch.add(lmc_stream.create_request(ctx, post_completion, toks))

    batch.prefill({"temperature": 1.0}).emit()  # max_tokens forced to 1
    batch.modify(drop_tokens).emit()  # edit every stream's KV concurrently
    results = batch.decode({"max_tokens": 256})  # returns Metrics
    results.emit()  # print the Metric in a table on terminal
    data = results.to_dict()  # to get the Metric as a dictionary
    tput = data["metrics"]["results"]["output_tput"]
    print(f"decode throughput: {tput:.1f} tokens/s")
    batch.close()
    ctx.close()


# The guard matters: worker processes started with "spawn" import this file.
if __name__ == "__main__":
    main()
