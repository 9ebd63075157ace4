"""Teacher-forced scoring over HTTP: ``OpenAICompletions.score``
against ``lmcache-mp serve`` (vLLM's ``prompt_logprobs`` and the legacy
``echo`` + ``logprobs``), and what the server answers to those shapes."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import numpy.typing as npt
import openai
import pytest

from lmcache_mp._harness.agreement import kl_divergence
from lmcache_mp.engine import EmbeddedEngine, EngineConfig
from lmcache_mp.engine.http._logprobs import read_rows, top_entries
from lmcache_mp.engine.http.openai import OpenAICompletions, post_completion
from lmcache_mp.engine.http.server import EngineServer, cli, serve
from lmcache_mp.errors import EngineHTTPError, LMCacheStreamError, StreamInputError
from lmcache_mp.kv import KVStore, connect
from tests.test_server import raw_request

CHUNK = 16
CONFIG = EngineConfig()
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}
WAIT = 20.0
SCORINGS = ("prompt_logprobs", "echo")
_F32 = npt.NDArray[np.float32]


@pytest.fixture(scope="module")
def shared() -> Iterator[tuple[EngineServer, KVStore]]:
    """A server on a named store, and the test's own handle of that store."""
    url = f"shm:///test-score-{uuid.uuid4().hex[:12]}"
    ctx = connect(url, chunk_size=CHUNK)
    try:
        with serve(port=0, store=url, chunk_size=CHUNK, config=CONFIG) as srv:
            yield srv, ctx
    finally:
        ctx.destroy()


@pytest.fixture
def server(shared: tuple[EngineServer, KVStore]) -> EngineServer:
    return shared[0]


@pytest.fixture
def ctx(shared: tuple[EngineServer, KVStore]) -> KVStore:
    return shared[1]


def fresh_prompt(length: int = 60) -> list[int]:
    """A prompt no other test sends (the module's store is shared)."""
    rng = np.random.default_rng(uuid.uuid4().int)
    return [int(t) for t in rng.integers(1, CONFIG.vocab_size, length)]


def client(server: EngineServer, **kwargs: Any) -> OpenAICompletions:
    kwargs.setdefault("vocab_size", CONFIG.vocab_size)
    return post_completion(server.url, server.model_name, timeout=WAIT, **kwargs)


def spread_top(rows: _F32, tokens: list[int], k: int) -> _F32:
    """The documented approximation, computed here from exact rows: the top
    ``k`` entries and the scored token keep their values, the mass left is
    spread evenly over the other tokens."""
    out = np.empty_like(rows)
    for i, (row, token) in enumerate(zip(rows, tokens, strict=True)):
        listed = set(np.argsort(-row, kind="stable")[:k].tolist()) | {token}
        ids = np.array(sorted(listed))
        rest = 1.0 - float(np.exp(row[ids].astype(np.float64)).sum())
        out[i] = np.log(max(rest, 1e-9) / (row.shape[0] - len(ids)))
        out[i, ids] = row[ids]
    return out


def reference(
    ctx: KVStore, prompt: list[int], salt: str = ""
) -> tuple[list[int], _F32]:
    """The engine's own greedy continuation and scores, over ``ctx``."""
    engine = EmbeddedEngine(ctx, CONFIG)
    reply = [e.token_id for e in engine(prompt, GREEDY, salt)]
    return reply, engine.score(prompt, reply, salt)


# -- the client against the server ---------------------------------------------------


@pytest.mark.parametrize("scoring", SCORINGS)
def test_scores_through_the_server_are_the_engines_top_tokens(
    server: EngineServer, ctx: KVStore, scoring: str
) -> None:
    """Each row's argmax is the engine's, and its 20 listed tokens carry the engine's log-probabilities; the rest of the row is the mass they leave, spread evenly."""
    prompt = fresh_prompt()
    reply, want = reference(ctx, prompt)
    got = client(server, scoring=scoring).score(prompt, reply)
    assert got.shape == want.shape and got.dtype == np.float32
    assert got.argmax(axis=1).tolist() == want.argmax(axis=1).tolist() == reply
    np.testing.assert_allclose(got, spread_top(want, reply, 20), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.exp(got).sum(axis=1), 1.0, rtol=1e-4)


