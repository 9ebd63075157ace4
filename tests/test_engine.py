"""The embedded engine: exact cache reuse, sampling, vocabulary, pickling."""

from __future__ import annotations

import multiprocessing
import pickle
import re
import threading
import tracemalloc
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from lmcache_mp.engine import EmbeddedEngine, EngineConfig, EngineStats, ToyVocab
from lmcache_mp.engine._model import KVSequence, weights_for
from lmcache_mp.errors import KVConfigError, SamplingParamsError, StreamInputError
from lmcache_mp.stream import TokenEvent, create_request
from tests._fakes import InMemoryKV

CHUNK = 16
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}
SEEDED: dict[str, Any] = {"temperature": 1.0, "seed": 7, "max_tokens": 12}
SEEDED_ALL: dict[str, Any] = {**SEEDED, "ignore_eos": True}


class NoKV:
    """A picklable context that caches nothing."""

    chunk_size = CHUNK

    def retrieve(self, tokens: Sequence[int], cache_salt: str = "") -> None:
        return None

    def store(
        self, kv: np.ndarray, tokens: Sequence[int], cache_salt: str = ""
    ) -> bool:
        return False


class RecordingKV(InMemoryKV):
    """An in-memory context that counts the calls it gets."""

    def __init__(self, chunk_size: int = CHUNK) -> None:
        super().__init__(chunk_size)
        self.retrieves = 0
        self.stores = 0

    def retrieve(
        self, tokens: Sequence[int], cache_salt: str = ""
    ) -> np.ndarray | None:
        self.retrieves += 1
        return super().retrieve(tokens, cache_salt)

    def store(
        self, kv: np.ndarray, tokens: Sequence[int], cache_salt: str = ""
    ) -> bool:
        self.stores += 1
        return super().store(kv, tokens, cache_salt)


def prompt_of(length: int, seed: int = 0) -> list[int]:
    """A random prompt of vocabulary ids (never the default EOS id 0)."""
    return np.random.default_rng(seed).integers(1, 512, length).tolist()


def run(
    engine: EmbeddedEngine, prompt: list[int], params: dict[str, Any], salt: str = ""
) -> list[TokenEvent]:
    """All events of one call."""
    return list(engine(prompt, params, salt))


def ids(events: list[TokenEvent]) -> list[int]:
    """The token ids of some events."""
    return [e.token_id for e in events]


def cold_tokens(
    prompt: list[int], params: dict[str, Any], config: EngineConfig | None = None
) -> list[int]:
    """Tokens of a call on an empty cache."""
    return ids(run(EmbeddedEngine(InMemoryKV(CHUNK), config), prompt, params))


def spawned_child(engine: EmbeddedEngine, prompt: list[int], out: Any) -> None:
    """Entry point of the spawned process: report greedy and seeded tokens."""
    out.put((ids(run(engine, prompt, GREEDY)), ids(run(engine, prompt, SEEDED_ALL))))


# -- exact reuse of cached KV ------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("chunks", [1, 2, 3])
@pytest.mark.parametrize("params", [GREEDY, SEEDED_ALL], ids=["greedy", "seeded"])
def test_cache_hit_yields_exactly_the_cold_tokens(
    dtype: str, chunks: int, params: dict[str, Any]
) -> None:
    """A call whose first chunks are cached yields the tokens of a cold call."""
    config = EngineConfig(dtype=dtype)
    prompt = prompt_of(3 * CHUNK + 7, seed=chunks)
    engine = EmbeddedEngine(InMemoryKV(CHUNK), config)
    run(engine, prompt[: chunks * CHUNK], {"max_tokens": 1})
    warm = run(engine, prompt, params)
    assert warm[0].cached_tokens == chunks * CHUNK
    assert ids(warm) == cold_tokens(prompt, params, config)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_cache_hit_stores_bitwise_identical_kv(dtype: str) -> None:
    """KV computed after a cached prefix is bit for bit the cold run's KV."""
    config = EngineConfig(dtype=dtype)
    prompt = prompt_of(5 * CHUNK, seed=3)
    cold_ctx = InMemoryKV(CHUNK)
    run(EmbeddedEngine(cold_ctx, config), prompt, {"max_tokens": 1})
    warm_ctx = InMemoryKV(CHUNK)
    engine = EmbeddedEngine(warm_ctx, config)
    for cut in (CHUNK + 3, 2 * CHUNK, 4 * CHUNK - 1):
        run(engine, prompt[:cut], {"max_tokens": 1})
    run(engine, prompt, {"max_tokens": 1})
    warm, cold = warm_ctx.retrieve(prompt), cold_ctx.retrieve(prompt)
    assert warm is not None and cold is not None
    assert warm.dtype == cold.dtype == np.dtype(dtype)
    assert warm.tobytes() == cold.tobytes()


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_long_prompt_cache_hit_is_bitwise_identical(dtype: str) -> None:
    """Past several attention blocks and BLAS panels, reuse is still exact."""
    config = EngineConfig(dtype=dtype)
    prompt = prompt_of(700, seed=13)
    params = {**SEEDED_ALL, "max_tokens": 6}
    cold_ctx = InMemoryKV(128)
    cold = run(EmbeddedEngine(cold_ctx, config), prompt, params)
    for cut in (128, 300, 640):
        warm_ctx = InMemoryKV(128)
        engine = EmbeddedEngine(warm_ctx, config)
        run(engine, prompt[:cut], {"max_tokens": 1})
        warm = run(engine, prompt, params)
        assert warm[0].cached_tokens == cut // 128 * 128
        assert ids(warm) == ids(cold)
        kv_warm, kv_cold = warm_ctx.retrieve(prompt), cold_ctx.retrieve(prompt)
        assert kv_warm is not None and kv_cold is not None
        assert kv_warm.tobytes() == kv_cold.tobytes(), f"cached prefix {cut}"


