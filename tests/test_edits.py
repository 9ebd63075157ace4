"""Specification of the ready-made modify fns in ``lmcache_mp.edits``."""

from __future__ import annotations

import math
import multiprocessing
import pickle
import tracemalloc
import warnings
from concurrent.futures import ProcessPoolExecutor
from typing import Any, Literal

import cloudpickle
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_mp.edits import (
    EDITS,
    Edit,
    PyTokenScorer,
    Quantize,
    RandomDrop,
    RecentWindow,
    RedundancyDrop,
    Stride,
    _redundancy,
    keep_indices,
    make_edit,
)

T = 64
# Parameters that make every edit do real work on a T-token KV.
SMALL: dict[str, dict[str, Any]] = {
    "random": {"keep": 0.5, "keep_first": 4, "keep_last": 4, "seed": 3},
    "window": {"window": 16, "sinks": 2},
    "redundancy": {"keep": 0.5, "keep_first": 4, "keep_last": 4},
    "quantize": {"bits": 4, "group_size": 8},
    "pyscore": {"keep": 0.5, "keep_first": 4, "keep_last": 4, "work": 2, "span": 8},
    "identity": {},
    "stride": {"every": 3},
    "knorm": {"keep": 0.5, "keep_first": 2, "keep_last": 2},
    "keydiff": {"keep": 0.5, "keep_first": 2, "keep_last": 2},
    "streamingllm": {"keep": 0.5, "sinks": 2, "rerotate": False},
}
NAMES = sorted(EDITS)
# Edits that keep a subset of the tokens and leave the kept rows untouched.
SELECTING = [n for n in NAMES if n != "quantize"]
Reduce = Literal["max", "mean"]
DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16]


def random_kv(
    tokens: int = T, layers: int = 3, width: int = 16, seed: int = 0, dtype: Any = None
) -> np.ndarray:
    """A [2, L, T, D] KV of standard normal values."""
    kv = np.random.default_rng(seed).standard_normal((2, layers, tokens, width))
    return kv.astype(dtype or np.float32)


def distinct_tokens(count: int = T, seed: int = 0) -> list[int]:
    """``count`` distinct token ids, shuffled so that ids are not positions."""
    ids: list[int] = np.random.default_rng(seed).permutation(1000 + count).tolist()
    return ids[:count]


def small_edit(name: str) -> Edit:
    """The edit ``name`` with the SMALL parameters."""
    return make_edit(name, **SMALL[name])


def run_in_child(edit: Edit, kv: np.ndarray, tokens: list[int]) -> list[int]:
    """Run ``edit`` and return the kept tokens (a spawned child's task)."""
    return edit(kv, tokens)[1]


# --- the contract every edit keeps ------------------------------------------


def test_registry_has_the_documented_names() -> None:
    """EDITS maps exactly the ten documented names to their edit classes."""
    assert set(EDITS) == {
        "random",
        "window",
        "redundancy",
        "quantize",
        "pyscore",
        "identity",
        "stride",
        "knorm",
        "keydiff",
        "streamingllm",
    }
    assert all(cls.name == name for name, cls in EDITS.items())


@pytest.mark.parametrize("name", NAMES)
def test_output_is_4d_with_one_row_per_new_token(name: str) -> None:
    """The new KV is [2, L, T', D] with T' == len(new_tokens)."""
    kv = random_kv()
    new_kv, new_tokens, _ = small_edit(name)(kv, distinct_tokens())
    assert new_kv.ndim == 4
    assert new_kv.shape[:2] == kv.shape[:2]
    assert new_kv.shape[3] == kv.shape[3]
    assert new_kv.shape[2] == len(new_tokens)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("name", NAMES)
def test_dtype_is_preserved(name: str, dtype: Any) -> None:
    """The new KV has the input's dtype (float32, float16, bfloat16)."""
    new_kv, _, _ = small_edit(name)(random_kv(dtype=dtype), distinct_tokens())
    assert new_kv.dtype == np.dtype(dtype)


