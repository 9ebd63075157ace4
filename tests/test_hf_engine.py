"""Specification of HFEngine: a trained model (SmolLM2-135M, through
``transformers`` on the CPU) behind ``post_completion``, with LMCache's
prefix cache and vLLM's KV layout."""

from __future__ import annotations

import contextlib
import pickle
import secrets
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

import lmcache_mp.batch as lmc_batch
import lmcache_mp.request as lmc_request
from lmcache_mp import LMCacheSDKCacheKind, connect
from lmcache_mp.engine import HFEngine
from lmcache_mp.errors import KVConfigError, ModelLoadError, StreamInputError
from lmcache_mp.kv import KVStore

KV, QUERY = LMCacheSDKCacheKind.KV, LMCacheSDKCacheKind.QUERY
CHUNK = 16
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}
TEXT = (
    "The history of the city goes back to Roman times, when a small fort was "
    "built by the river. Over the centuries it grew into a market town, and by "
    "the middle ages it was"
)


@pytest.fixture(scope="module")
def model_engine() -> HFEngine:
    """SmolLM2, loaded once for the module (the engines of the tests share
    it); its own context is closed at once, each test brings its store."""
    ctx = connect(chunk_size=CHUNK)
    try:
        return HFEngine.from_pretrained("smollm2-135m", ctx)
    finally:
        ctx.destroy()


@pytest.fixture
def stores() -> Iterator[tuple[KVStore, KVStore]]:
    """A fresh named store (16-token chunks) and its QUERY context."""
    kv_ctx = connect(f"shm:///test-hf-{secrets.token_hex(6)}", chunk_size=CHUNK)
    q_ctx = kv_ctx.for_kind(QUERY)
    try:
        yield kv_ctx, q_ctx
    finally:
        q_ctx.close()
        kv_ctx.destroy()


def engine_over(
    model_engine: HFEngine, ctx: KVStore, query_ctx: KVStore | None = None
) -> HFEngine:
    """An engine of the already loaded model over other contexts."""
    return HFEngine(model_engine.source, ctx, query_ctx=query_ctx)


def run(engine: HFEngine, prompt: list[int], params: dict[str, Any] = GREEDY) -> Any:
    """The token ids, texts and first event's cached count of one call."""
    events = list(engine(prompt, params))
    return (
        [e.token_id for e in events],
        "".join(e.text for e in events),
        events[0].cached_tokens,
    )


def layer0_projection(engine: HFEngine, tokens: list[int], proj: str) -> Any:
    """``proj`` (k_proj/q_proj/v_proj) of layer 0 on each token, computed here
    from the weights: ``[1, heads, T, head_dim]`` before any RoPE."""
    model = engine.model
    layer = model.model.layers[0]
    _, _, _, head_dim = engine.layout
    with torch.inference_mode():
        hidden = layer.input_layernorm(model.model.embed_tokens(torch.tensor([tokens])))
        out = getattr(layer.self_attn, proj)(hidden)
    return out.view(1, len(tokens), -1, head_dim).transpose(1, 2)


def rope(engine: HFEngine, states: Any, positions: list[int]) -> Any:
    """``states`` rotated to ``positions`` by transformers' own Llama RoPE."""
    model = engine.model
    pos = torch.tensor([positions])
    with torch.inference_mode():
        cos, sin = model.model.rotary_emb(states, pos)
        rotated, _ = apply_rotary_pos_emb(states, states, cos, sin)
    return rotated


def as_rows(states: Any) -> np.ndarray:
    """``[1, H, T, d]`` as vLLM's rows ``[T, H*d]``."""
    return states[0].transpose(0, 1).flatten(1).numpy()


def test_greedy_decoding_gives_transformers_generate_tokens(
    model_engine: HFEngine, stores: tuple[KVStore, KVStore]
) -> None:
    """Greedy decoding yields exactly the tokens transformers' own generate yields on the same model."""
    engine = engine_over(model_engine, stores[0])
    prompt = engine.encode(TEXT, chat=False)
    ids, _, _ = run(engine, prompt)
    with torch.inference_mode():
        out = engine.model.generate(
            torch.tensor([prompt]), max_new_tokens=12, do_sample=False
        )
    assert ids == out[0, len(prompt) :].tolist()