def test_every_split_point_yields_the_cold_tokens() -> None:
    """With one-token chunks, a cached prefix of any length changes nothing."""
    prompt = prompt_of(40, seed=11)
    expected = cold_tokens(prompt, GREEDY)
    for cut in (1, 2, 5, 17, 31, 39):
        engine = EmbeddedEngine(InMemoryKV(1))
        run(engine, prompt[:cut], {"max_tokens": 1})
        warm = run(engine, prompt, GREEDY)
        assert warm[0].cached_tokens == cut
        assert ids(warm) == expected, f"cached prefix of {cut} tokens"


def test_decoding_matches_prefilling_the_generated_text() -> None:
    """A token decoded one at a time is the token a cold prefill predicts."""
    for length in (1, 9, 33, 70):
        prompt = prompt_of(length, seed=length)
        generated = cold_tokens(prompt, {**GREEDY, "max_tokens": 20})
        for cut in (1, 7, 19):
            nxt = cold_tokens(prompt + generated[:cut], {**GREEDY, "max_tokens": 1})
            assert nxt == [generated[cut]], f"prompt {length}, after {cut} tokens"


def test_one_pass_holds_one_layer_of_float64_grid_at_a_time() -> None:
    """A single pass over an empty sequence (a prefill that decodes nothing
    more) never holds the whole KV as float64 grid copies, only one layer's
    (that copy was 2 GiB per Llama-3-8B-sized prefill)."""
    # Many thin layers: the whole grid dwarfs one layer's activations.
    config = EngineConfig(layers=48, kv_heads=2, head_dim=32, d_model=32)
    tokens = prompt_of(1000, seed=2)
    weights_for(config)
    tracemalloc.start()
    try:
        seq = KVSequence(config, len(tokens))
        seq.extend(tokens)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    whole_grid = seq.kv.size * np.dtype(np.float64).itemsize
    assert peak < seq.kv.nbytes + whole_grid / 2


def test_later_passes_attend_as_one_pass() -> None:
    """Passes after the first (which keep the grid copies) give exactly the
    logits a single pass over the same tokens gives."""
    tokens = prompt_of(90, seed=4)
    whole = KVSequence(EngineConfig(), len(tokens)).extend_logits(tokens, last=50)
    split = KVSequence(EngineConfig(), len(tokens))
    split.extend(tokens[:40])
    parts = [split.extend_logits(tokens[40:70], last=30)]
    parts += [split.extend([token])[None] for token in tokens[70:]]
    assert np.concatenate(parts).tobytes() == whole.tobytes()


def test_whole_prompt_cached_still_computes_its_last_token() -> None:
    """A fully cached prompt reuses all but its last token, as vLLM does."""
    engine = EmbeddedEngine(InMemoryKV(CHUNK))
    prompt = prompt_of(2 * CHUNK, seed=5)
    first = run(engine, prompt, GREEDY)
    again = run(engine, prompt, GREEDY)
    assert again[0].cached_tokens == 2 * CHUNK - 1
    assert engine.stats().computed_tokens == 2 * CHUNK + 1
    assert ids(again) == ids(first)