@pytest.mark.parametrize("scoring", SCORINGS)
def test_kl_through_the_server_is_the_kl_of_the_spread_rows(
    server: EngineServer, ctx: KVStore, scoring: str
) -> None:
    """After an edit (half the cached tokens dropped), KL between served rows is the KL between the engine's rows reduced to their top 20 and spread evenly, the documented approximation."""
    prompt = fresh_prompt(80)
    reply, ref = reference(ctx, prompt)
    kv = ctx.retrieve(prompt)
    assert kv is not None
    keep = np.arange(0, kv.shape[2], 2)
    kept = [prompt[i] for i in keep]
    salt = f"half-{uuid.uuid4().hex}"
    ctx.store(np.ascontiguousarray(kv[:, :, keep]), kept, salt)
    context = kept + prompt[kv.shape[2] :]
    edited = EmbeddedEngine(ctx, CONFIG).score(context, reply, salt)
    scorer = client(server, scoring=scoring)
    served = kl_divergence(
        scorer.score(prompt, reply), scorer.score(context, reply, salt)
    )
    spread = kl_divergence(spread_top(ref, reply, 20), spread_top(edited, reply, 20))
    np.testing.assert_allclose(served, spread, rtol=1e-4, atol=1e-6)
    assert kl_divergence(ref, edited).mean() > 0


def test_a_cache_salt_scores_the_kv_stored_under_it(
    server: EngineServer, ctx: KVStore
) -> None:
    """The salt goes to the server as cache_salt: KV edited under a salt (values zeroed) changes that salt's scores only."""
    prompt = fresh_prompt()
    reply, plain = reference(ctx, prompt)
    kv = ctx.retrieve(prompt)
    assert kv is not None
    zeroed = kv.copy()
    zeroed[1] = 0
    salt = f"zeroed-{uuid.uuid4().hex}"
    ctx.store(zeroed, prompt[: kv.shape[2]], salt)
    scorer = client(server)
    edited = EmbeddedEngine(ctx, CONFIG).score(prompt, reply, salt)
    np.testing.assert_allclose(
        scorer.score(prompt, reply, salt), spread_top(edited, reply, 20), atol=1e-5
    )
    np.testing.assert_allclose(
        scorer.score(prompt, reply), spread_top(plain, reply, 20), atol=1e-5
    )
    assert not np.allclose(edited, plain)


def test_the_vocabulary_size_is_read_from_the_server(server: EngineServer) -> None:
    """Without vocab_size the client sizes its rows by the server's GET /v1/models card."""
    prompt = fresh_prompt()
    scored = client(server, vocab_size=None).score(prompt[:-4], prompt[-4:])
    assert scored.shape == (4, CONFIG.vocab_size)


def test_the_request_asks_for_the_prompts_logprobs_and_one_token_at_most(
    server: EngineServer,
) -> None:
    """prompt_logprobs requests ask for one token, echo requests for none; the official OpenAI client reads the echo answer."""
    scorer = client(server)
    assert scorer.top_logprobs == 20
    official = openai.OpenAI(
        base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=WAIT
    )
    prompt = fresh_prompt(20)
    answer = official.completions.create(
        model=server.model_name,
        prompt=prompt,
        echo=True,
        logprobs=3,
        max_tokens=0,
        extra_body={"return_tokens_as_token_ids": True},
    )
    logprobs = answer.choices[0].logprobs
    assert logprobs is not None and logprobs.top_logprobs is not None
    assert logprobs.tokens == [f"token_id:{t}" for t in prompt]
    assert logprobs.top_logprobs[0] is None
    assert all(len(e) in (3, 4) for e in logprobs.top_logprobs[1:] if e)
    assert answer.usage is not None and answer.usage.completion_tokens == 0