@pytest.mark.parametrize("name", SELECTING)
def test_new_tokens_are_an_ordered_subsequence(name: str) -> None:
    """Kept tokens are input tokens, each once, in their original order."""
    tokens = distinct_tokens()
    _, new_tokens, _ = small_edit(name)(random_kv(), tokens)
    position = {tok: i for i, tok in enumerate(tokens)}
    kept = [position[tok] for tok in new_tokens]
    assert kept == sorted(set(kept))


@pytest.mark.parametrize("name", SELECTING)
def test_kv_rows_follow_their_tokens(name: str) -> None:
    """Row j of the new KV is the input row of the token new_tokens[j]."""
    tokens = distinct_tokens()
    kv = random_kv()
    new_kv, new_tokens, _ = small_edit(name)(kv, tokens)
    position = {tok: i for i, tok in enumerate(tokens)}
    kept = [position[tok] for tok in new_tokens]
    np.testing.assert_array_equal(new_kv, kv[:, :, kept])


@pytest.mark.parametrize("name", NAMES)
def test_edit_pickles_by_reference(name: str) -> None:
    """An edit pickles as a reference to its class plus its fields."""
    edit = small_edit(name)
    for data in (pickle.dumps(edit), cloudpickle.dumps(edit)):
        assert len(data) < 512
        assert type(edit).__module__.encode() in data
        assert pickle.loads(data) == edit


@pytest.mark.parametrize("name", NAMES)
def test_result_is_deterministic_across_calls_and_pickling(name: str) -> None:
    """Calling twice, or after a pickle round trip, gives the same result."""
    edit = small_edit(name)
    kv, tokens = random_kv(), distinct_tokens()
    first = edit(kv, tokens)
    for again in (edit(kv, tokens), pickle.loads(pickle.dumps(edit))(kv, tokens)):
        np.testing.assert_array_equal(again[0], first[0])
        assert again[1] == first[1]
        assert again[2] == first[2]


@pytest.mark.parametrize("name", NAMES)
def test_info_counts_tokens_and_pickles(name: str) -> None:
    """info is a small picklable dict whose kept/dropped add up to T."""
    _, new_tokens, info = small_edit(name)(random_kv(), distinct_tokens())
    assert info["kept"] == len(new_tokens)
    assert info["kept"] + info["dropped"] == T
    data = pickle.dumps(info)
    assert len(data) < 512
    assert pickle.loads(data) == info


@pytest.mark.parametrize("name", NAMES)
def test_token_count_mismatch_is_rejected(name: str) -> None:
    """A KV whose token axis differs from len(tokens) raises ValueError."""
    with pytest.raises(ValueError, match="63 token ids"):
        small_edit(name)(random_kv(), distinct_tokens()[:-1])


@pytest.mark.parametrize("name", NAMES)
def test_kv_that_is_not_4d_is_rejected(name: str) -> None:
    """A KV that is not [2, L, T, D] raises ValueError naming its shape."""
    with pytest.raises(ValueError, match=r"\(3, 64, 16\)"):
        small_edit(name)(random_kv()[0], distinct_tokens())


# --- parameters and the registry --------------------------------------------

INVALID = [
    ("random", {"keep": 0}, "keep"),
    ("random", {"keep": 1.5}, "keep"),
    ("random", {"keep": math.nan}, "keep"),
    ("random", {"keep": "half"}, "keep"),
    ("random", {"keep_first": -1}, "keep_first"),
    ("random", {"keep_last": 2.5}, "keep_last"),
    ("random", {"seed": -1}, "seed"),
    ("random", {"seed": True}, "seed"),
    ("window", {"window": 0}, "window"),
    ("window", {"sinks": -1}, "sinks"),
    ("redundancy", {"layers": []}, "layers"),
    ("redundancy", {"layers": [1, 1]}, "layers"),
    ("redundancy", {"layers": "0"}, "layers"),
    ("redundancy", {"heads": 0}, "heads"),
    ("redundancy", {"reduce": "min"}, "reduce"),
    ("quantize", {"bits": 1}, "bits"),
    ("quantize", {"bits": 17}, "bits"),
    ("quantize", {"group_size": 0}, "group_size"),
    ("pyscore", {"work": 0}, "work"),
    ("pyscore", {"span": 0}, "span"),
    ("pyscore", {"layers": ()}, "layers"),
    ("stride", {"every": 0}, "every"),
]