def test_edited_kv_is_reused_and_only_the_tail_computed() -> None:
    """After a token drop, the edited prefix is a hit; only the tail is computed."""
    ctx = InMemoryKV(CHUNK)
    engine = EmbeddedEngine(ctx)
    prompt = prompt_of(4 * CHUNK, seed=8)
    run(engine, prompt, {"max_tokens": 1})
    kv = ctx.retrieve(prompt)
    assert kv is not None
    keep = [i for i in range(len(prompt)) if i % 4 != 1]
    kept_tokens = [prompt[i] for i in keep]
    ctx.store(kv[:, :, keep], kept_tokens)
    before = engine.stats()
    new_prompt = kept_tokens + prompt_of(5, seed=9)
    events = run(engine, new_prompt, GREEDY)
    delta = engine.stats()
    assert events[0].cached_tokens == len(keep) // CHUNK * CHUNK == 3 * CHUNK
    assert delta.computed_tokens - before.computed_tokens == len(new_prompt) - 3 * CHUNK


def test_edited_kv_is_attended_to_as_stored() -> None:
    """The tail is computed against the edited KV, not a recomputation of it."""
    prompt = prompt_of(2 * CHUNK, seed=12)
    ctx = InMemoryKV(CHUNK)
    engine = EmbeddedEngine(ctx)
    run(engine, prompt[:CHUNK], {"max_tokens": 1})
    edited = ctx.retrieve(prompt[:CHUNK])
    assert edited is not None
    ctx.chunks.clear()
    ctx.store(edited * 0.5, prompt[:CHUNK])
    run(engine, prompt, {"max_tokens": 1})
    cold_ctx = InMemoryKV(CHUNK)
    run(EmbeddedEngine(cold_ctx), prompt, {"max_tokens": 1})
    warm, cold = ctx.retrieve(prompt), cold_ctx.retrieve(prompt)
    assert warm is not None and cold is not None
    assert np.array_equal(warm[:, :, :CHUNK], edited * 0.5)
    assert not np.array_equal(warm[:, :, CHUNK:], cold[:, :, CHUNK:])


def test_stores_the_full_chunks_of_the_prompt() -> None:
    """After a call the context holds the prompt's full chunks, in the KV dtype."""
    ctx = InMemoryKV(CHUNK)
    config = EngineConfig(dtype="float16")
    prompt = prompt_of(3 * CHUNK + 5, seed=4)
    run(EmbeddedEngine(ctx, config), prompt, {"max_tokens": 3})
    kv = ctx.retrieve([*prompt, 1, 2, 3])
    assert kv is not None
    assert kv.shape == (2, config.layers, 3 * CHUNK, config.width)
    assert kv.dtype == np.float16
    assert len(ctx.chunks) == 3


def test_first_event_carries_cached_tokens() -> None:
    """Only the first event reports the prompt tokens served from the cache."""
    engine = EmbeddedEngine(InMemoryKV(CHUNK))
    prompt = prompt_of(2 * CHUNK + 1, seed=6)
    cold = run(engine, prompt, GREEDY)
    warm = run(engine, prompt, GREEDY)
    assert cold[0].cached_tokens == 0
    assert warm[0].cached_tokens == 2 * CHUNK
    assert all(e.cached_tokens is None for e in cold[1:] + warm[1:])


def test_other_salt_misses_the_cache() -> None:
    """KV stored under one salt is not reused for another."""
    engine = EmbeddedEngine(InMemoryKV(CHUNK))
    prompt = prompt_of(2 * CHUNK + 1, seed=6)
    run(engine, prompt, GREEDY, salt="alice")
    assert run(engine, prompt, GREEDY, salt="bob")[0].cached_tokens == 0


@pytest.mark.parametrize("shape", [(2, 3, CHUNK, 64), (2, 2, CHUNK, 32)])
def test_cached_kv_of_another_layout_raises(shape: tuple[int, ...]) -> None:
    """A cached KV whose layers or width differ from the model's is rejected."""
    ctx = InMemoryKV(CHUNK)
    prompt = prompt_of(CHUNK + 2)
    ctx.store(np.zeros(shape, dtype=np.float32), prompt[:CHUNK])
    with pytest.raises(KVConfigError, match=r"shape \(2, \d, 16, \d+\).*layers=2"):
        run(EmbeddedEngine(ctx), prompt, GREEDY)


