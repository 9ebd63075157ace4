"""Specification of the ``snapkv`` edit: query-aware selection."""

from __future__ import annotations

import math
import pickle
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import torch

from lmcache_mp import LMCacheSDKCacheKind
from lmcache_mp.edits import (
    EDITS,
    H2O,
    KIND_EDITS,
    RKV,
    TOVA,
    RandomDrop,
    RecentWindow,
    SnapKV,
    keep_count,
    make_edit,
)
from lmcache_mp.errors import CacheKindError

KV, QUERY = LMCacheSDKCacheKind.KV, LMCacheSDKCacheKind.QUERY


def random_pair(
    tokens: int = 48,
    layers: int = 2,
    width: int = 8,
    seed: int = 0,
    extra: int = 0,
    dtype: Any = np.float32,
) -> tuple[np.ndarray, np.ndarray]:
    """A standard normal ``[2, L, T, D]`` KV and ``[1, L, T + extra, D]`` queries."""
    rng = np.random.default_rng(seed)
    kv = rng.standard_normal((2, layers, tokens, width)).astype(dtype)
    q = rng.standard_normal((1, layers, tokens + extra, width)).astype(dtype)
    return kv, q


def ids_of(count: int) -> list[int]:
    """``count`` token ids that are not their positions."""
    return [1000 + 7 * i for i in range(count)]


