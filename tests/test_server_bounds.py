"""What ``lmcache-mp serve`` bounds: generations at once, the queue, open
connections, slow clients, and bodies that do not parse."""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lmcache_mp.engine.http._server import Admission, APIError
from lmcache_mp.engine.http.server import EngineServer, ServerLimits, serve

WAIT = 20.0
BODY = {"model": "lmcache-mp-embedded", "prompt": [1, 2, 3, 4], "max_tokens": 2}


@pytest.fixture
def bounded() -> Iterator[EngineServer]:
    """A server running one generation at once with one place in its queue,
    connections cut after a second without a whole request."""
    limits = ServerLimits(
        max_num_seqs=1,
        max_queued=1,
        queue_timeout=1.0,
        read_timeout=1.0,
        max_connections=8,
    )
    with serve(port=0, chunk_size=16, limits=limits) as srv:
        yield srv


def _post(server: EngineServer, body: bytes) -> tuple[int, dict[str, str], object]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=WAIT)
    try:
        conn.request("POST", "/v1/completions", body=body)
        resp = conn.getresponse()
        data = resp.read()
        return resp.status, dict(resp.getheaders()), json.loads(data)
    finally:
        conn.close()


def test_admission_runs_a_fixed_number_and_queues_a_bounded_number() -> None:
    """One slot, one place in the queue: the first runs, the second waits
    for the slot and runs once it frees, the third is refused with 503 and
    Retry-After."""
    admission = Admission(running=1, queued=1, wait_s=WAIT)
    first, second = admission.enter(), admission.enter()
    with pytest.raises(APIError) as refused:
        admission.enter()
    assert refused.value.status == 503
    assert dict(refused.value.headers)["Retry-After"] == "1"
    ran = threading.Event()

    def wait_then_run() -> None:
        with second.run():
            ran.set()

    with first.run():
        waiter = threading.Thread(target=wait_then_run)
        waiter.start()
        assert not ran.wait(0.3)
    waiter.join(timeout=WAIT)
    assert ran.is_set()
    first.release()
    second.release()
    admission.enter().release()


def test_a_queued_request_gives_up_after_the_queue_timeout() -> None:
    """No slot frees within wait_s: 503 with Retry-After."""
    admission = Admission(running=1, queued=1, wait_s=0.2)
    busy, queued = admission.enter(), admission.enter()
    with busy.run(), pytest.raises(APIError) as late, queued.run():
        pass
    assert late.value.status == 503 and "no generation slot" in late.value.message


def test_a_full_server_refuses_with_503_and_retry_after(
    bounded: EngineServer,
) -> None:
    """With its slot busy and its queue full, a completion gets 503 at once
    with Retry-After; once they free, the same request is answered."""
    body = json.dumps(BODY).encode()
    running, waiting = bounded.admission.enter(), bounded.admission.enter()
    try:
        status, headers, doc = _post(bounded, body)
    finally:
        running.release()
        waiting.release()
    assert status == 503 and headers["Retry-After"] == "1"
    assert doc["error"]["code"] == "server_busy"  # type: ignore[index]
    assert _post(bounded, body)[0] == 200


def test_connections_past_the_bound_get_503(bounded: EngineServer) -> None:
    """Past max_connections open connections, a new one is answered 503 and
    closed; closing the others lets new ones in."""
    held = [socket.create_connection(("127.0.0.1", bounded.port)) for _ in range(8)]
    try:
        deadline = time.monotonic() + WAIT
        while len(bounded._httpd._open) < 8 and time.monotonic() < deadline:
            time.sleep(0.01)
        extra = socket.create_connection(("127.0.0.1", bounded.port), timeout=WAIT)
        reply = extra.makefile("rb").read()
        extra.close()
    finally:
        for sock in held:
            sock.close()
    assert reply.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in reply
    deadline = time.monotonic() + WAIT
    while bounded._httpd._open and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _post(bounded, json.dumps(BODY).encode())[0] == 200


@pytest.mark.parametrize("drip", ["headers", "body", "nothing"])
def test_a_slow_client_is_cut_after_the_read_timeout(
    bounded: EngineServer, drip: str
) -> None:
    """A client that sends its request a byte every 0.2 s (or nothing) is
    disconnected once read_timeout has passed, well before it finishes."""
    body = json.dumps(BODY).encode()
    request = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    sock = socket.create_connection(("127.0.0.1", bounded.port), timeout=WAIT)
    start = time.monotonic()
    sent = 0
    if drip == "body":
        sock.sendall(request[: request.index(b"\r\n\r\n") + 4])
        sent = request.index(b"\r\n\r\n") + 4
    try:
        while time.monotonic() - start < WAIT:
            if drip != "nothing" and sent < len(request):
                sock.sendall(request[sent : sent + 1])
                sent += 1
            time.sleep(0.2)
            sock.setblocking(False)
            try:
                if sock.recv(4096) == b"":
                    break
            except BlockingIOError:
                pass
            finally:
                sock.setblocking(True)
    except (BrokenPipeError, ConnectionResetError):
        pass
    finally:
        sock.close()
    cut_after = time.monotonic() - start
    assert 0.9 < cut_after < 5.0, cut_after
    assert sent < len(request)


@pytest.mark.parametrize(
    "body",
    [b"[" * 100_000, b"{" * 100_000, b'{"model": ' + b"[" * 50_000, b"\xff\xfe"],
    ids=["nested-lists", "nested-objects", "nested-value", "not-utf8"],
)
def test_a_body_that_does_not_parse_gets_400(
    bounded: EngineServer, body: bytes
) -> None:
    """However it fails to parse (too deep for the parser included), the
    answer is 400 invalid_json, and the server goes on serving."""
    status, _, doc = _post(bounded, body)
    assert status == 400 and doc["error"]["code"] == "invalid_json"  # type: ignore[index]
    assert _post(bounded, json.dumps(BODY).encode())[0] == 200


@pytest.mark.slow
def test_a_thousand_concurrent_requests_are_each_answered_or_refused() -> None:
    """1,000 connections at once to a fresh ``lmcache-mp serve`` (loopback,
    64-token prompts): each gets 200 or 503 with Retry-After, the server is
    alive and healthy after, and its RSS stays under 1 GiB."""
    script = Path(__file__).parent.parent / "scripts" / "serve_load.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--requests", "1000", "--prompt-tokens", "64"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout)
    print(seen)
    assert seen["failed"] == {}
    assert seen["answered"] + seen["refused"] == 1000 and seen["answered"] > 0
    assert seen["alive"] and seen["healthy"]
    assert seen["peak_rss_mib"] < 1024