def test_non_finite_cached_kv_raises() -> None:
    """A cached KV holding NaN is rejected instead of poisoning the output."""
    ctx = InMemoryKV(CHUNK)
    prompt = prompt_of(CHUNK + 2)
    ctx.store(np.full((2, 2, CHUNK, 64), np.nan, dtype=np.float32), prompt[:CHUNK])
    with pytest.raises(KVConfigError, match="NaN"):
        run(EmbeddedEngine(ctx), prompt, GREEDY)


# -- generation control ------------------------------------------------------


def _eos_case() -> tuple[list[int], list[int], int]:
    """A prompt, its greedy tokens, and a token that occurs among them."""
    prompt = prompt_of(20, seed=2)
    tokens = cold_tokens(prompt, GREEDY)
    return prompt, tokens, tokens[5]


def test_eos_ends_generation_and_is_not_yielded() -> None:
    """Generation stops at EOS, which is not yielded."""
    prompt, tokens, eos = _eos_case()
    got = cold_tokens(
        prompt, {**GREEDY, "ignore_eos": False}, EngineConfig(eos_token_id=eos)
    )
    assert got == tokens[: tokens.index(eos)]


def test_ignore_eos_generates_past_eos() -> None:
    """With ignore_eos, EOS is yielded like any token and generation goes on."""
    prompt, tokens, eos = _eos_case()
    assert cold_tokens(prompt, GREEDY, EngineConfig(eos_token_id=eos)) == tokens


def test_stop_token_ids_end_generation() -> None:
    """A stop token ends generation, even with ignore_eos, and is not yielded."""
    prompt, tokens, stop = _eos_case()
    got = cold_tokens(prompt, {**GREEDY, "stop_token_ids": [stop]})
    assert got == tokens[: tokens.index(stop)]


def test_max_tokens_bounds_the_output() -> None:
    """A call yields max_tokens events when nothing stops it earlier."""
    assert len(cold_tokens(prompt_of(10), {**GREEDY, "max_tokens": 5})) == 5


def test_greedy_ignores_the_seed() -> None:
    """Temperature 0 picks the argmax whatever the seed."""
    prompt = prompt_of(30, seed=1)
    runs = [cold_tokens(prompt, {**GREEDY, "seed": s}) for s in (1, 2, 3)]
    assert runs[0] == runs[1] == runs[2]


def test_same_seed_gives_same_tokens() -> None:
    """Temperature sampling with one seed is reproducible."""
    prompt = prompt_of(30, seed=1)
    assert cold_tokens(prompt, SEEDED_ALL) == cold_tokens(prompt, SEEDED_ALL)


def test_seed_changes_sampled_tokens() -> None:
    """Temperature sampling with other seeds draws other tokens."""
    prompt = prompt_of(30, seed=1)
    params = {**SEEDED_ALL, "max_tokens": 24}
    runs = {tuple(cold_tokens(prompt, {**params, "seed": s})) for s in (1, 2, 3)}
    assert len(runs) == 3
    assert tuple(cold_tokens(prompt, {**params, "temperature": 0})) not in runs


def test_tiny_top_p_keeps_only_the_top_token() -> None:
    """A nucleus smaller than the top token's probability samples greedily."""
    prompt = prompt_of(30, seed=1)
    nucleus = cold_tokens(prompt, {**SEEDED_ALL, "top_p": 1e-9, "max_tokens": 24})
    assert nucleus == cold_tokens(prompt, {**GREEDY, "max_tokens": 24})


def test_top_p_changes_what_is_sampled() -> None:
    """A partial nucleus draws from fewer tokens than the full distribution."""
    prompt = prompt_of(30, seed=1)
    params = {**SEEDED_ALL, "max_tokens": 24}
    assert cold_tokens(prompt, {**params, "top_p": 0.3}) != cold_tokens(prompt, params)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("temperature", -0.5),
        ("temperature", "hot"),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("max_tokens", 0),
        ("max_tokens", 2.5),
        ("max_tokens", True),
        ("seed", 1.5),
        ("seed", "7"),
        ("ignore_eos", "yes"),
        ("stop_token_ids", 3),
        ("stop_token_ids", [1, "2"]),
    ],
)
def test_invalid_sampling_param_raises_before_any_work(key: str, value: Any) -> None:
    """An invalid sampling param raises naming it, before the context is used."""
    ctx = RecordingKV()
    with pytest.raises(SamplingParamsError, match=re.escape(f"'{key}' is {value!r}")):
        EmbeddedEngine(ctx)(prompt_of(5), {key: value}, "")
    assert ctx.retrieves == ctx.stores == 0