@pytest.mark.parametrize(("name", "params", "param"), INVALID)
def test_invalid_parameter_is_rejected_by_name(
    name: str, params: dict[str, Any], param: str
) -> None:
    """An out-of-range parameter raises ValueError naming that parameter."""
    with pytest.raises(ValueError, match=f"'{param}'"):
        make_edit(name, **params)


def test_make_edit_unknown_name_lists_known_names() -> None:
    """make_edit with an unknown name raises ValueError listing every name."""
    with pytest.raises(ValueError, match="nope") as info:
        make_edit("nope")
    assert all(name in str(info.value) for name in EDITS)


def test_make_edit_unknown_parameter_is_named() -> None:
    """make_edit with a foreign parameter raises TypeError naming it."""
    with pytest.raises(TypeError, match=r"'windw'.*sinks, window"):
        make_edit("window", windw=8)


def test_make_edit_builds_the_registered_class() -> None:
    """make_edit returns an instance of EDITS[name] with the given fields."""
    edit = make_edit("quantize", bits=6)
    assert edit == Quantize(bits=6)


def test_layers_given_as_a_list_keep_the_edit_hashable() -> None:
    """A layers list is stored as a tuple: the edit hashes and compares."""
    edit = RedundancyDrop(layers=[0, 2])
    assert edit == RedundancyDrop(layers=(0, 2))
    assert hash(edit) == hash(RedundancyDrop(layers=(0, 2)))


# --- keep_indices ------------------------------------------------------------


def test_keep_indices_gathers_rows_and_tokens() -> None:
    """keep_indices keeps the given positions of the KV and of the tokens."""
    kv, tokens = random_kv(), distinct_tokens()
    new_kv, new_tokens = keep_indices(kv, tokens, [0, 5, 63])
    np.testing.assert_array_equal(new_kv, kv[:, :, [0, 5, 63]])
    assert new_tokens == [tokens[0], tokens[5], tokens[63]]


@pytest.mark.parametrize(
    "idx",
    [[3, 1], [2, 2], [-1, 4], [0, 64], [[1, 2]], [0.0, 1.0]],
    ids=["unsorted", "duplicate", "negative", "past-end", "2-d", "float"],
)
def test_keep_indices_rejects_bad_positions(idx: Any) -> None:
    """Positions must be 1-D ints, strictly increasing, within [0, T)."""
    with pytest.raises(ValueError, match="idx"):
        keep_indices(random_kv(), distinct_tokens(), idx)


# --- RandomDrop --------------------------------------------------------------


def test_random_drop_keeps_ends_and_the_keep_fraction() -> None:
    """RandomDrop keeps first/last tokens and round(keep * T) in all."""
    tokens = distinct_tokens(1000)
    _, new_tokens, _ = RandomDrop(keep=0.3, keep_first=16, keep_last=8)(
        random_kv(1000, layers=1, width=2), tokens
    )
    assert len(new_tokens) == 300
    assert new_tokens[:16] == tokens[:16]
    assert new_tokens[-8:] == tokens[-8:]


@settings(max_examples=60, deadline=None)
@given(
    total=st.integers(1, 300),
    keep=st.floats(0.01, 1.0),
    keep_first=st.integers(0, 40),
    keep_last=st.integers(0, 40),
)
def test_random_drop_count_for_any_length(
    total: int, keep: float, keep_first: int, keep_last: int
) -> None:
    """Kept = round(keep*T) (at least 1), raised to the protected ends, <= T."""
    tokens = distinct_tokens(total)
    edit = RandomDrop(keep=keep, keep_first=keep_first, keep_last=keep_last)
    _, new_tokens, _ = edit(random_kv(total, layers=1, width=2), tokens)
    target = max(1, math.floor(keep * total + 0.5))
    assert len(new_tokens) == min(total, max(target, keep_first + keep_last))
    head = min(keep_first, total)
    tail = min(keep_last, total)
    assert new_tokens[:head] == tokens[:head]
    assert new_tokens[len(new_tokens) - tail :] == tokens[total - tail :]


