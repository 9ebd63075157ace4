"""The KV-compression methods against direct references.

Each reference below is the method's rule written out directly (unblocked
O(T^2) where the rule is, loops over layers and query heads), independent
of the edits' code; the edits must keep exactly the tokens it keeps.
"""

from __future__ import annotations

import math
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_mp.cache_kind import LMCacheSDKCacheKind
from lmcache_mp.edits import (
    EDITS,
    KIND_EDITS,
    AttentionConfig,
    Edit,
    make_edit,
    rerotate_keys,
)
from tests.test_rope import direct_rope

KV, QUERY = LMCacheSDKCacheKind.KV, LMCacheSDKCacheKind.QUERY
GQA = AttentionConfig(q_heads=6, kv_heads=2, head_dim=4)
MHA = AttentionConfig(q_heads=3, kv_heads=3, head_dim=4)
LAYERS = 3
NEW_KV_ONLY = ("knorm", "keydiff", "streamingllm")
NEW_WITH_QUERIES = ("tova", "h2o", "rkv", "expected_attention")
# Every edit that drops tokens, with small parameters.
DROPPING: dict[str, dict[str, Any]] = {
    "random": {"keep_first": 2, "keep_last": 2},
    "redundancy": {"keep_first": 2, "keep_last": 2},
    "pyscore": {"keep_first": 2, "keep_last": 2, "work": 1},
    "window": {"sinks": 2},
    "stride": {},
    "knorm": {},
    "keydiff": {},
    "streamingllm": {"sinks": 2},
    "snapkv": {"window": 4},
    "tova": {},
    "h2o": {},
    "rkv": {"window": 4},
    "expected_attention": {},
}


def tensors(
    config: AttentionConfig, total: int = 40, seed: int = 0, dtype: Any = np.float32
) -> tuple[np.ndarray, np.ndarray]:
    """A random ``[2, L, T, kv_heads*d]`` KV and ``[1, L, T, q_heads*d]`` queries."""
    rng = np.random.default_rng(seed)
    d = config.head_dim
    kv = rng.standard_normal((2, LAYERS, total, config.kv_heads * d))
    q = 2 * rng.standard_normal((1, LAYERS, total, config.q_heads * d))
    return kv.astype(dtype), q.astype(dtype)


def ids(total: int) -> list[int]:
    """Distinct token ids that are not their positions."""
    return [1000 + 7 * i for i in range(total)]