def test_unknown_sampling_keys_are_ignored() -> None:
    """Keys the engine does not know (stream, model, n) change nothing."""
    prompt = prompt_of(12)
    extra = {"stream": True, "model": "toy", "n": 1, "logprobs": None}
    assert cold_tokens(prompt, {**GREEDY, **extra}) == cold_tokens(prompt, GREEDY)


@pytest.mark.parametrize("bad", [512, -1])
def test_out_of_vocabulary_prompt_token_raises(bad: int) -> None:
    """A prompt token outside [0, vocab_size) raises naming it and the size."""
    with pytest.raises(
        StreamInputError, match=rf"is {bad}, outside the vocabulary \[0, 512\)"
    ):
        EmbeddedEngine(NoKV())([1, 2, bad], GREEDY, "")


def test_empty_prompt_raises() -> None:
    """An empty prompt is rejected."""
    with pytest.raises(StreamInputError, match="empty"):
        EmbeddedEngine(NoKV())([], GREEDY, "")


def test_prompt_past_max_position_raises() -> None:
    """A prompt plus max_tokens longer than max_position is rejected."""
    engine = EmbeddedEngine(NoKV(), EngineConfig(max_position=32))
    run(engine, prompt_of(20), {**GREEDY, "max_tokens": 13})
    with pytest.raises(StreamInputError, match="max_position is 32"):
        engine(prompt_of(20), {**GREEDY, "max_tokens": 14}, "")


def test_prefill_runs_on_first_next() -> None:
    """The call returns at once; retrieve, prefill and store wait for next()."""
    ctx = RecordingKV()
    events = EmbeddedEngine(ctx)(prompt_of(2 * CHUNK), GREEDY, "")
    assert ctx.retrieves == ctx.stores == 0
    next(iter(events))
    assert ctx.retrieves == ctx.stores == 1


# -- vocabulary --------------------------------------------------------------


def test_event_texts_are_vocabulary_pieces() -> None:
    """Each event's text is its token's piece; together they detokenize the ids."""
    engine = EmbeddedEngine(NoKV())
    events = run(engine, prompt_of(10), GREEDY)
    assert [e.text for e in events] == [engine.vocab.piece(e.token_id) for e in events]
    assert "".join(e.text for e in events) == engine.detokenize(ids(events))
    assert all(e.text.startswith(" ") and len(e.text) > 1 for e in events)


def test_tokenize_round_trips_detokenize() -> None:
    """Every id of the vocabulary, EOS included, survives text and back."""
    engine = EmbeddedEngine(NoKV())
    every = list(range(engine.config.vocab_size))
    assert engine.tokenize(engine.detokenize(every)) == every
    shuffled = [*prompt_of(300, seed=21), 0]
    assert engine.tokenize(engine.detokenize(shuffled)) == shuffled


def test_vocabulary_words_are_distinct() -> None:
    """No two ids share a text (else tokenize could not invert detokenize)."""
    vocab = ToyVocab(5000, eos_token_id=3)
    assert len({vocab.piece(i) for i in range(5000)}) == 5000
    assert vocab.piece(3) == " <eos>"


def test_unknown_words_map_to_fixed_non_eos_ids() -> None:
    """Words outside the vocabulary still tokenize, deterministically, never to EOS."""
    vocab = ToyVocab(64, eos_token_id=0)
    words = [f"Hello{i}," for i in range(200)]
    got = vocab.tokenize(" ".join(words))
    assert got == vocab.tokenize(" ".join(words))
    assert len(got) == 200 and all(0 < t < 64 for t in got)


def test_detokenize_rejects_ids_outside_the_vocabulary() -> None:
    """Detokenizing an unknown id raises naming it."""
    with pytest.raises(StreamInputError, match="token id 70 is outside"):
        ToyVocab(70, 0).detokenize([1, 70])


# -- processes, pickling, threads, stats ----------------------------------


def test_pickle_is_config_and_context_only() -> None:
    """A pickled engine is small: its config and its context, no weights."""
    ctx = NoKV()
    engine = EmbeddedEngine(ctx)
    run(engine, prompt_of(5), GREEDY)
    assert len(pickle.dumps(engine)) < 2048 + len(pickle.dumps(ctx))


def test_pickle_round_trip_gives_same_tokens() -> None:
    """An unpickled engine yields the same greedy and seeded tokens."""
    engine = EmbeddedEngine(NoKV(), EngineConfig(seed=3))
    copy = pickle.loads(pickle.dumps(engine))
    assert copy.config == engine.config
    prompt = prompt_of(25)
    for params in (GREEDY, SEEDED_ALL):
        assert ids(run(copy, prompt, params)) == ids(run(engine, prompt, params))