# -- errors --------------------------------------------------------------------------


def test_a_vocabulary_smaller_than_the_servers_is_a_stream_error(
    server: EngineServer,
) -> None:
    """A token the server lists beyond vocab_size raises LMCacheStreamError naming the vocabulary."""
    prompt = fresh_prompt()
    with pytest.raises(LMCacheStreamError, match="outside the vocabulary"):
        client(server, vocab_size=2).score(prompt[:-4], prompt[-4:])


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"vocab_size": 0}, "vocab_size"), ({"top_logprobs": 0}, "top_logprobs")],
)
def test_bad_scoring_settings_are_value_errors(
    server: EngineServer, kwargs: dict[str, Any], field: str
) -> None:
    """A vocabulary size or listed-token count below 1, or an unknown scoring, raises ValueError naming it."""
    with pytest.raises(ValueError, match=field):
        client(server, **kwargs)
    with pytest.raises(ValueError, match="scoring"):
        client(server, scoring="logits")


def test_server_errors_are_http_errors(server: EngineServer) -> None:
    """An unknown model, or more listed tokens than --max-logprobs, raises EngineHTTPError with the status and the field."""
    prompt = fresh_prompt()
    wrong = post_completion(server.url, "nope", vocab_size=CONFIG.vocab_size)
    with pytest.raises(EngineHTTPError) as missing:
        wrong.score(prompt[:-2], prompt[-2:])
    assert missing.value.status == 404
    with pytest.raises(EngineHTTPError, match="max-logprobs") as too_many:
        client(server, top_logprobs=21).score(prompt[:-2], prompt[-2:])
    assert too_many.value.status == 400


def test_scores_read_the_context_cached_past_its_end_as_the_engine_does(
    server: EngineServer, ctx: KVStore
) -> None:
    """Where the continuation itself is cached, the server still scores as engine.score: over the context's cached prefix, the continuation computed."""
    whole = fresh_prompt(64)
    list(EmbeddedEngine(ctx, CONFIG)(whole, {"max_tokens": 1}))  # caches 48 tokens
    want = EmbeddedEngine(ctx, CONFIG).score(whole[:20], whole[20:])
    got = client(server).score(whole[:20], whole[20:])
    np.testing.assert_allclose(got, spread_top(want, whole[20:], 20), atol=1e-5)


def test_listed_entries_put_the_prompt_token_first_with_its_rank() -> None:
    """top_entries lists the prompt's token first, then the top k by probability, each with its 1-based rank over the whole row (vLLM's)."""
    row = np.log(np.array([0.1, 0.4, 0.2, 0.3], np.float32))
    assert [(i, r) for i, _, r in top_entries(row, 2, 0)] == [(0, 4), (1, 1), (3, 2)]
    assert [(i, r) for i, _, r in top_entries(row, 2, 3)] == [(3, 2), (1, 1)]
    assert [lp for _, lp, _ in top_entries(row, 1, 1)] == [row[1]]


def test_a_row_the_server_left_null_is_a_stream_error() -> None:
    """A server that reused a continuation position from its cache (no prompt_logprobs_from) leaves it null: reading it raises LMCacheStreamError saying so."""
    doc = {"choices": [{"prompt_logprobs": [None, None, {"5": {"logprob": -0.1}}]}]}
    with pytest.raises(LMCacheStreamError, match="did not compute"):
        read_rows(doc, "prompt_logprobs", 1, 2, "http://x/v1/completions")


def test_an_empty_continuation_is_a_stream_input_error(server: EngineServer) -> None:
    """score needs a prompt and a continuation, as the engines' score."""
    with pytest.raises(StreamInputError, match="non-empty"):
        client(server).score([1, 2, 3], [])


# -- what the server answers -----------------------------------------------------------


