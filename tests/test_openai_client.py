"""The OpenAI-compatible ``post_completion`` client, against real and broken servers."""

from __future__ import annotations

import json
import pickle
import socket
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

import lmcache_mp.batch as lmc_batch
import lmcache_mp.stream as lmc_stream
from lmcache_mp.edits import make_edit
from lmcache_mp.engine import EmbeddedEngine, EngineConfig
from lmcache_mp.engine.http.openai import OpenAICompletions, post_completion
from lmcache_mp.engine.http.server import serve
from lmcache_mp.errors import EngineHTTPError, LMCacheStreamError, SamplingParamsError
from lmcache_mp.kv import connect
from lmcache_mp.stream import TokenEvent
from tests._fakes import InMemoryKV

CHUNK = 16
WAIT = 10.0
SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
)

Script = Callable[[BaseHTTPRequestHandler, "Scripted"], None]


@dataclass
class Scripted:
    """A tiny HTTP server that answers every POST with a test's script."""

    script: Script | None = None
    bodies: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    #: Set by the test (or at teardown) to let a waiting script go on.
    gate: threading.Event = field(default_factory=threading.Event)
    #: Whether the script's wait on the gate ended because the test set it.
    gate_opened: bool = False
    url: str = ""

    def write_events(
        self, handler: BaseHTTPRequestHandler, events: list[Any], done: bool = True
    ) -> None:
        """Answer 200 with each event (JSON-encoded unless a str), then [DONE]."""
        handler.wfile.write(SSE_HEAD)
        for event in events:
            data = event if isinstance(event, str) else json.dumps(event)
            handler.wfile.write(f"data: {data}\n\n".encode())
            handler.wfile.flush()
        if done:
            handler.wfile.write(b"data: [DONE]\n\n")

    def wait_gate(self) -> None:
        """Block until the test opens the gate (at most WAIT seconds)."""
        self.gate_opened = self.gate.wait(WAIT)