def test_a_cache_hit_gives_the_tokens_of_a_cold_run(
    model_engine: HFEngine, stores: tuple[KVStore, KVStore]
) -> None:
    """A second call reuses the prompt's full chunks and yields the cold run's tokens."""
    engine = engine_over(model_engine, stores[0])
    prompt = engine.encode(TEXT, chat=False)
    cold = run(engine, prompt)
    warm = run(engine, prompt)
    assert cold[2] == 0
    assert warm[2] == len(prompt) // CHUNK * CHUNK > 0
    assert warm[:2] == cold[:2]
    stats = engine.stats()
    assert stats.cached_tokens == warm[2]
    assert stats.computed_tokens == 2 * len(prompt) - warm[2]


def test_decoding_keeps_the_generated_tokens_kv_and_queries(
    model_engine: HFEngine, stores: tuple[KVStore, KVStore]
) -> None:
    """After a decode the store holds the KV and queries of prompt +
    generated tokens up to the last full chunk, within float tolerance of a
    cold prefill of the same tokens, and decoding on from that cache gives
    the cold run's greedy tokens."""
    kv_ctx, q_ctx = stores
    engine = engine_over(model_engine, kv_ctx, q_ctx)
    prompt = engine.encode(TEXT, chat=False)
    generated, _, _ = run(engine, prompt, {**GREEDY, "max_tokens": 40})
    tokens = prompt + generated
    # The last token sampled was never run through the model: no KV.
    cached = (len(tokens) - 1) // CHUNK * CHUNK
    assert cached > len(prompt) // CHUNK * CHUNK
    kv, queries = kv_ctx.retrieve(tokens), q_ctx.retrieve(tokens)
    assert kv is not None and queries is not None
    assert kv.shape[2] == queries.shape[2] == cached
    with connect(chunk_size=CHUNK) as cold_ctx, cold_ctx.for_kind(QUERY) as cold_q:
        cold = engine_over(model_engine, cold_ctx, cold_q)
        cold_tokens = run(cold, tokens, GREEDY)
        ref_kv, ref_queries = cold_ctx.retrieve(tokens), cold_q.retrieve(tokens)
    assert ref_kv is not None and ref_queries is not None
    np.testing.assert_allclose(kv, ref_kv[:, :, :cached], rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(
        queries, ref_queries[:, :, :cached], rtol=1e-3, atol=1e-3
    )
    warm_tokens = run(engine, tokens, GREEDY)
    assert warm_tokens[2] == cached
    assert warm_tokens[:2] == cold_tokens[:2]


def test_save_decode_cache_false_keeps_the_prompts_kv_only(
    model_engine: HFEngine, stores: tuple[KVStore, KVStore]
) -> None:
    """``save_decode_cache=False``: a decode stores the prompt's chunks only."""
    kv_ctx, _ = stores
    engine = HFEngine(model_engine.source, kv_ctx, save_decode_cache=False)
    prompt = engine.encode(TEXT, chat=False)
    generated, _, _ = run(engine, prompt, {**GREEDY, "max_tokens": 40})
    kv = kv_ctx.retrieve(prompt + generated)
    assert kv is not None and kv.shape[2] == len(prompt) // CHUNK * CHUNK


def test_the_kv_is_vllms_layout_with_keys_after_rope(
    model_engine: HFEngine, stores: tuple[KVStore, KVStore]
) -> None:
    """The stored KV is [2, L, T, kv_heads*head_dim] in the model's dtype; layer 0's keys are RoPE'd at their positions, values are not."""
    engine = engine_over(model_engine, stores[0])
    prompt = engine.encode(TEXT, chat=False)
    run(engine, prompt, {**GREEDY, "max_tokens": 1})
    kv = stores[0].retrieve(prompt)
    assert kv is not None
    layers, _, kv_heads, head_dim = engine.layout
    cached = len(prompt) // CHUNK * CHUNK
    assert kv.shape == (2, layers, cached, kv_heads * head_dim)
    assert kv.dtype == np.float32  # the GGUF dequantizes to float32
    tokens = prompt[:cached]
    keys = rope(
        engine, layer0_projection(engine, tokens, "k_proj"), list(range(cached))
    )
    np.testing.assert_allclose(kv[0, 0], as_rows(keys), rtol=1e-4, atol=1e-4)
    values = layer0_projection(engine, tokens, "v_proj")
    np.testing.assert_allclose(kv[1, 0], as_rows(values), rtol=1e-4, atol=1e-4)


def test_recorded_queries_are_post_rope_and_chunk_aligned(
    model_engine: HFEngine, stores: tuple[KVStore, KVStore]
) -> None:
    """With a QUERY context the prompt's queries are stored as [1, L, T, q_heads*head_dim], after RoPE, over the KV's token range; a cache hit fills the reused rows from the store."""
    kv_ctx, q_ctx = stores
    engine = engine_over(model_engine, kv_ctx, q_ctx)
    prompt = engine.encode(TEXT, chat=False)
    run(engine, prompt, {**GREEDY, "max_tokens": 1})
    first = q_ctx.retrieve(prompt)
    assert first is not None
    layers, q_heads, _, head_dim = engine.layout
    cached = len(prompt) // CHUNK * CHUNK
    assert first.shape == (1, layers, cached, q_heads * head_dim)
    queries = rope(
        engine,
        layer0_projection(engine, prompt[:cached], "q_proj"),
        list(range(cached)),
    )
    np.testing.assert_allclose(first[0, 0], as_rows(queries), rtol=1e-4, atol=1e-4)
    longer = prompt + engine.encode(" a centre of trade for the region.", chat=False)
    run(engine, longer, {**GREEDY, "max_tokens": 1})
    second = q_ctx.retrieve(longer)
    assert second is not None and second.shape[2] == len(longer) // CHUNK * CHUNK
    np.testing.assert_array_equal(second[:, :, :cached], first)


def test_decoding_after_a_drop_continues_at_len_tokens(
    model_engine: HFEngine, stores: tuple[KVStore, KVStore]
) -> None:
    """After a modify dropped tokens, new tokens take the positions after the kept ones, as vLLM with LMCache (stale positions are the fn's to fix)."""
    kv_ctx, _ = stores
    engine = engine_over(model_engine, kv_ctx)
    prompt = engine.encode(TEXT, chat=False)
    stream = lmc_request.create_request([kv_ctx], engine, prompt)
    stream.generate({"max_tokens": 1, "temperature": 0})

    def keep_last_chunk(tensors: Any, tokens: list[int]) -> tuple[Any, list[int]]:
        return tensors[KV][:, :, -CHUNK:], tokens[-CHUNK:]

    stream.modify_kv(keep_last_chunk, timeout=5)
    more = engine.encode(
        " It was famous for its wool and its cloth markets.", chat=False
    )
    # Sent next: the kept chunk, the uncached tail and the generated token,
    # then ``more``: at least one more full chunk, computed after the drop.
    sent = list(stream.tokens) + list(stream.suffix_tokens) + more
    assert len(sent) >= 2 * CHUNK
    stream.generate({"max_tokens": 1, "temperature": 0}, suffix_tokens=more)
    stored = kv_ctx.retrieve(sent)
    assert stored is not None and stored.shape[2] >= 2 * CHUNK
    second = sent[CHUNK : 2 * CHUNK]
    keys = rope(
        engine,
        layer0_projection(engine, second, "k_proj"),
        list(range(CHUNK, 2 * CHUNK)),
    )
    np.testing.assert_allclose(
        stored[0, 0, CHUNK : 2 * CHUNK], as_rows(keys), rtol=1e-4, atol=1e-4
    )


def test_text_in_and_text_out(
    model_engine: HFEngine, stores: tuple[KVStore, KVStore]
) -> None:
    """encode() wraps a text in the chat template; the events' texts join into the model's own decoding of the reply."""
    engine = engine_over(model_engine, stores[0])
    raw = engine.encode("What is the capital of France?", chat=False)
    chat = engine.encode("What is the capital of France?")
    assert len(chat) > len(raw)
    assert engine.decode(raw) == "What is the capital of France?"
    assert "<|im_start|>assistant" in engine.tokenizer.decode(chat)
    ids, text, _ = run(engine, chat, {"temperature": 0, "max_tokens": 24})
    assert text == engine.decode(ids)
    assert "Paris" in text


def test_the_engine_pickles_by_its_arguments(
    model_engine: HFEngine, stores: tuple[KVStore, KVStore]
) -> None:
    """An engine pickles as its source and contexts (a few hundred bytes, no weights) and the copy shares this process's model."""
    kv_ctx, q_ctx = stores
    engine = engine_over(model_engine, kv_ctx, q_ctx)
    blob = pickle.dumps(engine)
    assert len(blob) < 4096
    copy = pickle.loads(blob)
    assert copy.source == engine.source
    assert copy.query_ctx is not None
    assert copy.model is model_engine.model


@pytest.mark.parametrize(
    ("prompt", "params", "match"),
    [
        pytest.param([], {}, "empty", id="empty"),
        pytest.param([49152], {}, "outside the vocabulary", id="vocab"),
        pytest.param([1] * 8190, {"max_tokens": 8}, "max_position", id="too long"),
    ],
)
def test_bad_prompts_are_refused_before_running(
    model_engine: HFEngine, prompt: list[int], params: dict[str, Any], match: str
) -> None:
    """An empty prompt, an id outside the vocabulary or one too long for the context raise StreamInputError at the call."""
    with pytest.raises(StreamInputError, match=match):
        model_engine(prompt, params)


def test_cached_kv_of_another_model_is_a_config_error(
    model_engine: HFEngine,
) -> None:
    """KV whose width is not the model's fails the prefill with KVConfigError naming both widths."""
    ctx = connect(chunk_size=CHUNK)
    try:
        prompt = list(range(100, 100 + 2 * CHUNK))
        ctx.store(np.zeros((2, 30, 2 * CHUNK, 64), np.float32), prompt)
        with pytest.raises(KVConfigError, match="width 64"):
            list(engine_over(model_engine, ctx)(prompt, {"max_tokens": 1}))
    finally:
        ctx.destroy()


def test_an_unknown_model_is_a_model_load_error() -> None:
    """A path that holds no model raises ModelLoadError naming the aliases."""
    with pytest.raises(ModelLoadError, match="smollm2-135m"):
        HFEngine.from_pretrained("/nonexistent/model", connect(chunk_size=CHUNK))


@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
def test_the_pool_gives_the_threads_tokens(
    model_engine: HFEngine, start_method: str
) -> None:
    """prefill -> decode on the process pool (model preloaded per worker) yields the thread executor's tokens and texts."""
    ctx = connect(f"shm:///test-hf-{secrets.token_hex(6)}", chunk_size=CHUNK)
    try:
        engine = engine_over(model_engine, ctx)
        prompts = [
            engine.encode(t, chat=False)
            for t in (TEXT, "In 1905, Albert Einstein published a paper on")
        ]
        outputs = []
        for executor, opts in (
            ("thread", {}),
            (
                "process",
                {"mp_context": start_method, "max_workers": 2},
            ),
        ):
            with lmc_batch.LMCacheBatchedStream(
                executor, preload=[engine.load], **opts
            ) as batch:
                streams = [
                    lmc_request.create_request([ctx], engine, p) for p in prompts
                ]
                for s in streams:
                    batch.add(s)
                batch.prefill({"temperature": 0})
                batch.decode({"temperature": 0, "max_tokens": 8, "ignore_eos": True})
                outputs.append([(s.output_tokens, s.output_text) for s in streams])
        assert outputs[0] == outputs[1]
    finally:
        ctx.destroy()


def test_score_is_the_models_log_probabilities_of_the_continuation(
    model_engine: HFEngine, stores: tuple[KVStore, KVStore]
) -> None:
    """score() returns log-softmax rows equal to a plain forward over prompt + continuation, reusing the cached prefix; its top-1 is the greedy decode."""
    engine = engine_over(model_engine, stores[0])
    prompt = engine.encode(TEXT, chat=False)
    ids, _, _ = run(engine, prompt)  # also caches the prompt's full chunks
    scored = engine.score(prompt, ids)
    assert scored.shape == (len(ids), engine.model.config.vocab_size)
    assert scored.argmax(axis=1).tolist() == ids
    with torch.inference_mode():
        logits = engine.model(torch.tensor([prompt + ids])).logits[0].float()
    plain = logits.log_softmax(dim=-1)[len(prompt) - 1 : -1].numpy()
    np.testing.assert_allclose(scored, plain, atol=2e-3)


def test_a_key_rerotated_to_another_position_is_its_key_there(
    model_engine: HFEngine, stores: tuple[KVStore, KVStore]
) -> None:
    """Layer 0: a token's stored key at position t, rerotated to t' with engine.attention, equals the key the engine stores for it at t'."""
    from lmcache_mp.edits import rerotate_keys

    kv_ctx, _ = stores
    engine = engine_over(model_engine, kv_ctx)
    token = engine.encode(" harbour", chat=False)[0]
    at_5 = [*range(200, 205), token, *range(300, 300 + 2 * CHUNK - 6)]
    at_20 = [*range(400, 420), token, *range(500, 500 + 2 * CHUNK - 21)]
    for prompt in (at_5, at_20):
        run(engine, prompt, {**GREEDY, "max_tokens": 1})
    kv_5, kv_20 = kv_ctx.retrieve(at_5), kv_ctx.retrieve(at_20)
    assert kv_5 is not None and kv_20 is not None
    moved = rerotate_keys(kv_5[:, :, [5]], [5], [20], engine.attention)
    np.testing.assert_allclose(moved[0, 0, 0], kv_20[0, 0, 20], rtol=1e-4, atol=1e-4)
    assert not np.allclose(kv_5[0, 0, 5], kv_20[0, 0, 20], atol=1e-2)


DOCUMENTS = (
    "The lighthouse keeper, Marta, kept a logbook for forty years. Every "
    "evening she wrote down the weather, the ships that passed and the birds "
    "that rested on the rail. In the winter of the great storm she counted "
    "eleven ships seeking shelter in the bay, and she kept the lamp burning "
    "for three nights without sleep.",
    "Bread is made from flour, water, salt and yeast. The yeast eats the "
    "sugars in the flour and releases gas, which makes the dough rise. A "
    "baker kneads the dough to build gluten, lets it rest, shapes it and "
    "bakes it in a hot oven, where the crust browns.",
    "The small village of Arden sits between two rivers. Its market opens on "
    "Tuesdays and Saturdays, and farmers bring cheese, apples and honey from "
    "the hills. The old stone bridge was built in 1742 and repaired after "
    "the flood of 1901.",
)


def drop_middle_chunks(
    tensors: Any, tokens: list[int], *, attention: Any, rerotate: bool
) -> tuple[Any, list[int]]:
    """Upstream's notebook chunk drop, rewritten: drop the middle half of the
    chunks (a torch fn of {kind: tensor}); optionally move the kept keys'
    RoPE to their new positions 0..kept-1, as its rerotate_k_cache does."""
    from lmcache_mp.edits import rerotate_keys

    kv = tensors[LMCacheSDKCacheKind.KV]
    chunks = kv.shape[2] // CHUNK
    first, last = chunks // 4, chunks // 4 + chunks // 2
    kept = [
        i
        for c in range(chunks)
        if not first <= c < last
        for i in range(c * CHUNK, (c + 1) * CHUNK)
    ]
    new_kv = kv[:, :, kept]
    if rerotate:
        new_kv = rerotate_keys(new_kv, kept, range(len(kept)), attention)
    return new_kv, [tokens[i] for i in kept]


def _pool_run(
    batch: lmc_batch.LMCacheBatchedStream,
    engine: HFEngine,
    prompts: list[list[int]],
    fn: Any,
    salt: str,
) -> list[Any]:
    """prefill -> modify(fn) -> decode 24 greedy tokens on new streams of the
    batch, under their own cache salt (two edits keeping the same tokens
    would otherwise share their KV); per stream: what it sends next, and
    its decoded tokens."""
    streams = [
        lmc_request.create_request([engine.ctx], engine, p, salt) for p in prompts
    ]
    for s in streams:
        batch.add(s)
    ids = [s.request_stream_id for s in streams]
    batch.prefill({"temperature": 0}, stream_ids=ids)
    context = [list(s.tokens) + list(s.suffix_tokens) for s in streams]
    if fn is not None:
        batch.modify(fn, stream_ids=ids, timeout=10)
        context = [list(s.tokens) + list(s.suffix_tokens) for s in streams]
    batch.decode(
        {"temperature": 0, "max_tokens": 24, "ignore_eos": True}, stream_ids=ids
    )
    return [(c, s.output_tokens[1:]) for c, s in zip(context, streams, strict=True)]


def test_upstreams_chunk_drop_with_rerotation_runs_on_the_pool(
    model_engine: HFEngine, capsys: pytest.CaptureFixture[str]
) -> None:
    """The notebook's chunk drop runs as a torch fn on the pool over SmolLM2's KV: decoding differs from the undropped run yet stays fluent, and rerotating agrees more with the undropped continuation than not."""
    import functools

    ctx = connect(f"shm:///test-hf-{secrets.token_hex(6)}", chunk_size=CHUNK)
    with contextlib.ExitStack() as stack:
        # The pool closes before the store is destroyed.
        stack.callback(ctx.destroy)
        engine = engine_over(model_engine, ctx)
        attention = engine.attention
        prompts = [engine.encode(d, chat=False) for d in DOCUMENTS]
        # One 2-worker spawn pool for the three runs: it loads the model once.
        batch = lmc_batch.LMCacheBatchedStream(
            "process", max_workers=2, preload=[engine.load]
        )
        stack.callback(batch.close)
        base = _pool_run(batch, engine, prompts, None, "")
        agreement, nll = {}, {}
        for rerotate in (True, False):
            fn = functools.partial(
                drop_middle_chunks, attention=attention, rerotate=rerotate
            )
            salt = f"rerotate={rerotate}"
            runs = _pool_run(batch, engine, prompts, fn, salt)
            # Teacher-forced top-1 agreement with the undropped continuation.
            hits = [
                engine.score(context, ref, salt).argmax(axis=1) == np.asarray(ref)
                for (context, _), (_, ref) in zip(runs, base, strict=True)
            ]
            agreement[rerotate] = float(np.mean(np.concatenate(hits)))
            # Fluency: how the undropped model scores the dropped run's reply.
            nll[rerotate] = float(
                np.mean(
                    [
                        -engine.score(p, got)[np.arange(len(got)), got].mean()
                        for p, (_, got) in zip(prompts, runs, strict=True)
                    ]
                )
            )
            assert any(
                got != ref for (_, got), (_, ref) in zip(runs, base, strict=True)
            )
        rng = np.random.default_rng(0)
        noise = [rng.integers(100, 49000, 24).tolist() for _ in prompts]
        random_nll = float(
            np.mean(
                [
                    -engine.score(p, n)[np.arange(24), n].mean()
                    for p, n in zip(prompts, noise, strict=True)
                ]
            )
        )
        with capsys.disabled():
            print(
                f"\nchunk drop: top-1 agreement rerotated {agreement[True]:.2f}, "
                f"not rerotated {agreement[False]:.2f}; NLL/token of the reply: "
                f"rerotated {nll[True]:.2f}, not {nll[False]:.2f}, "
                f"random tokens {random_nll:.2f}"
            )
        assert nll[True] < 0.5 * random_nll
        assert agreement[True] > agreement[False]


def test_model_figures_run_the_model_on_the_pool() -> None:
    """The README's real-model figures come from a real run: exact prompt sizes, a prefill and decode rate, and the parent's and workers' memory."""
    from lmcache_mp.bench._model_run import model_figures

    figures = model_figures(streams=2, prompt_tokens=48, max_tokens=3, workers=2)
    assert (figures.streams, figures.prompt_tokens, figures.workers) == (2, 48, 2)
    assert figures.prefill_tput > 0 and figures.decode_ms_per_token > 0
    # SmolLM2-135M: 134,515,008 float32 parameters (lm_head is the
    # embedding, counted once).
    assert figures.weights_bytes == 4 * 134_515_008
    assert figures.pss_bytes > 0 and figures.rss_bytes > 0


def test_filler_prompts_have_the_asked_length(model_engine: HFEngine) -> None:
    """Each generated prompt has exactly the asked token count, and they differ."""
    from lmcache_mp.bench._model_run import filler_prompts

    prompts = filler_prompts(model_engine, 3, 100)
    assert [len(p) for p in prompts] == [100, 100, 100]
    assert len({tuple(p) for p in prompts}) == 3
