"""``lmcache-mp serve``: an OpenAI-compatible API over the embedded engine."""

from __future__ import annotations

import argparse
import http.client
import json
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import openai
import pytest

from lmcache_mp.engine import EmbeddedEngine, EngineConfig
from lmcache_mp.engine.http.openai import post_completion
from lmcache_mp.engine.http.server import EngineServer, add_serve_parser, cli, serve
from lmcache_mp.errors import KVConfigError
from lmcache_mp.kv import connect
from tests._fakes import InMemoryKV

CHUNK = 16
CONFIG = EngineConfig()
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 6, "ignore_eos": True}
WAIT = 20.0


@pytest.fixture(scope="module")
def server() -> Iterator[EngineServer]:
    """One in-process server on a free port with a temporary store."""
    with serve(port=0, chunk_size=CHUNK, config=CONFIG) as srv:
        yield srv


@pytest.fixture
def client(server: EngineServer) -> openai.OpenAI:
    """The official OpenAI client pointed at the server."""
    return openai.OpenAI(
        base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=WAIT
    )


def reference(prompt: list[int], params: dict[str, Any]) -> tuple[list[int], str]:
    """What the engine itself generates for a prompt (on a cold cache)."""
    engine = EmbeddedEngine(InMemoryKV(CHUNK), CONFIG)
    events = list(engine(prompt, params, ""))
    return [e.token_id for e in events], "".join(e.text for e in events)


def fresh_prompt(length: int = 40) -> list[int]:
    """A prompt no other test sends (the module's store is shared)."""
    rng = random.Random(uuid.uuid4().int)
    return [rng.randrange(1, CONFIG.vocab_size) for _ in range(length)]


