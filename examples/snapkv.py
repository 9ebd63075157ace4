"""Query-aware KV compression: SnapKV against random and window drops.

Upstream 0.5.6's request API (``lmcache_mp.request``): each stream has a
KV context and a QUERY context, and the embedded engine records the
prompt's queries in the latter during prefill. The same prompts run
greedily four times on the process pool: undropped, then with each
stream's cached prompt cut to the same budget by ``random``, ``window``
(attention sinks + the most recent tokens) and ``snapkv`` (the tokens the
prompt's last window of queries attends to). The script prints, per edit,
how many decoded tokens agree with the undropped run::

    python examples/snapkv.py            # 8 streams x 1,024 tokens, keep 0.25
    python examples/snapkv.py --keep 0.5 --streams 4
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from tabulate import tabulate

import lmcache_mp.batch as lmc_batch
import lmcache_mp.request as lmc_request
from lmcache_mp import LMCacheSDKCacheKind
from lmcache_mp.edits import Edit, keep_count, make_edit
from lmcache_mp.engine import EmbeddedEngine, EngineConfig
from lmcache_mp.kv import connect

MODEL = EngineConfig(layers=2, kv_heads=4, head_dim=16, d_model=64, seed=0)
GREEDY: dict[str, Any] = {"temperature": 0.0}
CHUNK = 64
SINKS = 4
OBSERVATION_WINDOW = 32


@dataclass(frozen=True)
class Setup:
    """The comparison's size.

    Args:
        streams: Prompts in the batch.
        prompt_tokens: Tokens per prompt (a multiple of the chunk size, so
            the whole prompt is cached).
        keep: Fraction of each cached prompt every edit keeps.
        max_tokens: Tokens decoded after the edit.
        executor: The batch's executor.
    """

    streams: int = 8
    prompt_tokens: int = 1024
    keep: float = 0.25
    max_tokens: int = 32
    executor: str = "process"


def make_prompts(setup: Setup) -> list[list[int]]:
    """Random token ids (never EOS, id 0), the same on every call."""
    rng = np.random.default_rng(0)
    rows = rng.integers(1, MODEL.vocab_size, size=(setup.streams, setup.prompt_tokens))
    return [[int(t) for t in row] for row in rows]


def edits(setup: Setup) -> dict[str, Edit]:
    """The three edits, cutting a cached prompt to the same token budget."""
    budget = keep_count(setup.keep, setup.prompt_tokens, 0)
    return {
        "random": make_edit("random", keep=setup.keep, keep_first=0, keep_last=0),
        "window": make_edit("window", sinks=SINKS, window=budget - SINKS),
        "snapkv": make_edit(
            "snapkv",
            keep=setup.keep,
            window=OBSERVATION_WINDOW,
            heads=MODEL.kv_heads,
        ),
    }


def run(setup: Setup, prompts: Sequence[list[int]], edit: Edit | None) -> list[Any]:
    """Prefill, optionally edit, decode, on a fresh store.

    Returns:
        ``[tokens kept, decoded tokens per stream]``.
    """
    with connect(
        chunk_size=CHUNK, layers=MODEL.layers, width=MODEL.width, dtype=MODEL.dtype
    ) as kv_ctx:
        q_ctx = kv_ctx.for_kind(LMCacheSDKCacheKind.QUERY)
        engine = EmbeddedEngine(kv_ctx, MODEL, query_ctx=q_ctx)
        with lmc_batch.LMCacheBatchedStream(setup.executor) as batch:
            for prompt in prompts:
                batch.add(lmc_request.create_request([kv_ctx, q_ctx], engine, prompt))
            batch.prefill(GREEDY)
            if edit is not None:
                batch.modify(edit)
            kept = sum(len(s.tokens) for s in batch.request_streams.values())
            batch.decode({**GREEDY, "max_tokens": setup.max_tokens, "ignore_eos": True})
            # What each stream decoded after its prefill token.
            outputs = [s.output_tokens[1:] for s in batch.request_streams.values()]
    return [kept, outputs]


def agreement(reference: list[list[int]], other: list[list[int]]) -> tuple[int, int]:
    """Decoded tokens equal at the same position, and the leading tokens
    equal before the first difference (greedy decoding diverges there),
    summed over the streams."""
    same = lead = 0
    for ref, out in zip(reference, other, strict=True):
        equal = [a == b for a, b in zip(ref, out, strict=True)]
        same += sum(equal)
        lead += equal.index(False) if False in equal else len(equal)
    return same, lead


def compare(setup: Setup) -> list[list[Any]]:
    """Run the undropped reference and every edit.

    Returns:
        One row per edit: name, tokens kept, decoded tokens that agree with
        the reference, leading tokens that agree, and the total decoded.
    """
    prompts = make_prompts(setup)
    _, reference = run(setup, prompts, None)
    total = setup.streams * setup.max_tokens
    rows = []
    for name, edit in edits(setup).items():
        kept, outputs = run(setup, prompts, edit)
        same, lead = agreement(reference, outputs)
        rows.append([name, kept, same, lead, total])
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    """Parse the size, run the comparison, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=Setup.streams)
    parser.add_argument("--prompt-tokens", type=int, default=Setup.prompt_tokens)
    parser.add_argument("--keep", type=float, default=Setup.keep)
    parser.add_argument("--max-tokens", type=int, default=Setup.max_tokens)
    args = parser.parse_args(argv)
    setup = Setup(args.streams, args.prompt_tokens, args.keep, args.max_tokens)
    rows = compare(setup)
    print(
        f"{setup.streams} streams x {setup.prompt_tokens} prompt tokens, keep "
        f"{setup.keep} of each, {setup.max_tokens} tokens decoded greedily"
    )
    table = [
        [name, f"{kept:,}", f"{same}/{total} ({100 * same / total:.0f}%)", lead]
        for name, kept, same, lead, total in rows
    ]
    headers = ["edit", "tokens kept", "decoded tokens = undropped", "leading equal"]
    print(tabulate(table, headers=headers, disable_numparse=True))


# The guard matters: worker processes started with "spawn" import this file.
if __name__ == "__main__":
    main()