def test_random_drop_keeps_all_of_a_short_sequence() -> None:
    """With T <= keep_first + keep_last, RandomDrop keeps every token."""
    tokens = distinct_tokens(20)
    kv = random_kv(20)
    new_kv, new_tokens, info = RandomDrop(keep=0.1, keep_first=10, keep_last=10)(
        kv, tokens
    )
    assert new_tokens == tokens
    np.testing.assert_array_equal(new_kv, kv)
    assert info == {"kept": 20, "dropped": 0}


def test_random_drop_choice_depends_on_seed() -> None:
    """Two seeds choose different middle tokens."""
    kv, tokens = random_kv(200), distinct_tokens(200)
    a = RandomDrop(keep_first=4, keep_last=4, seed=1)(kv, tokens)[1]
    b = RandomDrop(keep_first=4, keep_last=4, seed=2)(kv, tokens)[1]
    assert a != b


def test_random_drop_choice_depends_on_tokens() -> None:
    """The same seed chooses different positions for a different prompt."""
    kv = random_kv(200)
    edit = RandomDrop(keep_first=4, keep_last=4)
    tokens_a, tokens_b = distinct_tokens(200, seed=1), distinct_tokens(200, seed=2)
    pos_a = {t: i for i, t in enumerate(tokens_a)}
    pos_b = {t: i for i, t in enumerate(tokens_b)}
    kept_a = [pos_a[t] for t in edit(kv, tokens_a)[1]]
    kept_b = [pos_b[t] for t in edit(kv, tokens_b)[1]]
    assert kept_a != kept_b


def test_random_drop_ignores_call_order() -> None:
    """A stream's choice is the same whatever was edited before it."""
    kv, tokens = random_kv(200), distinct_tokens(200)
    fresh = RandomDrop(keep_first=4, keep_last=4)(kv, tokens)[1]
    edit = RandomDrop(keep_first=4, keep_last=4)
    edit(random_kv(300), distinct_tokens(300, seed=9))
    assert edit(kv, tokens)[1] == fresh


def test_random_drop_same_choice_in_a_spawned_process() -> None:
    """A fresh spawned interpreter chooses the same tokens as this one."""
    kv, tokens = random_kv(200), distinct_tokens(200)
    edit = RandomDrop(keep_first=4, keep_last=4, seed=5)
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
        remote = pool.submit(run_in_child, edit, kv, tokens).result(timeout=60)
    assert remote == edit(kv, tokens)[1]


# --- RecentWindow ------------------------------------------------------------


def test_recent_window_keeps_sinks_and_window() -> None:
    """RecentWindow keeps exactly the first sinks and the last window tokens."""
    tokens = distinct_tokens()
    _, new_tokens, info = RecentWindow(window=10, sinks=3)(random_kv(), tokens)
    assert new_tokens == tokens[:3] + tokens[-10:]
    assert info == {"kept": 13, "dropped": T - 13}


def test_recent_window_without_sinks_keeps_only_the_window() -> None:
    """With sinks=0, RecentWindow keeps the last window tokens only."""
    tokens = distinct_tokens()
    _, new_tokens, _ = RecentWindow(window=5, sinks=0)(random_kv(), tokens)
    assert new_tokens == tokens[-5:]


def test_recent_window_keeps_all_of_a_short_sequence() -> None:
    """A sequence of at most sinks + window tokens is kept whole."""
    tokens = distinct_tokens()
    _, new_tokens, _ = RecentWindow(window=T - 4, sinks=4)(random_kv(), tokens)
    assert new_tokens == tokens


# --- Stride ------------------------------------------------------------------


@pytest.mark.parametrize("every", [1, 2, 5, T + 1])
def test_stride_keeps_every_nth_token_from_the_first(every: int) -> None:
    """Stride keeps positions 0, every, 2*every, ... with their KV rows."""
    kv, tokens = random_kv(), distinct_tokens()
    new_kv, new_tokens, info = Stride(every=every)(kv, tokens)
    assert new_tokens == tokens[::every]
    np.testing.assert_array_equal(new_kv, kv[:, :, ::every])
    assert info == {"kept": len(new_tokens), "dropped": T - len(new_tokens)}