def raw_request(
    server: EngineServer,
    method: str,
    path: str,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, str], Any]:
    """Send one request with http.client; return status, headers, JSON body."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=WAIT)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        data = resp.read()
        return resp.status, dict(resp.getheaders()), json.loads(data) if data else None
    finally:
        conn.close()


def test_models_lists_the_served_model(
    client: openai.OpenAI, server: EngineServer
) -> None:
    """GET /v1/models lists exactly the served model name."""
    models = client.models.list()
    assert [m.id for m in models.data] == [server.model_name]


def test_health_answers_ok(server: EngineServer) -> None:
    """GET /health answers 200."""
    status, _, body = raw_request(server, "GET", "/health")
    assert (status, body) == (200, {"status": "ok"})


def test_streaming_chunks_match_the_engine(
    client: openai.OpenAI, server: EngineServer
) -> None:
    """A streamed completion's token ids and text are the engine's output."""
    prompt = fresh_prompt()
    want_ids, want_text = reference(prompt, GREEDY)
    chunks = list(
        client.completions.create(
            model=server.model_name,
            prompt=prompt,
            stream=True,
            max_tokens=GREEDY["max_tokens"],
            temperature=0,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )
    )
    ids = [
        t
        for c in chunks
        for ch in c.choices
        for t in (ch.model_extra or {})["token_ids"]
    ]
    text = "".join(ch.text for c in chunks for ch in c.choices)
    assert (ids, text) == (want_ids, want_text)
    assert (chunks[0].choices[0].model_extra or {})["prompt_token_ids"] == prompt
    assert chunks[-1].choices[0].finish_reason == "length"


def test_non_streaming_response_matches_the_engine(
    client: openai.OpenAI, server: EngineServer
) -> None:
    """A plain JSON completion holds the engine's ids, text and usage."""
    prompt = fresh_prompt()
    want_ids, want_text = reference(prompt, GREEDY)
    result = client.completions.create(
        model=server.model_name,
        prompt=prompt,
        max_tokens=GREEDY["max_tokens"],
        temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    choice = result.choices[0]
    assert ((choice.model_extra or {})["token_ids"], choice.text) == (
        want_ids,
        want_text,
    )
    assert result.usage is not None
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (
        len(prompt),
        len(want_ids),
    )


def test_text_prompt_is_tokenized_with_the_toy_vocab(
    client: openai.OpenAI, server: EngineServer
) -> None:
    """A text prompt gives the same completion as its toy-vocab token ids."""
    ids = fresh_prompt(12)
    text = EmbeddedEngine(InMemoryKV(CHUNK), CONFIG).detokenize(ids)
    result = client.completions.create(
        model=server.model_name,
        prompt=text,
        max_tokens=4,
        temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    assert (result.choices[0].model_extra or {})["prompt_token_ids"] == ids
    assert result.choices[0].text == reference(ids, {**GREEDY, "max_tokens": 4})[1]


def test_usage_reports_reused_prompt_tokens(
    client: openai.OpenAI, server: EngineServer
) -> None:
    """The second identical request reports its cached full chunks."""
    prompt = fresh_prompt(40)
    cached = []
    for _ in range(2):
        stream = client.completions.create(
            model=server.model_name,
            prompt=prompt,
            stream=True,
            max_tokens=2,
            stream_options={"include_usage": True},
        )
        usage = [c.usage for c in stream if c.usage is not None][-1]
        assert usage.prompt_tokens_details is not None
        cached.append(usage.prompt_tokens_details.cached_tokens)
    assert cached == [0, (len(prompt) // CHUNK) * CHUNK]


def test_cache_salt_isolates_requests(server: EngineServer) -> None:
    """KV stored under one cache_salt is not reused under another."""
    prompt = fresh_prompt(40)
    engine = post_completion(server.url, server.model_name)
    params = {"max_tokens": 1, "ignore_eos": True}
    list(engine(prompt, params, "alice"))
    other = list(engine(prompt, params, "bob"))
    again = list(engine(prompt, params, "alice"))
    full_chunks = (len(prompt) // CHUNK) * CHUNK
    assert (other[0].cached_tokens, again[0].cached_tokens) == (0, full_chunks)


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "code", "param"),
    [
        ("POST", "/v1/completions", b"{not json", 400, "invalid_json", None),
        (
            "POST",
            "/v1/completions",
            b'{"model": "gpt-9", "prompt": [1, 2]}',
            404,
            "model_not_found",
            "model",
        ),
        (
            "POST",
            "/v1/completions",
            b'{"model": "lmcache-mp-embedded", "prompt": [1], "temperature": -1}',
            400,
            "invalid_value",
            "temperature",
        ),
        (
            "POST",
            "/v1/completions",
            b'{"model": "lmcache-mp-embedded", "prompt": [1, 99999]}',
            400,
            "invalid_value",
            "prompt",
        ),
        (
            "POST",
            "/v1/completions",
            b'{"model": "lmcache-mp-embedded", "prompt": [1], "logprobs": 1}',
            400,
            "unsupported_parameter",
            "logprobs",
        ),
        (
            "POST",
            "/v1/completions",
            b'{"model": "lmcache-mp-embedded", "prompt": [1], '
            b'"stream_options": {"include_usage": true}}',
            400,
            "invalid_value",
            "stream_options",
        ),
        ("GET", "/v1/completions", None, 405, "method_not_allowed", None),
        ("POST", "/v1/models", b"{}", 405, "method_not_allowed", None),
        ("GET", "/v1/chat/completions", None, 404, "unknown_url", None),
    ],
)
def test_bad_request_gets_openai_error(
    server: EngineServer,
    method: str,
    path: str,
    body: bytes | None,
    status: int,
    code: str,
    param: str | None,
) -> None:
    """Each bad request gets its 4xx and an OpenAI-style error body."""
    got, headers, doc = raw_request(
        server, method, path, body, {"Content-Type": "application/json"}
    )
    assert got == status
    assert set(doc["error"]) == {"message", "type", "param", "code"}
    assert (doc["error"]["code"], doc["error"]["param"]) == (code, param)
    assert doc["error"]["type"] == "invalid_request_error"
    assert doc["error"]["message"]
    if status == 405:
        assert headers["Allow"] in ("GET", "POST")


class FailingEngine:
    """Stands in for the engine: prefill raises the given exception."""

    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    def tokenize(self, text: str) -> list[int]:
        """Any text is one token."""
        return [1]

    def __call__(self, prompt: list[int], params: Any, salt: str) -> Iterator[Any]:
        """Fail as the real engine would at prefill."""
        raise self.exc


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (KVConfigError("stored KV has another layout"), "engine_error"),
        (RuntimeError("numpy exploded"), "internal_error"),
    ],
)
def test_engine_failure_gets_500_with_openai_error(exc: Exception, code: str) -> None:
    """An engine failure answers 500 with a server_error body naming it."""
    with serve(port=0, chunk_size=CHUNK) as srv:
        srv.engine = FailingEngine(exc)  # type: ignore[assignment]
        body = json.dumps({"model": srv.model_name, "prompt": [1]}).encode()
        status, _, doc = raw_request(srv, "POST", "/v1/completions", body)
    assert (status, doc["error"]["type"], doc["error"]["code"]) == (
        500,
        "server_error",
        code,
    )
    assert str(exc) in doc["error"]["message"]


def test_too_large_body_gets_413_unread(server: EngineServer) -> None:
    """A Content-Length over the limit is refused before the body is read."""
    status, headers, doc = raw_request(
        server,
        "POST",
        "/v1/completions",
        b"{}",
        {"Content-Length": str(server.max_body_bytes + 1)},
    )
    assert (status, doc["error"]["code"]) == (413, "request_too_large")
    assert headers["Connection"] == "close"


def test_many_concurrent_requests_all_succeed(server: EngineServer) -> None:
    """32 requests at once all get the engine's exact output."""
    prompts = [fresh_prompt(20 + i) for i in range(32)]
    engine = post_completion(server.url, server.model_name, timeout=WAIT)

    def run(prompt: list[int]) -> list[int]:
        return [e.token_id for e in engine(prompt, GREEDY, "")]

    with ThreadPoolExecutor(32) as pool:
        futures = [pool.submit(run, p) for p in prompts]
        got = [f.result(timeout=60) for f in futures]
    assert got == [reference(p, GREEDY)[0] for p in prompts]


def test_server_survives_a_client_leaving_mid_stream(server: EngineServer) -> None:
    """A client that hangs up mid-stream does not stop the server."""
    engine = post_completion(server.url, server.model_name)
    events = iter(engine(fresh_prompt(), {**GREEDY, "max_tokens": 200}, ""))
    next(events)
    events.close()  # type: ignore[attr-defined]
    status, _, _ = raw_request(server, "GET", "/health")
    assert status == 200


def test_named_store_is_shared_with_other_handles() -> None:
    """With store=shm:///NAME, the prompt's KV is visible to another handle."""
    url = f"shm:///test-serve-{uuid.uuid4().hex[:12]}"
    ctx = connect(url, chunk_size=CHUNK)
    try:
        prompt = fresh_prompt(40)
        with serve(port=0, store=url, chunk_size=CHUNK, config=CONFIG) as srv:
            list(
                post_completion(srv.url, srv.model_name)(prompt, {"max_tokens": 1}, "")
            )
        kv = ctx.retrieve(prompt)
        assert kv is not None and kv.shape[2] == 32
    finally:
        ctx.destroy()


@pytest.mark.parametrize("save", [True, False], ids=["decode-cache", "prompt-only"])
def test_a_named_store_keeps_the_generated_tokens_kv_unless_told_not_to(
    save: bool,
) -> None:
    """With store=shm:///NAME, the KV of the tokens a completion generates
    is stored as they fill chunks, bit-exact with a one-shot prefill of
    prompt + completion; with save_decode_cache=False only the prompt's
    chunks are."""
    url = f"shm:///test-serve-{uuid.uuid4().hex[:12]}"
    ctx = connect(url, chunk_size=CHUNK)
    try:
        prompt = fresh_prompt(40)
        with serve(
            port=0,
            store=url,
            chunk_size=CHUNK,
            config=CONFIG,
            save_decode_cache=save,
        ) as srv:
            complete = post_completion(srv.url, srv.model_name)
            events = list(complete(prompt, {**GREEDY, "max_tokens": 30}, ""))
        tokens = prompt + [e.token_id for e in events]
        kv = ctx.retrieve(tokens)
        expected = 64 if save else 32
        assert kv is not None and kv.shape[2] == expected
        one_shot = InMemoryKV(CHUNK)
        list(EmbeddedEngine(one_shot, CONFIG)(tokens, {"max_tokens": 1}, ""))
        reference = one_shot.retrieve(tokens)
        assert reference is not None
        np.testing.assert_array_equal(kv, reference[:, :, :expected])
    finally:
        ctx.destroy()


def test_no_decode_cache_flag_turns_the_decode_cache_off() -> None:
    """``serve --no-decode-cache`` parses to save_decode_cache=False; the
    default keeps it on."""
    parser = argparse.ArgumentParser(prog="lmcache-mp")
    add_serve_parser(parser.add_subparsers())
    assert parser.parse_args(["serve"]).save_decode_cache is True
    off = parser.parse_args(["serve", "--no-decode-cache"])
    assert off.save_decode_cache is False


def test_shutdown_stops_serving_and_removes_the_temporary_store() -> None:
    """After shutdown the port refuses connections and the store is gone."""
    srv = serve(port=0, chunk_size=CHUNK)
    port, store_dir = srv.port, srv.engine.ctx.path  # type: ignore[attr-defined]
    assert os.path.isdir(store_dir)
    srv.shutdown()
    srv.shutdown()  # idempotent
    assert not os.path.exists(store_dir)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT)
    with pytest.raises(ConnectionRefusedError):
        conn.request("GET", "/health")
    conn.close()


def test_cli_rejects_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    """Bad flags and invalid model shapes exit with status 2 and a message."""
    assert cli(["--dtype", "int8"]) == 2
    assert cli(["--port", "0", "--head-dim", "3"]) == 2
    assert "head_dim" in capsys.readouterr().err


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_cli_subprocess_serves_and_stops_on_signal(sig: signal.Signals) -> None:
    """The CLI prints its URL, serves /health, and exits 0 on SIGINT/SIGTERM."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "lmcache_mp.engine.http.server", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    lines: queue.Queue[str] = queue.Queue()

    def read_stdout() -> None:
        for line in proc.stdout or ():
            lines.put(line)

    reader = threading.Thread(target=read_stdout, daemon=True)
    reader.start()
    try:
        first = lines.get(timeout=WAIT)
        prefix = "lmcache-mp serve: listening on http://127.0.0.1:"
        assert first.startswith(prefix)
        port = int(first.strip().rsplit(":", 1)[1])
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT)
        conn.request("GET", "/health")
        assert conn.getresponse().status == 200
        conn.close()
        proc.send_signal(sig)
        assert proc.wait(timeout=WAIT) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=WAIT)
        reader.join(timeout=WAIT)
        if proc.stderr is not None:
            proc.stderr.close()