def test_spawned_process_gives_same_tokens() -> None:
    """An engine sent to a spawned process yields the same tokens there."""
    engine = EmbeddedEngine(NoKV(), EngineConfig(seed=5))
    prompt = prompt_of(25)
    mp = multiprocessing.get_context("spawn")
    out = mp.Queue()
    child = mp.Process(target=spawned_child, args=(engine, prompt, out))
    child.start()
    try:
        greedy, seeded = out.get(timeout=60)
        child.join(timeout=30)
        assert child.exitcode == 0
    finally:
        if child.is_alive():
            child.kill()
            child.join(timeout=10)
        out.close()
        out.join_thread()
    assert greedy == ids(run(engine, prompt, GREEDY))
    assert seeded == ids(run(engine, prompt, SEEDED_ALL))


def test_weights_are_built_once_per_process() -> None:
    """Engines whose configs differ only in KV dtype or EOS share one model."""
    base = weights_for(EngineConfig(seed=9))
    assert weights_for(EngineConfig(seed=9, dtype="float16", eos_token_id=4)) is base
    assert weights_for(EngineConfig(seed=10)) is not base


def test_concurrent_calls_are_exact_and_counted() -> None:
    """Threads sharing an engine get the serial tokens; stats add up."""
    engine = EmbeddedEngine(InMemoryKV(CHUNK))
    prompts = [prompt_of(CHUNK * (1 + i % 3) + i, seed=i) for i in range(8)]
    expected = [cold_tokens(p, GREEDY) for p in prompts]
    start = threading.Barrier(4)

    def call(prompt: list[int]) -> list[int]:
        start.wait(timeout=30)
        return ids(run(engine, prompt, GREEDY))

    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(call, p) for p in prompts[:4]]
        got = [f.result(timeout=60) for f in futures]
    start.reset()
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(call, p) for p in prompts[4:]]
        got += [f.result(timeout=60) for f in futures]
    assert got == expected
    stats = engine.stats()
    assert stats.calls == 8
    assert stats.prompt_tokens == sum(map(len, prompts))
    assert stats.generated_tokens == 8 * GREEDY["max_tokens"]


def test_stats_split_prompt_tokens_into_cached_and_computed() -> None:
    """stats() totals calls, prompt, cached, computed and generated tokens."""
    engine = EmbeddedEngine(InMemoryKV(CHUNK))
    assert engine.stats() == EngineStats()
    prompt = prompt_of(2 * CHUNK + 3)
    run(engine, prompt, {**GREEDY, "max_tokens": 4})
    run(engine, [*prompt, 7], {**GREEDY, "max_tokens": 2})
    assert engine.stats() == EngineStats(
        calls=2,
        prompt_tokens=2 * len(prompt) + 1,
        cached_tokens=2 * CHUNK,
        computed_tokens=len(prompt) + 4,
        generated_tokens=6,
    )


def test_serves_as_a_stream_post_completion() -> None:
    """LMCacheStream.generate drives the engine; the second pass hits the cache."""
    ctx = InMemoryKV(CHUNK)
    engine = EmbeddedEngine(ctx)
    stream = create_request(ctx, engine, prompt_of(2 * CHUNK + 5))
    first = stream.generate({"max_tokens": 4, "temperature": 0, "ignore_eos": True})
    assert first.output_tokens == 4 and first.cached_tokens == 0
    second = stream.generate({"max_tokens": 4, "temperature": 0, "ignore_eos": True})
    assert second.cached_tokens == 2 * CHUNK
    assert stream.output_text() == engine.detokenize(stream.output_tokens())
    assert len(stream.tokens) == 2 * CHUNK + 13


# -- configuration -----------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("dtype", "int8", "dtype"),
        ("dtype", "bogus", "dtype"),
        ("head_dim", 15, "even"),
        ("eos_token_id", 512, "eos_token_id"),
        ("d_model", 512, "matmul depth"),
        ("layers", 0, "layers"),
        ("max_position", 1 << 20, "max_position"),
    ],
)
def test_invalid_config_raises(field: str, value: Any, message: str) -> None:
    """EngineConfig rejects a bad field, naming it."""
    with pytest.raises(KVConfigError, match=message):
        EngineConfig(**{field: value})


def test_config_dtype_is_normalized() -> None:
    """A numpy dtype is accepted and equals its name."""
    assert EngineConfig(dtype=np.float16) == EngineConfig(dtype="float16")  # type: ignore[arg-type]
