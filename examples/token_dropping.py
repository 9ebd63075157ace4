"""Token dropping with lmcache_mp: prefill, drop half the KV, decode.

The flow of upstream LMCache's token-dropping example, on the embedded
shared-memory store and the embedded toy engine, with the phases running on
a process pool. The same prompts run twice, greedily: once as they are
(undropped) and once with half of each prompt's cached tokens dropped by a
ready-made edit. The script prints, for both runs, the decode throughput
and the prompt tokens the decode found in the cache, and how many
generated tokens of the dropped run agree with the undropped one::

    python examples/token_dropping.py
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from tabulate import tabulate

import lmcache_mp.batch as lmc_batch
import lmcache_mp.stream as lmc_stream
from lmcache_mp.edits import Edit, make_edit
from lmcache_mp.engine import EmbeddedEngine, EngineConfig
from lmcache_mp.kv import connect

STREAMS = 8
PROMPT_TOKENS = 2048
MAX_TOKENS = 64
MODEL = EngineConfig(layers=2, kv_heads=4, head_dim=16, d_model=64, seed=0)
GREEDY: dict[str, Any] = {"temperature": 0.0}


def make_prompts() -> list[list[int]]:
    """Random token ids (never EOS, id 0), the same on every call."""
    rng = np.random.default_rng(0)
    rows = rng.integers(1, MODEL.vocab_size, size=(STREAMS, PROMPT_TOKENS))
    return [[int(t) for t in row] for row in rows]


def run(prompts: Sequence[list[int]], edit: Edit | None) -> dict[str, Any]:
    """Prefill, optionally edit the cached KV, decode; on a fresh store.

    Returns:
        The decode report's figures and each stream's generated tokens.
    """
    with connect(
        chunk_size=256, layers=MODEL.layers, width=MODEL.width, dtype=MODEL.dtype
    ) as ctx:
        engine = EmbeddedEngine(ctx, MODEL)
        with lmc_batch.LMCacheBatchedStream() as batch:
            streams = [lmc_stream.create_request(ctx, engine, p) for p in prompts]
            for stream in streams:
                batch.add(stream)
            batch.prefill(GREEDY)
            tokens_before = sum(len(s.tokens) for s in streams)
            if edit is not None:
                batch.modify(edit)
            tokens_after = sum(len(s.tokens) for s in streams)
            decode = batch.decode(
                {**GREEDY, "max_tokens": MAX_TOKENS, "ignore_eos": True}
            ).to_dict()["metrics"]
            # The decode's tokens: what each stream generated after prefill.
            outputs = [s.output_tokens()[1:] for s in streams]
    return {
        "tokens_before": tokens_before,
        "tokens_after": tokens_after,
        "output_tput": decode["results"]["output_tput"],
        "cache_hit_tokens": decode["cache"]["cache_hit_tokens"],
        "outputs": outputs,
    }


def agreement(reference: list[list[int]], other: list[list[int]]) -> tuple[int, int]:
    """Generated tokens equal at the same position, and the total compared."""
    pairs = zip(reference, other, strict=True)
    # Both runs decode exactly MAX_TOKENS tokens (EOS is ignored).
    same = sum(a == b for ref, out in pairs for a, b in zip(ref, out, strict=True))
    return same, sum(len(ref) for ref in reference)


def main() -> None:
    """Run both variants and print the comparison."""
    prompts = make_prompts()
    undropped = run(prompts, None)
    dropped = run(prompts, make_edit("random", keep=0.5))
    rows = [
        ["undropped", f"{undropped['tokens_before']:,} (no edit)"],
        [
            "dropped (keep 0.5)",
            f"{dropped['tokens_before']:,} -> {dropped['tokens_after']:,}",
        ],
    ]
    for row, r in zip(rows, (undropped, dropped), strict=True):
        row += [f"{r['cache_hit_tokens']:,}", f"{r['output_tput']:.0f}"]
    headers = ["run", "stream tokens", "decode cache hits", "decode tok/s"]
    print(f"{STREAMS} streams x {PROMPT_TOKENS} prompt tokens, {MAX_TOKENS} decoded")
    print(tabulate(rows, headers=headers, disable_numparse=True))
    same, total = agreement(undropped["outputs"], dropped["outputs"])
    print(
        f"generated tokens that agree with the undropped run: {same} of {total} "
        f"({100 * same / total:.0f}%)"
    )


if __name__ == "__main__":
    main()