def post(server: EngineServer, **body: Any) -> tuple[int, Any]:
    body.setdefault("model", server.model_name)
    status, _, doc = raw_request(
        server, "POST", "/v1/completions", json.dumps(body).encode()
    )
    return status, doc


def test_prompt_logprobs_are_null_where_the_kv_came_from_the_cache(
    server: EngineServer, ctx: KVStore
) -> None:
    """prompt_logprobs has a null first entry, nulls over the reused cached prefix (all but its last chunk token), then the listed tokens; nothing is stored."""
    prompt = fresh_prompt(40)
    list(EmbeddedEngine(ctx, CONFIG)(prompt[:33], {"max_tokens": 1}))  # 32 cached
    status, doc = post(server, prompt=prompt, prompt_logprobs=2, max_tokens=1)
    assert status == 200
    entries = doc["choices"][0]["prompt_logprobs"]
    assert len(entries) == 40
    assert entries[:32] == [None] * 32
    assert all(str(t) in e for t, e in zip(prompt[32:], entries[32:], strict=True))
    assert doc["usage"]["prompt_tokens_details"] == {"cached_tokens": 31}
    assert len(doc["choices"][0]["text"].split()) == 1
    cached = ctx.retrieve(prompt)
    assert cached is not None and cached.shape[2] == 32


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ({"logprobs": 1}, "logprobs"),
        ({"prompt_logprobs": 1, "max_tokens": 2}, "max_tokens"),
        ({"echo": True, "stream": True}, "echo"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ],
)
def test_scoring_requests_the_server_cannot_answer_get_400(
    server: EngineServer, body: dict[str, Any], field: str
) -> None:
    """Streamed prompt logprobs or echo, generated tokens' logprobs, more than one token with scoring, or a negative count: 400 naming the field."""
    status, doc = post(server, prompt=[1, 2, 3], **body)
    assert status == 400
    assert doc["error"]["param"] == field


def test_echo_without_ids_names_tokens_by_their_text(server: EngineServer) -> None:
    """Without return_tokens_as_token_ids, echo's tokens and top_logprobs keys are the tokens' text, and the text is the prompt's."""
    prompt = fresh_prompt(6)
    status, doc = post(server, prompt=prompt, echo=True, logprobs=1, max_tokens=0)
    assert status == 200
    choice = doc["choices"][0]
    pieces = [server.vocab.piece(t) for t in prompt]
    assert choice["text"] == "".join(pieces)
    assert choice["logprobs"]["tokens"] == pieces
    assert pieces[1] in choice["logprobs"]["top_logprobs"][1]


# -- a trained model behind serve ------------------------------------------------------


def test_serve_model_scores_as_the_trained_model() -> None:
    """serve(model="smollm2-135m") runs HFEngine: its card gives the vocabulary, and a score through it has the local engine's argmax (the greedy reply) and top-20 log-probabilities."""
    pytest.importorskip("transformers")
    from lmcache_mp.engine import HFEngine

    with serve(port=0, model="smollm2-135m", chunk_size=CHUNK) as srv:
        assert srv.models()["data"][0]["vocab_size"] == 49152
        local_ctx = connect(chunk_size=CHUNK)
        try:
            local = HFEngine(srv.engine.source, local_ctx)  # type: ignore[attr-defined]
            prompt = local.encode("The river runs past the old mill and", chat=False)
            reply = [e.token_id for e in local(prompt, GREEDY)]
            want = local.score(prompt, reply)
            got = post_completion(srv.url, srv.model_name, scoring="echo").score(
                prompt, reply
            )
        finally:
            local_ctx.destroy()
    assert got.argmax(axis=1).tolist() == reply
    np.testing.assert_allclose(got, spread_top(want, reply, 20), atol=1e-4)


def test_serve_cli_reports_a_model_it_cannot_load(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """lmcache-mp serve --model with no model there exits 1 naming the path."""
    assert cli(["--port", "0", "--model", "/nonexistent/model"]) == 1
    assert "/nonexistent/model" in capsys.readouterr().err