# --- RedundancyDrop ----------------------------------------------------------


def orthogonal_keys(tokens: int, width: int, layers: int = 1) -> np.ndarray:
    """A KV whose keys are distinct basis vectors (pairwise orthogonal)."""
    kv = np.zeros((2, layers, tokens, width), dtype=np.float32)
    kv[0, :, np.arange(tokens), np.arange(tokens)] = 1.0
    kv[1] = np.random.default_rng(0).standard_normal(kv[1].shape)
    return kv


def dropped_positions(edit: Edit, kv: np.ndarray) -> set[int]:
    """Positions ``edit`` drops from ``kv`` (tokens are the positions)."""
    tokens = list(range(kv.shape[2]))
    return set(tokens) - set(edit(kv, tokens)[1])


@pytest.mark.parametrize("reduce", ["max", "mean"])
def test_redundancy_drops_a_duplicate_before_unique_tokens(reduce: Reduce) -> None:
    """Of a pair of identical keys, one goes before any distinct key."""
    kv = orthogonal_keys(16, 16)
    kv[0, 0, 9] = 3.0 * kv[0, 0, 4]
    edit = RedundancyDrop(keep=15 / 16, keep_first=0, keep_last=0, reduce=reduce)
    dropped = dropped_positions(edit, kv)
    assert len(dropped) == 1
    assert dropped <= {4, 9}