def positions(kept: list[int]) -> list[int]:
    """The positions of kept ids made by :func:`ids`."""
    return [(t - 1000) // 7 for t in kept]


def run(
    name: str, kv: Any, q: Any, **params: Any
) -> tuple[Any, list[int], dict[str, Any]]:
    """Run edit ``name`` on a bare KV or, for KIND_EDITS, on {KV, QUERY}."""
    edit = make_edit(name, **params)
    total = kv.shape[2]
    arg = {KV: kv, QUERY: q} if name in KIND_EDITS else kv
    new_kv, new_tokens, info = edit(arg, ids(total))
    return new_kv, positions(new_tokens), info


def head(x: np.ndarray, layer: int, h: int, d: int) -> np.ndarray:
    """Head ``h`` of one layer: ``[T, d]`` float64."""
    return x[layer, :, h * d : (h + 1) * d].astype(np.float64)


def top(scores: dict[int, float], count: int) -> set[int]:
    """The ``count`` positions of highest score."""
    return set(sorted(scores, key=lambda p: -scores[p])[:count])


def budget_of(keep: float, total: int) -> int:
    return max(1, math.floor(keep * total + 0.5))


# --- references ---------------------------------------------------------------


def ref_knorm(kv: np.ndarray, c: AttentionConfig, count: int) -> set[int]:
    total = kv.shape[2]
    norm = {
        t: np.mean(
            [
                np.linalg.norm(head(kv[0], layer, h, c.head_dim)[t])
                for layer in range(LAYERS)
                for h in range(c.kv_heads)
            ]
        )
        for t in range(total)
    }
    return top({t: -n for t, n in norm.items()}, count)


def ref_keydiff(kv: np.ndarray, c: AttentionConfig, count: int) -> set[int]:
    total = kv.shape[2]
    cos = np.zeros(total)
    for layer in range(LAYERS):
        for h in range(c.kv_heads):
            k = head(kv[0], layer, h, c.head_dim)
            unit = k / np.linalg.norm(k, axis=1, keepdims=True)
            anchor = unit.mean(axis=0)
            cos += unit @ anchor / np.linalg.norm(anchor)
    return top({t: -cos[t] for t in range(total)}, count)


def causal_attention(q: np.ndarray, k: np.ndarray) -> np.ndarray:
    """The full ``[T, T]`` causal attention matrix of one head."""
    total = len(k)
    a = np.zeros((total, total))
    for i in range(total):
        logits = q[i] @ k[: i + 1].T / math.sqrt(k.shape[1])
        e = np.exp(logits - logits.max())
        a[i, : i + 1] = e / e.sum()
    return a


def per_query_head(kv: np.ndarray, q: np.ndarray, c: AttentionConfig) -> Any:
    """Yield ``(layer, queries, keys)`` per query head, keys of its KV head."""
    for layer in range(LAYERS):
        for h in range(c.q_heads):
            kvh = h // (c.q_heads // c.kv_heads)
            yield (
                layer,
                head(q[0], layer, h, c.head_dim),
                head(kv[0], layer, kvh, c.head_dim),
            )


def ref_tova(kv: np.ndarray, q: np.ndarray, c: AttentionConfig, count: int) -> set[int]:
    total = kv.shape[2]
    score = np.zeros(total)
    for _, qh, kh in per_query_head(kv, q, c):
        score += causal_attention(qh, kh)[-1]
    return top({t: score[t] for t in range(total - 1)}, count - 1) | {total - 1}


def ref_tova_union(
    kv: np.ndarray, q: np.ndarray, c: AttentionConfig, count: int
) -> set[int]:
    """Each layer's own ranking of the tokens before the last (by its heads'
    mean last-query attention); a token's best rank in any layer decides,
    equal best ranks by the mean over layers."""
    total = kv.shape[2]
    layer_scores = np.zeros((LAYERS, total))
    for layer, qh, kh in per_query_head(kv, q, c):
        layer_scores[layer] += causal_attention(qh, kh)[-1] / c.q_heads
    middle = range(total - 1)
    rank = [
        {t: r for r, t in enumerate(sorted(middle, key=lambda p: -scores[p]))}
        for scores in layer_scores
    ]
    best = {t: (min(r[t] for r in rank), -layer_scores[:, t].mean()) for t in middle}
    return set(sorted(middle, key=lambda p: best[p])[: count - 1]) | {total - 1}


def ref_h2o(kv: np.ndarray, q: np.ndarray, c: AttentionConfig, count: int) -> set[int]:
    total = kv.shape[2]
    recent = max(1, math.floor(0.5 * count + 0.5))
    score = np.zeros(total)
    for _, qh, kh in per_query_head(kv, q, c):
        score += causal_attention(qh, kh).sum(axis=0)
    heavy = top({t: score[t] for t in range(total - recent)}, count - recent)
    return heavy | set(range(total - recent, total))


def ref_rkv(
    kv: np.ndarray, q: np.ndarray, c: AttentionConfig, count: int, window: int
) -> set[int]:
    total, d, group = kv.shape[2], c.head_dim, c.group
    past, mix, threshold = total - window, 0.25, 0.5
    score = np.zeros(past)
    for layer in range(LAYERS):
        for g in range(c.kv_heads):
            k = head(kv[0], layer, g, d)
            logits = np.max(
                [
                    head(q[0], layer, h, d)[past:] @ k[:past].T / math.sqrt(d)
                    for h in range(g * group, (g + 1) * group)
                ],
                axis=0,
            )
            probs = np.exp(logits - logits.max(axis=1, keepdims=True))
            probs = (probs / probs.sum(axis=1, keepdims=True)).mean(axis=0)
            imp = [max(probs[max(0, j - 3) : j + 4]) for j in range(past)]
            unit = k / (np.linalg.norm(k, axis=1, keepdims=True) + 1e-8)
            sim = unit @ unit.T
            np.fill_diagonal(sim, 0.0)
            for r in range(total):
                over = [j for j in range(total) if sim[r, j] > threshold]
                sim[r, over[-1] if over else 0] = 0.0
            red = np.exp(sim.mean(axis=0))
            red /= red.sum()
            score += (mix * np.asarray(imp) - (1 - mix) * red[:past]) / c.kv_heads
    return top(dict(enumerate(score)), count - window) | set(range(past, total))


def rope_matrix(c: AttentionConfig, position: int) -> np.ndarray:
    """The ``[d, d]`` RoPE rotation of one head at ``position``: channel
    ``i`` paired with ``i + d/2``, as transformers rotates."""
    d, half = c.head_dim, c.head_dim // 2
    theta = position * c.inverse_frequencies()
    r = np.zeros((d, d))
    for i in range(half):
        cos, sin = math.cos(theta[i]), math.sin(theta[i])
        r[i, i], r[i, i + half] = cos, -sin
        r[i + half, i], r[i + half, i + half] = sin, cos
    return r


def ref_expected(
    kv: np.ndarray,
    q: np.ndarray,
    c: AttentionConfig,
    count: int,
    sinks: int = 4,
    future: int = 512,
) -> set[int]:
    total, d = kv.shape[2], c.head_dim
    ahead = np.mean([rope_matrix(c, p) for p in range(total, total + future)], axis=0)
    score = np.zeros(total)
    for layer in range(LAYERS):
        for g in range(c.kv_heads):
            k, v = head(kv[0], layer, g, d), head(kv[1], layer, g, d)
            probs = np.zeros(total - sinks)
            for h in range(g * c.group, (g + 1) * c.group):
                qs = head(q[0], layer, h, d)
                pre = np.array(
                    [rope_matrix(c, p).T @ qs[p] for p in range(sinks, total)]
                )
                mu = pre.mean(axis=0)
                cov = sum(np.outer(x - mu, x - mu) for x in pre) / len(pre)
                mu, cov = ahead @ mu, ahead @ cov @ ahead.T
                logits = np.array(
                    [
                        k[t] @ mu / math.sqrt(d) + k[t] @ cov @ k[t] / (2 * d)
                        for t in range(sinks, total)
                    ]
                )
                e = np.exp(logits - logits.max())
                probs += e / e.sum() / c.group
            score[sinks:] += probs * np.linalg.norm(v[sinks:], axis=1)
    kept = top({t: score[t] for t in range(sinks, total)}, count - sinks)
    return kept | set(range(sinks))


# --- each method against its reference ----------------------------------------


KV_REFERENCES = {"knorm": ref_knorm, "keydiff": ref_keydiff}


@pytest.mark.parametrize("config", [GQA, MHA], ids=["gqa", "mha"])
@pytest.mark.parametrize("keep", [0.25, 0.5])
@pytest.mark.parametrize("name", sorted(KV_REFERENCES))
def test_key_scored_edits_keep_what_their_reference_keeps(
    name: str, config: AttentionConfig, keep: float
) -> None:
    """knorm keeps the tokens of lowest key norm, keydiff those of lowest
    cosine to the mean unit key, each averaged over layers and KV heads."""
    kv, q = tensors(config)
    _, kept, _ = run(name, kv, q, keep=keep, attention=config)
    assert set(kept) == KV_REFERENCES[name](kv, config, budget_of(keep, 40))


def test_streamingllm_keeps_sinks_and_the_latest_tokens() -> None:
    """streamingllm keeps the first `sinks` and the last budget - sinks tokens."""
    kv, q = tensors(GQA)
    _, kept, _ = run("streamingllm", kv, q, budget=10, sinks=3, rerotate=False)
    assert kept == [0, 1, 2, *range(33, 40)]


@pytest.mark.parametrize("config", [GQA, MHA], ids=["gqa", "mha"])
@pytest.mark.parametrize("budget", [8, 20])
def test_tova_keeps_what_the_last_query_attends_to(
    config: AttentionConfig, budget: int
) -> None:
    """tova with across_layers="mean" keeps the last token and the keys of
    highest last-query attention, averaged over heads and layers."""
    kv, q = tensors(config, seed=1)
    _, kept, _ = run(
        "tova", kv, q, budget=budget, attention=config, across_layers="mean"
    )
    assert set(kept) == ref_tova(kv, q, config, budget)


@pytest.mark.parametrize("config", [GQA, MHA], ids=["gqa", "mha"])
@pytest.mark.parametrize("budget", [8, 20])
def test_tova_union_keeps_each_layers_top_tokens(
    config: AttentionConfig, budget: int
) -> None:
    """tova (by default across_layers="union") keeps the last token and, by
    best rank in any layer, the tokens each layer's last query attends to
    most."""
    kv, q = tensors(config, seed=1)
    _, kept, _ = run("tova", kv, q, budget=budget, attention=config)
    assert set(kept) == ref_tova_union(kv, q, config, budget)


def test_tova_union_keeps_a_token_one_layer_alone_attends_to() -> None:
    """A key only the first layer's last query attends to (its attention
    diluted in the mean over layers) is kept under "union", not "mean"."""
    kv, q = tensors(MHA, seed=4)
    d = MHA.head_dim
    # Layer 0: every head's last query gives key 5 about a third of its
    # attention; layers 1 and 2 give keys 10-13 about a quarter each, which
    # outweighs key 5 in the mean over layers.
    direction = np.ones(d, dtype=np.float32)
    for h in range(MHA.q_heads):
        q[0, 0, -1, h * d : (h + 1) * d] = 1.4 * direction
        kv[0, 0, :, h * d : (h + 1) * d] *= 0.1
        kv[0, 0, 5, h * d : (h + 1) * d] = direction
    for layer in range(1, LAYERS):
        for h in range(MHA.q_heads):
            q[0, layer, -1, h * d : (h + 1) * d] = 3 * direction
            kv[0, layer, :, h * d : (h + 1) * d] *= 0.1
            kv[0, layer, 10:14, h * d : (h + 1) * d] = direction
    _, mean_kept, _ = run("tova", kv, q, budget=5, attention=MHA, across_layers="mean")
    _, union_kept, _ = run(
        "tova", kv, q, budget=5, attention=MHA, across_layers="union"
    )
    assert 5 not in mean_kept and 5 in union_kept


def test_tova_refuses_an_unknown_layer_merge() -> None:
    """across_layers other than "union" or "mean" raises ValueError naming it."""
    with pytest.raises(ValueError, match="'across_layers'"):
        make_edit("tova", across_layers="max")


@pytest.mark.parametrize("config", [GQA, MHA], ids=["gqa", "mha"])
@pytest.mark.parametrize(("budget", "block"), [(8, 7), (20, 3), (20, 256)])
def test_h2o_keeps_heavy_hitters_and_the_recent_window(
    config: AttentionConfig, budget: int, block: int
) -> None:
    """h2o (any query block) keeps half the budget recent, the rest by the
    attention each key receives from all later queries."""
    kv, q = tensors(config, seed=2)
    _, kept, info = run("h2o", kv, q, budget=budget, block=block, attention=config)
    assert set(kept) == ref_h2o(kv, q, config, budget)
    assert info["recent"] == budget // 2


@pytest.mark.parametrize("config", [GQA, MHA], ids=["gqa", "mha"])
@pytest.mark.parametrize("budget", [10, 24])
def test_rkv_keeps_important_non_redundant_tokens(
    config: AttentionConfig, budget: int
) -> None:
    """rkv keeps the window and the past tokens of highest λ-mixed score."""
    kv, q = tensors(config, seed=3)
    _, kept, _ = run("rkv", kv, q, budget=budget, window=4, attention=config)
    assert set(kept) == ref_rkv(kv, q, config, budget, 4)


@pytest.mark.parametrize("config", [GQA, MHA], ids=["gqa", "mha"])
@pytest.mark.parametrize("budget", [10, 24])
def test_expected_attention_keeps_what_the_fitted_queries_expect(
    config: AttentionConfig, budget: int
) -> None:
    """expected_attention keeps the sinks and the keys of highest expected
    attention from the queries' Gaussian (fitted before RoPE, the sinks
    left out, its RoPE averaged over the next positions), weighted by the
    value norm."""
    kv, q = tensors(config, seed=8)
    _, kept, _ = run("expected_attention", kv, q, budget=budget, attention=config)
    assert set(kept) == ref_expected(kv, q, config, budget)


def test_expected_attention_needs_the_models_rope() -> None:
    """expected_attention without attention raises ValueError naming it."""
    with pytest.raises(ValueError, match="needs attention=AttentionConfig"):
        make_edit("expected_attention")


def test_rkv_scores_near_duplicate_keys_as_redundant() -> None:
    """Of keys repeated many times, rkv keeps fewer than their share."""
    kv, q = tensors(MHA, seed=4)
    kv[0, :, 5:25] = kv[0, :, 5:6]  # 20 copies of one key
    _, kept, _ = run("rkv", kv, q, budget=20, window=4, attention=MHA)
    assert len([p for p in kept if 5 <= p < 25]) < 10


@pytest.mark.parametrize("name", ["snapkv", "tova", "h2o"])
def test_gqa_equals_mha_over_repeated_kv_heads(name: str) -> None:
    """Grouped query heads select as full multi-head attention whose KV heads
    repeat each shared one for its group."""
    kv, q = tensors(GQA, seed=5)
    d, group = GQA.head_dim, GQA.group
    repeated = np.concatenate(
        [kv[..., (h // group) * d : (h // group + 1) * d] for h in range(GQA.q_heads)],
        axis=-1,
    )
    full = AttentionConfig(q_heads=6, kv_heads=6, head_dim=d)
    _, grouped, _ = run(name, kv, q, budget=12, attention=GQA)
    _, expanded, _ = run(name, repeated, q, budget=12, attention=full)
    assert grouped == expanded


# --- budgets and protected tokens ------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(
    name=st.sampled_from(sorted(DROPPING)),
    total=st.integers(12, 48),
    by_budget=st.booleans(),
    amount=st.integers(1, 48),
)
def test_the_asked_budget_is_kept_exactly(
    name: str, total: int, by_budget: bool, amount: int
) -> None:
    """Given keep or budget, every dropping edit keeps exactly that many tokens
    (raised to what it protects, at most T), with the documented first/last
    tokens among them."""
    kv, q = tensors(GQA, total=total, seed=amount)
    size = {"budget": amount} if by_budget else {"keep": amount / 48}
    params = {**DROPPING[name], **size, "attention": GQA}
    if name == "redundancy" or name == "pyscore":
        params.pop("attention")
    _, kept, _ = run(name, kv, q, **params)
    asked = amount if by_budget else budget_of(amount / 48, total)
    first = {
        "window": 2,
        "streamingllm": 2,
        "random": 2,
        "redundancy": 2,
        "pyscore": 2,
        "expected_attention": 4,
    }
    last = {
        "random": 2,
        "redundancy": 2,
        "pyscore": 2,
        "snapkv": 4,
        "rkv": 4,
        "tova": 1,
    }
    head_n, tail_n = first.get(name, 0), last.get(name, 0)
    if name == "h2o":
        tail_n = max(1, math.floor(0.5 * min(asked, total) + 0.5))
    expected = min(total, max(asked, head_n + tail_n))
    assert len(kept) == expected
    assert set(range(min(head_n, total))) <= set(kept)
    assert set(range(total - tail_n, total)) <= set(kept)
    if name in ("window", "streamingllm"):
        assert kept == [*range(head_n), *range(total - (expected - head_n), total)]


def test_keep_and_budget_together_are_refused() -> None:
    """An edit given both keep and budget raises ValueError naming both."""
    with pytest.raises(ValueError, match=r"'keep'.*'budget'"):
        make_edit("knorm", keep=0.5, budget=10)


@pytest.mark.parametrize("name", sorted(DROPPING))
def test_rerotate_without_attention_is_refused_at_construction(name: str) -> None:
    """rerotate=True without attention raises ValueError naming attention."""
    with pytest.raises(ValueError, match="rerotate=True needs attention"):
        make_edit(name, rerotate=True, **DROPPING[name])


def test_streamingllm_rerotates_by_default() -> None:
    """streamingllm without attention is refused: it rerotates by default."""
    with pytest.raises(ValueError, match="attention"):
        make_edit("streamingllm")


# --- rerotation, array types and dtypes -----------------------------------------


@pytest.mark.parametrize("name", sorted(DROPPING))
def test_rerotated_keys_sit_at_their_new_positions(name: str) -> None:
    """With rerotate, the kept keys are the kept rows moved from their old
    positions to 0..kept-1; values are the kept rows unchanged."""
    kv, q = tensors(GQA)
    params = {**DROPPING[name], "keep": 0.5}
    new_kv, kept, _ = run(name, kv, q, rerotate=True, attention=GQA, **params)
    expected = rerotate_keys(kv[:, :, kept], kept, range(len(kept)), GQA)
    np.testing.assert_array_equal(new_kv, expected)
    np.testing.assert_array_equal(new_kv[1], kv[1][:, kept])
    assert not np.array_equal(new_kv[0], kv[0][:, kept])


@pytest.mark.parametrize("name", sorted(DROPPING))
def test_shifted_keys_keep_their_distance_to_what_follows(name: str) -> None:
    """With rerotate="shift", a query decoded at position kept + j scores
    every kept key exactly as a query at T + j scored it in the whole KV:
    each key keeps its distance to the tokens after the prompt."""
    kv, q = tensors(GQA)
    total, heads, d = kv.shape[2], GQA.kv_heads, GQA.head_dim
    params = {**DROPPING[name], "keep": 0.5}
    new_kv, kept, _ = run(name, kv, q, rerotate="shift", attention=GQA, **params)
    raw_query = np.random.default_rng(1).standard_normal((3, heads * d))
    for layer in range(LAYERS):
        keys = kv[0, layer, kept].astype(np.float64).reshape(-1, heads, d)
        moved = new_kv[0, layer].astype(np.float64).reshape(-1, heads, d)
        for j in range(3):
            at = np.array([total + j, len(kept) + j])
            queries = direct_rope(np.stack([raw_query[j]] * 2), at, GQA)
            before = np.einsum("thd,hd->th", keys, queries[0].reshape(heads, d))
            after = np.einsum("thd,hd->th", moved, queries[1].reshape(heads, d))
            np.testing.assert_allclose(after, before, rtol=0, atol=1e-4)
    np.testing.assert_array_equal(new_kv[1], kv[1][:, kept])


@pytest.mark.parametrize("value", ["compact", "shift", True, False])
def test_rerotate_takes_a_bool_or_a_mode(value: Any) -> None:
    """rerotate accepts False, True, "compact" and "shift"; "compact" and True
    give the same KV."""
    kv, q = tensors(GQA)
    got, kept, _ = run("knorm", kv, q, rerotate=value, attention=GQA, keep=0.5)
    compact, same, _ = run("knorm", kv, q, rerotate=True, attention=GQA, keep=0.5)
    assert kept == same
    assert np.array_equal(got, compact) == (value in (True, "compact"))


def test_an_unknown_rerotate_mode_is_refused() -> None:
    """rerotate="original" raises ValueError listing the accepted values."""
    with pytest.raises(ValueError, match="'rerotate' must be a bool, 'compact' or"):
        make_edit("knorm", rerotate="original", attention=GQA)


@pytest.mark.parametrize("name", [*NEW_KV_ONLY, *NEW_WITH_QUERIES, "snapkv"])
def test_torch_input_selects_as_numpy(name: str) -> None:
    """Torch tensors in give the same tokens and KV as numpy arrays in."""
    kv, q = tensors(GQA, seed=6)
    params = {**DROPPING[name], "keep": 0.4, "attention": GQA}
    a_kv, a, _ = run(name, kv, q, **params)
    b_kv, b, _ = run(name, torch.from_numpy(kv), torch.from_numpy(q), **params)
    assert a == b
    np.testing.assert_array_equal(np.asarray(a_kv), np.asarray(b_kv))


@pytest.mark.parametrize("name", [*NEW_KV_ONLY, *NEW_WITH_QUERIES, "snapkv"])
def test_bfloat16_round_trips(name: str) -> None:
    """A bfloat16 torch KV comes back bfloat16, the kept rows bit-exact."""
    kv, q = tensors(GQA, seed=7)
    t_kv = torch.from_numpy(kv).to(torch.bfloat16)
    params = {**DROPPING[name], "keep": 0.4, "attention": GQA, "rerotate": False}
    new_kv, kept, _ = run(name, t_kv, torch.from_numpy(q).to(torch.bfloat16), **params)
    assert new_kv.dtype == ml_dtypes.bfloat16
    expected = t_kv[:, :, kept].float().numpy()
    np.testing.assert_array_equal(np.asarray(new_kv, dtype=np.float32), expected)


@pytest.mark.parametrize("name", NEW_WITH_QUERIES)
def test_query_edits_on_a_bare_kv_explain_the_query_context(name: str) -> None:
    """A query-scored edit given a bare KV raises CacheKindError naming QUERY."""
    from lmcache_mp.errors import CacheKindError

    kv, _ = tensors(GQA)
    with pytest.raises(CacheKindError, match=f"{name} needs.*QUERY"):
        make_edit(name, attention=GQA)(kv, ids(40))


def test_attention_of_another_width_is_named() -> None:
    """An AttentionConfig that does not fit the KV raises ValueError."""
    kv, q = tensors(GQA)
    with pytest.raises(ValueError, match="width"):
        run("knorm", kv, q, attention=MHA)
    with pytest.raises(ValueError, match="width"):
        run("tova", kv, q, attention=MHA)


def test_the_registries_name_the_new_edits() -> None:
    """knorm, keydiff, streamingllm take a bare KV; tova, h2o, rkv need queries."""
    assert set(NEW_KV_ONLY) <= set(EDITS)
    assert set(NEW_WITH_QUERIES) | {"snapkv"} <= set(KIND_EDITS)
    edits: list[Edit] = [make_edit(n, attention=GQA) for n in NEW_WITH_QUERIES]
    assert all(e.name == n for e, n in zip(edits, NEW_WITH_QUERIES, strict=True))