@pytest.fixture
def scripted() -> Iterator[Scripted]:
    """A scripted server on a free loopback port."""
    state = Scripted()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length", "0"))
            state.bodies.append(json.loads(self.rfile.read(length)))
            state.headers.append(dict(self.headers))
            assert state.script is not None
            state.script(self, state)
            self.close_connection = True

        def log_message(self, format: str, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(
        target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
    )
    thread.start()
    state.url = f"http://127.0.0.1:{httpd.server_address[1]}"
    try:
        yield state
    finally:
        state.gate.set()
        httpd.shutdown()
        httpd.server_close()
        thread.join(WAIT)


def chunk(
    text: str,
    ids: list[Any] | None,
    finish: str | None = None,
    usage: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A completions stream chunk (vLLM's shape, ``return_token_ids``)."""
    choice: dict[str, Any] = {"index": 0, "text": text, "finish_reason": finish}
    if ids is not None:
        choice["token_ids"] = ids
    doc: dict[str, Any] = {"object": "text_completion", "choices": [choice]}
    if usage is not None:
        doc["usage"] = usage
    return doc


def usage_chunk(cached: int, completion: int) -> dict[str, Any]:
    """The final usage chunk, as vLLM sends it with include_usage."""
    return {
        "choices": [],
        "usage": {
            "prompt_tokens": 10,
            "completion_tokens": completion,
            "total_tokens": 10 + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        },
    }


def run(scripted: Scripted, script: Script, **kwargs: Any) -> list[TokenEvent]:
    """Run one completion against the scripted server."""
    scripted.script = script
    engine = post_completion(scripted.url, "m", timeout=WAIT, **kwargs)
    return list(engine([1, 2, 3], {"max_tokens": 4}, ""))


# -- the request -----------------------------------------------------------------


def test_request_passes_params_salt_and_key_through(scripted: Scripted) -> None:
    """Sampling params, cache_salt, extra_body and the API key reach the server."""
    scripted.script = lambda h, s: s.write_events(h, [])
    engine = post_completion(
        scripted.url + "/v1", "my-model", api_key="sk-1", extra_body={"top_k": 5}
    )
    params = {
        "max_tokens": 7,
        "temperature": 0.5,
        "top_p": 0.9,
        "seed": 3,
        "ignore_eos": True,
        "stop_token_ids": [9],
    }
    list(engine([4, 5], params, "salt-a"))
    body = scripted.bodies[0]
    assert {k: body[k] for k in params} == params
    assert (body["model"], body["prompt"], body["stream"]) == ("my-model", [4, 5], True)
    assert (body["cache_salt"], body["top_k"], body["return_token_ids"]) == (
        "salt-a",
        5,
        True,
    )
    assert body["stream_options"]["include_usage"] is True
    assert scripted.headers[0]["Authorization"] == "Bearer sk-1"


def test_empty_salt_is_not_sent(scripted: Scripted) -> None:
    """An empty cache_salt is left out of the request."""
    run(scripted, lambda h, s: s.write_events(h, []))
    assert "cache_salt" not in scripted.bodies[0]


def test_logprobs_mode_asks_for_and_reads_token_id_strings(scripted: Scripted) -> None:
    """token_ids='logprobs' reads ids from 'token_id:N' logprobs tokens."""
    events = [
        {
            "choices": [
                {
                    "index": 0,
                    "text": " a b",
                    "logprobs": {"tokens": ["token_id:7", "token_id:8"]},
                }
            ]
        },
        {
            "choices": [
                {
                    "index": 0,
                    "text": " c",
                    "logprobs": {"tokens": ["token_id:9"]},
                    "finish_reason": "length",
                }
            ]
        },
    ]
    got = run(scripted, lambda h, s: s.write_events(h, events), token_ids="logprobs")
    assert [(e.token_id, e.text) for e in got] == [(7, " a b"), (8, ""), (9, " c")]
    body = scripted.bodies[0]
    assert (body["logprobs"], body["return_tokens_as_token_ids"]) == (0, True)
    assert "return_token_ids" not in body


def test_client_owned_fields_cannot_be_overridden() -> None:
    """A sampling param naming model/prompt/stream is refused at call time."""
    engine = post_completion("http://127.0.0.1:9", "m")
    with pytest.raises(SamplingParamsError, match="'stream'"):
        engine([1], {"stream": False}, "")


@pytest.mark.parametrize(
    "kwargs",
    [
        {"base_url": "ftp://host"},
        {"base_url": "http://"},
        {"timeout": 0},
        {"connect_timeout": -1.0},
        {"token_ids": "guess"},
        {"model": ""},
    ],
)
def test_invalid_settings_are_rejected(kwargs: dict[str, Any]) -> None:
    """Bad URLs, timeouts, models and token id sources raise ValueError."""
    args = {"base_url": "http://127.0.0.1:8000", "model": "m", **kwargs}
    with pytest.raises(ValueError):
        post_completion(args.pop("base_url"), args.pop("model"), **args)


def test_client_pickles_as_its_settings() -> None:
    """The client pickles (for worker processes) and compares equal."""
    extra = {"top_k": 3}
    engine = post_completion("http://127.0.0.1:8000", "m", extra_body=extra)
    extra["top_k"] = 4
    copy = pickle.loads(pickle.dumps(engine))
    assert isinstance(copy, OpenAICompletions)
    assert copy == engine and copy.extra_body == {"top_k": 3}


# -- decoding the stream ---------------------------------------------------------


def test_tokens_are_yielded_as_they_arrive(scripted: Scripted) -> None:
    """The first token is delivered while the server still holds the rest."""

    def script(h: BaseHTTPRequestHandler, s: Scripted) -> None:
        s.write_events(h, [chunk(" a", [5])], done=False)
        s.wait_gate()
        s.write_events(h, [chunk(" b", [6], "length")])

    scripted.script = script
    events = post_completion(scripted.url, "m", timeout=WAIT)([1], {}, "")
    first = next(iter(events))
    scripted.gate.set()
    rest = list(events)
    assert scripted.gate_opened
    assert [first.token_id] + [e.token_id for e in rest] == [5, 6]


def test_final_usage_cached_tokens_land_on_the_last_token(scripted: Scripted) -> None:
    """Without continuous usage, the last token carries cached_tokens."""
    events = [chunk(" a", [5]), chunk(" b", [6], "length"), usage_chunk(32, 2)]
    got = run(scripted, lambda h, s: s.write_events(h, events))
    assert [(e.token_id, e.cached_tokens) for e in got] == [(5, None), (6, 32)]


def test_continuous_usage_gives_cached_tokens_from_the_first_token(
    scripted: Scripted,
) -> None:
    """Usage in every chunk puts cached_tokens on every event."""
    usage = usage_chunk(16, 1)["usage"]
    events = [chunk(" a", [5], usage=usage), chunk(" b", [6], usage=usage)]
    got = run(scripted, lambda h, s: s.write_events(h, events))
    assert [e.cached_tokens for e in got] == [16, 16]


def test_chunk_with_several_ids_gives_one_event_per_token(scripted: Scripted) -> None:
    """A chunk of several ids yields each id; the text goes with the first."""
    events = [chunk("", [1]), chunk(" xy", [2, 3])]
    got = run(scripted, lambda h, s: s.write_events(h, events))
    assert [(e.token_id, e.text) for e in got] == [(1, ""), (2, " xy"), (3, "")]


# -- failures --------------------------------------------------------------------


def test_http_error_carries_status_and_server_message(scripted: Scripted) -> None:
    """HTTP 500 with an OpenAI error body raises with the status and message."""

    def script(h: BaseHTTPRequestHandler, s: Scripted) -> None:
        body = json.dumps({"error": {"message": "GPU on fire", "type": "x"}}).encode()
        h.send_response(500)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    with pytest.raises(EngineHTTPError, match=r"HTTP 500 .*GPU on fire") as info:
        run(scripted, script)
    assert (info.value.status, info.value.server_message) == (500, "GPU on fire")
    again = pickle.loads(pickle.dumps(info.value))
    assert (again.status, again.server_message) == (500, "GPU on fire")


@pytest.mark.parametrize(
    ("events", "match"),
    [
        (["{not json"], "not JSON"),
        ([chunk(" a", None)], "without token ids"),
        ([chunk(" a", [1.5])], "expected token ids"),
        (['{"error": {"message": "engine died"}}'], "engine died"),
    ],
    ids=["bad-json", "missing-ids", "bad-ids", "error-event"],
)
def test_malformed_event_raises(
    scripted: Scripted, events: list[Any], match: str
) -> None:
    """A bad event, ids missing or not ints, or an error event raise."""
    with pytest.raises(LMCacheStreamError, match=match):
        run(scripted, lambda h, s: s.write_events(h, events))


def test_usage_without_any_token_id_raises(scripted: Scripted) -> None:
    """Usage reporting tokens that never came with ids is an error."""
    events = [chunk("", None, "length"), usage_chunk(0, 3)]
    with pytest.raises(LMCacheStreamError, match="3 completion tokens"):
        run(scripted, lambda h, s: s.write_events(h, events))


def test_stream_cut_before_done_raises(scripted: Scripted) -> None:
    """A connection closed before data: [DONE] raises, naming the progress."""
    events = [chunk(" a", [5])]
    with pytest.raises(
        LMCacheStreamError, match=r"before data: \[DONE\] after 1 tokens"
    ):
        run(scripted, lambda h, s: s.write_events(h, events, done=False))


def test_chunked_body_cut_mid_chunk_raises(scripted: Scripted) -> None:
    """A chunked body that breaks off inside a chunk raises."""

    def script(h: BaseHTTPRequestHandler, s: Scripted) -> None:
        h.wfile.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n400\r\ndata: {"
        )

    with pytest.raises(LMCacheStreamError, match="connection broke"):
        run(scripted, script)


def test_non_event_stream_answer_raises(scripted: Scripted) -> None:
    """A 200 that is not text/event-stream raises naming the content type."""

    def script(h: BaseHTTPRequestHandler, s: Scripted) -> None:
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", "2")
        h.end_headers()
        h.wfile.write(b"{}")

    with pytest.raises(LMCacheStreamError, match="application/json"):
        run(scripted, script)


def test_read_timeout_raises(scripted: Scripted) -> None:
    """A server that stops sending raises after the read timeout."""

    def script(h: BaseHTTPRequestHandler, s: Scripted) -> None:
        s.write_events(h, [chunk(" a", [5])], done=False)
        s.wait_gate()

    scripted.script = script
    engine = post_completion(scripted.url, "m", timeout=0.3)
    with pytest.raises(LMCacheStreamError, match="read timeout"):
        list(engine([1], {}, ""))


def test_connection_refused_raises() -> None:
    """A port nobody listens on raises naming the URL."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    engine = post_completion(f"http://127.0.0.1:{port}", "m", connect_timeout=WAIT)
    with pytest.raises(
        LMCacheStreamError, match=f"cannot connect to http://127.0.0.1:{port}"
    ):
        list(engine([1], {}, ""))


# -- against lmcache-mp serve ----------------------------------------------------


def test_tokens_match_the_embedded_engine_over_http() -> None:
    """Through the server, the client yields exactly the engine's tokens."""
    config = EngineConfig()
    prompt = list(range(1, 41))
    params = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
    local = list(EmbeddedEngine(InMemoryKV(CHUNK), config)(prompt, params, ""))
    with serve(port=0, chunk_size=CHUNK, config=config) as srv:
        remote = list(post_completion(srv.url, srv.model_name)(prompt, params, ""))
    assert [(e.token_id, e.text) for e in remote] == [
        (e.token_id, e.text) for e in local
    ]


def test_batch_over_http_reuses_the_edited_kv() -> None:
    """prefill -> modify -> decode over HTTP: decode hits the edited KV.

    The server and the batch share a named store; workers are spawned
    processes, each sending its streams' requests over HTTP.
    """
    url = f"shm:///test-openai-{uuid.uuid4().hex[:12]}"
    ctx = connect(url, chunk_size=CHUNK)
    try:
        with serve(port=0, store=url, chunk_size=CHUNK) as srv:
            engine = post_completion(srv.url, srv.model_name, timeout=60)
            prompts = [[1 + (7 * i + 3 * s) % 500 for i in range(96)] for s in range(4)]
            with lmc_batch.LMCacheBatchedStream(
                "process", max_workers=2, mp_context="spawn", phase_timeout=120
            ) as batch:
                for toks in prompts:
                    batch.add(lmc_stream.create_request(ctx, engine, toks))
                prefill = batch.prefill({"temperature": 0}).to_dict()["metrics"]
                edit = make_edit("random", keep=0.5, keep_first=8, keep_last=8)
                batch.modify(edit)
                kept = [m.tokens_after for m in batch.modify_metrics.values()]
                decode = batch.decode(
                    {"max_tokens": 4, "temperature": 0, "ignore_eos": True}
                ).to_dict()["metrics"]
        assert (decode["config"]["executor"], decode["config"]["workers"]) == (
            "process",
            2,
        )
        assert prefill["cache"]["cache_hit_tokens"] == 0
        assert decode["results"]["output_tokens"] == 4 * len(prompts)
        # Each decode reused the full chunks of the edited (kept) tokens.
        assert kept == [48] * len(prompts)
        expect = sum((k // CHUNK) * CHUNK for k in kept)
        assert expect > 0
        assert decode["cache"]["cache_hit_tokens"] == expect
    finally:
        ctx.destroy()