@pytest.mark.parametrize(
    ("reduce", "heads", "layers"),
    [("max", None, None), ("mean", None, None), ("max", 2, (0, 2)), ("mean", 4, (1,))],
)
def test_redundancy_keeps_the_least_redundant_tokens(
    reduce: Reduce, heads: int | None, layers: tuple[int, ...] | None
) -> None:
    """Kept middle tokens are the least redundant by a brute-force numpy score."""
    kv = random_kv(layers=3, width=16)
    edit = RedundancyDrop(
        keep=0.5, keep_first=3, keep_last=5, layers=layers, heads=heads, reduce=reduce
    )
    _, new_tokens, _ = edit(kv, list(range(T)))
    h = heads or 1
    keys = kv[0, list(layers or range(3))].astype(np.float64)
    keys = keys.reshape(keys.shape[0], T, h, 16 // h).transpose(0, 2, 1, 3)
    keys /= np.linalg.norm(keys, axis=-1, keepdims=True)
    sim = keys @ keys.transpose(0, 1, 3, 2)
    if reduce == "max":
        sim[..., np.arange(T), np.arange(T)] = -np.inf
        score = sim.max(axis=-1).mean(axis=(0, 1))
    else:
        sim[..., np.arange(T), np.arange(T)] = 0.0
        score = (sim.sum(axis=-1) / (T - 1)).mean(axis=(0, 1))
    middle = np.arange(3, T - 5)
    least = middle[np.argsort(score[middle])[: 32 - 8]]
    assert new_tokens == [*range(3), *sorted(least.tolist()), *range(T - 5, T)]


def test_redundancy_scores_only_the_given_layers() -> None:
    """With layers=(l,), only layer l's duplicate decides what is dropped."""
    kv = orthogonal_keys(16, 16, layers=2)
    kv[0, 0, 9] = kv[0, 0, 4]
    kv[0, 1, 12] = kv[0, 1, 2]
    keep: dict[str, Any] = {"keep": 15 / 16, "keep_first": 0, "keep_last": 0}
    assert dropped_positions(RedundancyDrop(layers=(0,), **keep), kv) <= {4, 9}
    assert dropped_positions(RedundancyDrop(layers=(-1,), **keep), kv) <= {2, 12}


def test_redundancy_compares_heads_separately() -> None:
    """With heads, keys alike in one head are redundant though not overall."""
    kv = orthogonal_keys(8, 16)
    kv[0, 0, :, 8:] = kv[0, 0, :, :8]
    # Token 5 repeats token 2 in head 0 and opposes it in head 1, so the
    # whole keys are orthogonal.
    kv[0, 0, 5] = np.concatenate([kv[0, 0, 2, :8], -kv[0, 0, 2, :8]])
    keep: dict[str, Any] = {"keep": 7 / 8, "keep_first": 0, "keep_last": 0}
    assert dropped_positions(RedundancyDrop(heads=2, **keep), kv) <= {2, 5}
    assert not dropped_positions(RedundancyDrop(**keep), kv) & {2, 5}


def test_redundancy_keeps_protected_ends_despite_duplicates() -> None:
    """Protected first/last tokens stay even when they are duplicates."""
    kv = orthogonal_keys(16, 16)
    kv[0, 0, 1] = kv[0, 0, 0]
    kv[0, 0, 14] = kv[0, 0, 15]
    edit = RedundancyDrop(keep=0.5, keep_first=2, keep_last=2)
    assert not dropped_positions(edit, kv) & {0, 1, 14, 15}


def test_redundancy_handles_zero_keys_without_warnings() -> None:
    """All-zero keys (similar to nothing) raise no NaN warning."""
    kv = np.zeros((2, 2, 32, 8), dtype=np.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, new_tokens, _ = RedundancyDrop(keep_first=2, keep_last=2)(
            kv, list(range(32))
        )
    assert len(new_tokens) == 16


@pytest.mark.parametrize("block", [1 << 20, 97 * 40, 40])
@pytest.mark.parametrize(("lo", "hi"), [(0, 97), (5, 90), (60, 61)])
def test_redundancy_max_is_each_tokens_closest_other_token(
    monkeypatch: pytest.MonkeyPatch, block: int, lo: int, hi: int
) -> None:
    """Computed over half the similarity matrix, block by block, a token's
    "max" redundancy is still its largest similarity to any other token:
    the full matrix's row maximum off the diagonal, whatever the blocks."""
    monkeypatch.setattr(_redundancy, "_BLOCK_ELEMENTS", block)
    keys = np.random.default_rng(3).standard_normal((97, 12)).astype(np.float32)
    keys[40] = keys[7]
    full = keys.astype(np.float64) @ keys.T.astype(np.float64)
    np.fill_diagonal(full, -np.inf)
    got = _redundancy._max_similarity(keys, lo, hi)
    np.testing.assert_allclose(got, full.max(axis=1)[lo:hi], rtol=1e-5)


def test_redundancy_holds_one_layers_float32_keys_at_a_time() -> None:
    """Scoring converts the keys to float32 a layer at a time: beside its
    result, the edit allocates well under the float32 keys of every layer
    (512 MiB more per Llama-3-8B stream). The KV is untouched."""
    kv = np.random.default_rng(0).standard_normal((2, 64, 512, 64))
    kv = kv.astype(np.float16)
    before = kv.copy()
    edit = RedundancyDrop(keep=0.5, keep_first=8, keep_last=8)
    tracemalloc.start()
    try:
        new_kv, _, _ = edit(kv, list(range(512)))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    all_keys = kv[0].size * np.dtype(np.float32).itemsize
    assert peak < new_kv.nbytes + all_keys / 4
    assert kv.tobytes() == before.tobytes()


def test_redundancy_rejects_layers_out_of_range() -> None:
    """A layer index beyond the KV's layers raises ValueError naming layers."""
    with pytest.raises(ValueError, match=r"'layers'.*3 layers"):
        RedundancyDrop(layers=(3,), keep_first=0, keep_last=0)(
            random_kv(), distinct_tokens()
        )


def test_redundancy_rejects_heads_not_dividing_width() -> None:
    """heads that does not divide the width raises ValueError naming heads."""
    with pytest.raises(ValueError, match=r"'heads'.*width 16"):
        RedundancyDrop(heads=3, keep_first=0, keep_last=0)(
            random_kv(), distinct_tokens()
        )


# --- Quantize ----------------------------------------------------------------


def group_bound(kv: np.ndarray, bits: int, group_size: int) -> np.ndarray:
    """The per-value error bound: half the scale of the value's group."""
    width = kv.shape[3]
    groups = -(-width // group_size)
    padded = np.zeros((*kv.shape[:3], groups * group_size), dtype=np.float64)
    padded[..., :width] = kv
    amax = np.abs(padded.reshape(*kv.shape[:3], groups, group_size)).max(axis=-1)
    scale = amax / (2 ** (bits - 1) - 1)
    return np.repeat(scale / 2, group_size, axis=-1)[..., :width]


@pytest.mark.parametrize(("bits", "group_size"), [(2, 4), (4, 8), (8, 5), (8, 16)])
def test_quantize_error_is_within_half_a_group_scale(
    bits: int, group_size: int
) -> None:
    """Each value moves by at most scale/2 of its group (float32 input)."""
    kv = random_kv()
    new_kv, _, _ = Quantize(bits=bits, group_size=group_size)(kv, distinct_tokens())
    err = np.abs(new_kv.astype(np.float64) - kv)
    assert np.all(err <= group_bound(kv, bits, group_size) * (1 + 1e-6))


@pytest.mark.parametrize("bits", [2, 3, 5])
def test_quantize_uses_at_most_the_levels_bits_allow(bits: int) -> None:
    """Each group takes at most 2**bits - 1 distinct values (symmetric)."""
    kv = random_kv(tokens=8, width=64)
    new_kv, _, _ = Quantize(bits=bits, group_size=64)(kv, distinct_tokens(8))
    rows = new_kv.reshape(-1, 64)
    assert max(len(np.unique(row)) for row in rows) <= 2**bits - 1


def test_quantize_leaves_tokens_unchanged() -> None:
    """Quantize returns the same tokens and the same shape."""
    kv, tokens = random_kv(), distinct_tokens()
    new_kv, new_tokens, _ = Quantize()(kv, tokens)
    assert new_tokens == tokens
    assert new_kv.shape == kv.shape


def test_quantize_reports_its_max_abs_error() -> None:
    """info['max_abs_error'] is the largest change of any value."""
    kv = random_kv(dtype=np.float16)
    new_kv, _, info = Quantize(bits=3, group_size=4)(kv, distinct_tokens())
    actual = np.abs(new_kv.astype(np.float32) - kv.astype(np.float32)).max()
    assert info["max_abs_error"] == pytest.approx(float(actual))
    assert info["max_abs_error"] > 0


def test_quantize_more_bits_means_less_error() -> None:
    """The reported error shrinks as bits grow."""
    kv, tokens = random_kv(), distinct_tokens()
    errors = [Quantize(bits=b)(kv, tokens)[2]["max_abs_error"] for b in (2, 4, 8, 16)]
    assert errors == sorted(errors, reverse=True)
    assert len(set(errors)) == 4


def test_quantize_keeps_zero_groups_zero() -> None:
    """A group of zeros stays zeros (no division by a zero scale)."""
    kv = random_kv()
    kv[:, :, :, :8] = 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        new_kv, _, _ = Quantize(group_size=8)(kv, distinct_tokens())
    assert np.all(new_kv[:, :, :, :8] == 0.0)


# --- PyTokenScorer -----------------------------------------------------------


def test_pyscore_keeps_the_top_scored_tokens() -> None:
    """Kept middle tokens are those with the largest key L1 norm (numpy)."""
    kv = random_kv(layers=3, width=16)
    tokens = list(range(T))
    edit = PyTokenScorer(
        keep=0.5, keep_first=4, keep_last=6, work=3, layers=(0, -1), span=5
    )
    _, new_tokens, _ = edit(kv, tokens)
    score = np.abs(kv[0, [0, 2], :, :5].astype(np.float64)).sum(axis=(0, 2))
    middle = np.arange(4, T - 6)
    top = middle[np.argsort(score[middle])[-(32 - 10) :]]
    expected = [*range(4), *sorted(top.tolist()), *range(T - 6, T)]
    assert new_tokens == expected


def test_pyscore_rejects_layers_out_of_range() -> None:
    """A layer index beyond the KV's layers raises ValueError naming layers."""
    with pytest.raises(ValueError, match="'layers'"):
        PyTokenScorer(layers=(-4,), keep_first=0, keep_last=0)(
            random_kv(), distinct_tokens()
        )