def kept_positions(new_tokens: list[int]) -> list[int]:
    """The positions of :func:`ids_of` tokens that an edit kept."""
    return [(t - 1000) // 7 for t in new_tokens]


def reference_selection(
    kv: np.ndarray,
    q: np.ndarray,
    keep: float,
    window: int,
    kernel: int,
    heads: int,
    pooling: str = "avg",
) -> list[int]:
    """The documented selection, computed one query and one key at a time."""
    _, layers, total, width = kv.shape
    budget = min(total, max(window, max(1, math.floor(keep * total + 0.5))))
    if budget >= total:
        return list(range(total))
    prefix, slots, dim = total - window, budget - window, width // heads
    picked = [0] * prefix
    summed = [0.0] * prefix
    for layer in range(layers):
        for head in range(heads):
            cols = slice(head * dim, (head + 1) * dim)
            votes = [0.0] * prefix
            for i in range(prefix, total):
                query = q[0, layer, i, cols].astype(np.float64)
                logits = [
                    float(query @ kv[0, layer, j, cols].astype(np.float64))
                    / math.sqrt(dim)
                    for j in range(i + 1)
                ]
                top = max(logits)
                weights = [math.exp(s - top) for s in logits]
                norm = sum(weights)
                for j in range(prefix):
                    votes[j] += weights[j] / norm
            pooled = []
            for j in range(prefix):
                span = [
                    votes[m] if 0 <= m < prefix else None
                    for m in range(j - kernel // 2, j + kernel // 2 + 1)
                ]
                if pooling == "avg":
                    pooled.append(sum(v or 0.0 for v in span) / kernel)
                else:
                    pooled.append(max(v for v in span if v is not None))
            best = sorted(range(prefix), key=lambda j: (pooled[j], j))[prefix - slots :]
            for j in best:
                picked[j] += 1
            for j in range(prefix):
                summed[j] += pooled[j]
    ranked = sorted(range(prefix), key=lambda j: (picked[j], summed[j], j))
    chosen = ranked[prefix - slots :]
    return sorted(chosen) + list(range(prefix, total))


def focused_pair(
    strong: dict[int, float], tokens: int = 40, window: int = 8, width: int = 8
) -> tuple[np.ndarray, np.ndarray]:
    """A one-layer KV whose window queries all point along the first channel,
    with keys along it at the positions of ``strong`` (scaled by its values)
    and zero keys elsewhere: attention is high exactly at those positions."""
    kv = np.zeros((2, 1, tokens, width), np.float32)
    kv[1] = np.random.default_rng(1).standard_normal((1, tokens, width))
    for pos, scale in strong.items():
        kv[0, 0, pos, 0] = scale
    q = np.zeros((1, 1, tokens, width), np.float32)
    q[0, 0, tokens - window :, 0] = 4.0
    return kv, q


# --- the selection -----------------------------------------------------------


@pytest.mark.parametrize(
    ("keep", "window", "kernel", "heads", "pooling"),
    [
        (0.5, 8, 5, 2, "avg"),
        (0.3, 6, 3, 4, "max"),
        (0.6, 4, 1, 1, "avg"),
        (0.4, 10, 7, 2, "max"),
    ],
)
def test_selection_matches_a_brute_force_reference(
    keep: float, window: int, kernel: int, heads: int, pooling: str
) -> None:
    """The kept positions are those of the documented per-head top-k and
    count-then-vote combination, computed query by query in plain Python."""
    kv, q = random_pair(tokens=40, layers=2, width=8, seed=3)
    edit = SnapKV(keep=keep, window=window, kernel=kernel, heads=heads, pooling=pooling)  # type: ignore[arg-type]
    _, new_tokens, _ = edit({KV: kv, QUERY: q}, ids_of(40))
    expected = reference_selection(kv, q, keep, window, kernel, heads, pooling)
    assert kept_positions(new_tokens) == expected


def test_one_head_is_the_top_k_of_the_pooled_votes() -> None:
    """With one layer and one head, the prefix kept is SnapKV's own top-k:
    here the three positions the window attends to, in order."""
    kv, q = focused_pair({5: 3.0, 17: 2.0, 29: 1.0})
    edit = SnapKV(keep=11 / 40, window=8, kernel=1)
    _, new_tokens, info = edit({KV: kv, QUERY: q}, ids_of(40))
    assert kept_positions(new_tokens) == [5, 17, 29, *range(32, 40)]
    assert info == {"kept": 11, "dropped": 29, "window": 8}


@pytest.mark.parametrize("keep", [0.05, 0.2, 0.5, 0.9])
def test_the_window_is_always_kept(keep: float) -> None:
    """The last ``window`` positions are kept whatever the budget."""
    kv, q = random_pair(tokens=64, seed=5)
    _, new_tokens, info = SnapKV(keep=keep, window=12, heads=2)(
        {KV: kv, QUERY: q}, ids_of(64)
    )
    assert kept_positions(new_tokens)[-12:] == list(range(52, 64))
    assert info["window"] == 12


def test_a_strongly_attended_key_is_kept_and_unattended_ones_dropped() -> None:
    """The key every window query attends to survives a budget of one
    prefix token; the zero keys, attended to least, are dropped."""
    kv, q = focused_pair({13: 3.0})
    _, new_tokens, _ = SnapKV(keep=9 / 40, window=8, kernel=1)(
        {KV: kv, QUERY: q}, ids_of(40)
    )
    assert kept_positions(new_tokens) == [13, *range(32, 40)]


def test_the_kept_rows_are_the_input_rows_in_order() -> None:
    """The new KV is the input's rows at the kept positions, K and V."""
    kv, q = random_pair(tokens=48, seed=2)
    new_kv, new_tokens, _ = SnapKV(keep=0.5, window=8, heads=2)(
        {KV: kv, QUERY: q}, ids_of(48)
    )
    positions = kept_positions(new_tokens)
    assert positions == sorted(positions)
    np.testing.assert_array_equal(new_kv, kv[:, :, positions])


@pytest.mark.parametrize("pooling", ["avg", "max"])
def test_pooling_spreads_a_selected_position_to_its_neighbours(pooling: str) -> None:
    """Unpooled, the prefix kept is the three attended keys; pooled over 3,
    the neighbours of the most attended key outscore the lesser keys."""
    kv, q = focused_pair({10: 3.0, 20: 2.0, 25: 1.5})
    tensors = {KV: kv, QUERY: q}
    unpooled = SnapKV(keep=11 / 40, window=8, kernel=1, pooling=pooling)  # type: ignore[arg-type]
    pooled = SnapKV(keep=11 / 40, window=8, kernel=3, pooling=pooling)  # type: ignore[arg-type]
    assert kept_positions(unpooled(tensors, ids_of(40))[1])[:3] == [10, 20, 25]
    assert kept_positions(pooled(tensors, ids_of(40))[1])[:3] == [9, 10, 11]


def test_window_queries_do_not_see_later_window_keys() -> None:
    """Attention is causal within the window: a key in the window that only
    the last query could see does not draw the earlier queries' attention
    away from the prefix (checked against the reference, which is causal)."""
    kv, q = random_pair(tokens=32, layers=1, width=4, seed=9)
    kv[0, 0, 31] = 50.0 * q[0, 0, 24:31].mean(axis=0)
    _, new_tokens, _ = SnapKV(keep=0.5, window=8, kernel=1)(
        {KV: kv, QUERY: q}, ids_of(32)
    )
    assert kept_positions(new_tokens) == reference_selection(kv, q, 0.5, 8, 1, 1)


# --- the budget --------------------------------------------------------------


@pytest.mark.parametrize("total", [37, 64, 101])
@pytest.mark.parametrize("keep", [0.1, 0.25, 0.5, 0.75])
def test_budget_equals_random_and_window_at_the_same_keep(
    total: int, keep: float
) -> None:
    """snapkv keeps as many tokens as ``random`` protecting the same window,
    and as ``window`` given ``window=budget - sinks``."""
    kv, q = random_pair(tokens=total, seed=total)
    tokens = ids_of(total)
    snap = SnapKV(keep=keep, window=4)({KV: kv, QUERY: q}, tokens)
    rand = RandomDrop(keep=keep, keep_first=0, keep_last=4)(kv, tokens)
    budget = keep_count(keep, total, 4)
    win = RecentWindow(window=budget - 2, sinks=2)(kv, tokens)
    assert len(snap[1]) == len(rand[1]) == len(win[1]) == budget
    assert snap[2]["kept"] == budget and snap[2]["dropped"] == total - budget


def test_a_window_larger_than_the_budget_is_kept_whole() -> None:
    """When the window alone exceeds ``round(keep * T)``, exactly the window
    is kept, as ``random`` keeps its protected tokens."""
    kv, q = random_pair(tokens=40)
    _, new_tokens, info = SnapKV(keep=0.1, window=10)({KV: kv, QUERY: q}, ids_of(40))
    assert kept_positions(new_tokens) == list(range(30, 40))
    assert info["kept"] == 10


@pytest.mark.parametrize(("total", "window"), [(20, 32), (32, 32), (40, 8)])
def test_a_short_sequence_is_kept_whole(total: int, window: int) -> None:
    """When the budget covers every token (T <= window, or keep=1), the KV
    comes back unchanged."""
    kv, q = random_pair(tokens=total)
    keep = 1.0 if total == 40 else 0.5
    new_kv, new_tokens, info = SnapKV(keep=keep, window=window)(
        {KV: kv, QUERY: q}, ids_of(total)
    )
    assert new_tokens == ids_of(total) and new_kv is kv
    assert info["dropped"] == 0


# --- inputs ------------------------------------------------------------------


def test_torch_tensors_give_the_numpy_result() -> None:
    """KV and queries as CPU torch tensors select what numpy arrays select."""
    kv, q = random_pair(seed=4)
    edit = SnapKV(keep=0.4, window=6, heads=2)
    want_kv, want_tokens, _ = edit({KV: kv, QUERY: q}, ids_of(48))
    got_kv, got_tokens, _ = edit(
        {KV: torch.from_numpy(kv), QUERY: torch.from_numpy(q)}, ids_of(48)
    )
    assert got_tokens == want_tokens
    np.testing.assert_array_equal(np.asarray(got_kv), want_kv)


@pytest.mark.parametrize(
    "dtype", [np.float16, ml_dtypes.bfloat16], ids=["float16", "bfloat16"]
)
def test_the_kv_dtype_is_kept(dtype: Any) -> None:
    """float16 and bfloat16 inputs give a KV of their own dtype."""
    kv, q = random_pair(dtype=dtype)
    new_kv, _, _ = SnapKV(keep=0.5, window=8)({KV: kv, QUERY: q}, ids_of(48))
    assert new_kv.dtype == np.dtype(dtype)


def test_queries_past_the_kv_are_ignored() -> None:
    """Queries of more tokens than the KV select with their first T rows."""
    kv, q = random_pair(extra=16, seed=6)
    edit = SnapKV(keep=0.5, window=8, heads=4)
    longer = edit({KV: kv, QUERY: q}, ids_of(48))[1]
    exact = edit({KV: kv, QUERY: q[:, :, :48]}, ids_of(48))[1]
    assert longer == exact


def test_make_edit_builds_snapkv_and_it_pickles() -> None:
    """make_edit("snapkv", ...) is a SnapKV, listed in KIND_EDITS (not in
    the single-kind EDITS), and it pickles to an equal edit."""
    edit = make_edit("snapkv", keep=0.3, window=16, kernel=7)
    assert edit == SnapKV(keep=0.3, window=16, kernel=7)
    assert KIND_EDITS["snapkv"] is SnapKV and "snapkv" not in EDITS
    assert pickle.loads(pickle.dumps(edit)) == edit


# --- errors ------------------------------------------------------------------


def test_a_bare_kv_raises_cache_kind_error_naming_the_query_context() -> None:
    """A single-kind stream's bare KV raises CacheKindError explaining how to
    give the stream a QUERY context."""
    kv, _ = random_pair()
    with pytest.raises(
        CacheKindError, match=r"QUERY.*create_request\(\[kv_ctx, query_ctx\]"
    ):
        SnapKV()(kv, ids_of(48))


def test_tensors_without_query_raise_cache_kind_error() -> None:
    """A mapping with the KV alone raises CacheKindError naming QUERY."""
    kv, _ = random_pair()
    with pytest.raises(CacheKindError, match=r"no QUERY.*kinds given: KV"):
        SnapKV()({KV: kv}, ids_of(48))


def test_tensors_without_kv_raise_cache_kind_error() -> None:
    """A mapping with the queries alone raises CacheKindError naming KV."""
    _, q = random_pair()
    with pytest.raises(CacheKindError, match="no KV"):
        SnapKV()({QUERY: q}, ids_of(48))


@pytest.mark.parametrize(
    "edit",
    [SnapKV(budget=20, window=8), TOVA(budget=20), RKV(budget=20, window=8)],
    ids=["snapkv", "tova", "rkv"],
)
def test_queries_of_the_last_positions_choose_as_all_of_them(edit: Any) -> None:
    """Queries of the last positions only (a stream modified again after a
    decode has those) choose what the whole prompt's queries choose, where
    the edit reads no more than its window of them."""
    kv, q = random_pair()
    whole = edit({KV: kv, QUERY: q}, ids_of(48))
    latest = edit({KV: kv, QUERY: q[:, :, -12:]}, ids_of(48))
    assert latest[1] == whole[1]
    np.testing.assert_array_equal(latest[0], whole[0])


def test_h2o_scores_with_the_last_positions_queries_alone() -> None:
    """Given the queries of the last positions only, H2O sums the attention
    those queries pay, each seeing the keys up to its own position."""
    kv, q = random_pair()
    rows = q[:, :, -20:]
    edit = H2O(budget=16, block=8)
    expected = np.zeros(48)
    for layer in range(kv.shape[1]):
        k, qh = edit.split_heads(kv[0, layer], rows[0, layer])
        logits = np.einsum("hgwd,htd->hgwt", qh, k) / math.sqrt(k.shape[-1])
        # Query i sits at position 28 + i and sees keys 0 .. 28 + i.
        logits[..., np.arange(48)[None, :] > np.arange(28, 48)[:, None]] = -np.inf
        probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)
        expected += probs.sum(axis=(0, 1, 2))
    np.testing.assert_allclose(edit._scores(kv, rows), expected, rtol=1e-5)


def test_queries_of_no_position_raise() -> None:
    """An empty query tensor raises ValueError."""
    kv, q = random_pair()
    with pytest.raises(ValueError, match="queries cover no token"):
        SnapKV()({KV: kv, QUERY: q[:, :, :0]}, ids_of(48))


@pytest.mark.parametrize(
    ("shape", "needle"),
    [
        ((1, 3, 48, 8), "3 layers of width 8, but the KV has 2 of width 8"),
        ((1, 2, 48, 6), "2 layers of width 6, but the KV has 2 of width 8"),
        ((2, 2, 48, 8), r"expected 4-D \[1, layers"),
        ((2, 48, 8), r"expected 4-D \[1, layers"),
    ],
)
def test_queries_of_another_layout_raise(shape: tuple[int, ...], needle: str) -> None:
    """Queries whose planes, layers or width do not match the KV raise
    ValueError saying what differs."""
    kv, _ = random_pair()
    with pytest.raises(ValueError, match=needle):
        SnapKV()({KV: kv, QUERY: np.zeros(shape, np.float32)}, ids_of(48))


def test_a_kv_of_the_wrong_length_raises() -> None:
    """A KV whose token axis is not len(tokens) raises ValueError."""
    kv, q = random_pair()
    with pytest.raises(ValueError, match="48 tokens on axis 2 but 47"):
        SnapKV()({KV: kv, QUERY: q}, ids_of(47))


def test_heads_that_do_not_divide_the_width_raise() -> None:
    """heads=3 for a width of 8 raises ValueError naming 'heads'."""
    kv, q = random_pair()
    with pytest.raises(ValueError, match=r"'heads' is 3.*width 8"):
        SnapKV(heads=3)({KV: kv, QUERY: q}, ids_of(48))


@pytest.mark.parametrize(
    ("params", "name"),
    [
        ({"keep": 0}, "keep"),
        ({"keep": 1.5}, "keep"),
        ({"window": 0}, "window"),
        ({"kernel": 0}, "kernel"),
        ({"kernel": 4}, "kernel"),
        ({"pooling": "mean"}, "pooling"),
        ({"heads": 0}, "heads"),
        ({"window": True}, "window"),
    ],
)
def test_a_bad_parameter_raises_naming_it(params: dict[str, Any], name: str) -> None:
    """An out-of-range parameter raises ValueError at construction, naming it."""
    with pytest.raises(ValueError, match=f"'{name}'"):
        make_edit("snapkv", **params)
