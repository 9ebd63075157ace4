"""The HTTP plumbing of ``lmcache-mp serve``: threads, bounds, JSON, errors, SSE.

Standard library only: a :class:`ThreadingHTTPServer` (one daemon thread
per connection) that remembers its open connections so that shutdown can
close them, refuses connections past a bound and cuts clients that are
slow to send a request; the :class:`Admission` of generations (a fixed
number run, a bounded number wait, the rest are refused with 503 and
``Retry-After``, as vLLM's ``--max-num-seqs`` and its waiting queue); and a
request handler base with OpenAI-style JSON errors and chunked
server-sent events.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from lmcache_mp.engine.http._sse import encode_event

__all__ = ["APIError", "Admission", "JSONRequestHandler", "TrackingHTTPServer"]

#: Seconds a refused client is told to wait before it retries.
RETRY_AFTER_S = 1

logger = logging.getLogger("lmcache_mp.engine.http.server")


class APIError(Exception):
    """An error answered to the client as an OpenAI-style JSON body.

    Internal to the server: raised while handling a request, turned into
    ``{"error": {"message", "type", "param", "code"}}`` with ``status``.

    Args:
        status: The HTTP status.
        message: What is wrong, naming the offending value.
        code: A short machine-readable code, e.g. ``"model_not_found"``.
        param: The request field at fault, if any.
        headers: Extra response headers (e.g. ``Allow``).
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str,
        param: str | None = None,
        headers: Iterable[tuple[str, str]] = (),
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = tuple(headers)

    def body(self) -> dict[str, Any]:
        """Return the JSON error body."""
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {
            "error": {
                "message": self.message,
                "type": kind,
                "param": self.param,
                "code": self.code,
            }
        }


def busy_error(message: str) -> APIError:
    """A 503 that tells the client when to retry."""
    return APIError(
        503,
        message,
        code="server_busy",
        headers=[("Retry-After", str(RETRY_AFTER_S))],
    )


class Admission:
    """At most ``running`` generations at once; ``queued`` more may wait.

    A request takes a place (:meth:`enter`) before its body is read, so
    that the memory of the bodies held is bounded too, then waits for a
    slot (:meth:`Ticket.run`).

    Args:
        running: Generations computed at once.
        queued: Requests that may wait for a slot; past them, 503.
        wait_s: Longest wait for a slot; past it, 503.
    """

    def __init__(self, running: int, queued: int, wait_s: float) -> None:
        self.running = running
        self.queued = queued
        self.wait_s = wait_s
        self._cond = threading.Condition()
        self._active = 0
        self._places = 0

    def enter(self) -> Admission.Ticket:
        """Take a place, or refuse.

        Raises:
            APIError: 503 with ``Retry-After`` when every slot and every
                place in the queue is taken.
        """
        with self._cond:
            if self._places >= self.running + self.queued:
                raise busy_error(
                    f"the server is at capacity: {self.running} generations "
                    f"running and {self.queued} queued; retry later"
                )
            self._places += 1
        return Admission.Ticket(self)

    class Ticket:
        """A place taken by :meth:`Admission.enter`; leave it with
        :meth:`release`."""

        def __init__(self, admission: Admission) -> None:
            self._admission = admission
            self._released = False

        @contextlib.contextmanager
        def run(self) -> Iterator[None]:
            """Hold a slot for the block, waiting for one if need be.

            Raises:
                APIError: 503 if no slot freed within ``wait_s``.
            """
            adm = self._admission
            with adm._cond:
                if not adm._cond.wait_for(
                    lambda: adm._active < adm.running, adm.wait_s
                ):
                    raise busy_error(
                        f"no generation slot freed in {adm.wait_s:g}s; retry later"
                    )
                adm._active += 1
            try:
                yield
            finally:
                with adm._cond:
                    adm._active -= 1
                    adm._cond.notify()

        def release(self) -> None:
            """Give the place back; idempotent."""
            if not self._released:
                self._released = True
                with self._admission._cond:
                    self._admission._places -= 1


class TrackingHTTPServer(ThreadingHTTPServer):
    """A threading HTTP server that bounds and can close its connections.

    Handler threads are daemons and are not joined on close; instead
    :meth:`close_connections` shuts every open socket down, which ends
    their reads and writes, and waits for them to finish. Past
    ``max_connections`` open ones, a new connection gets a 503 at once,
    with no thread. A connection has ``read_timeout`` seconds to send
    each request, headers and body, from the moment the server waits for
    it (keep-alive idle time included): a client that sends a byte now
    and then is cut when it runs out, not only one that sends nothing.

    Args:
        address: ``(host, port)`` to listen on.
        handler: The request handler class.
        max_connections: Open connections served at once.
        read_timeout: Seconds a client has to send a request.
    """

    daemon_threads = True
    block_on_close = False
    # socketserver's default backlog is 5: a burst of connections (a batch
    # opening one per stream) overflowed it and a connection was reset.
    request_queue_size = 1024

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[BaseHTTPRequestHandler],
        *,
        max_connections: int = 1024,
        read_timeout: float = 30.0,
    ) -> None:
        self.max_connections = max_connections
        self.read_timeout = read_timeout
        self._open: set[socket.socket] = set()
        self._reading: dict[socket.socket, float] = {}
        self._idle = threading.Condition()
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        """Remember the connection, then handle it on a new thread; refuse
        it with a 503 when too many are open."""
        with self._idle:
            full = len(self._open) >= self.max_connections
            if not full:
                self._open.add(request)
                self._reading[request] = time.monotonic() + self.read_timeout
        if full:
            self._refuse(request)
            return
        super().process_request(request, client_address)

    def _refuse(self, request: socket.socket) -> None:
        err = busy_error(
            f"the server has {self.max_connections} connections open; retry later"
        )
        body = json.dumps(err.body()).encode()
        head = (
            "HTTP/1.1 503 Service Unavailable\r\n"
            "Content-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n"
            f"Retry-After: {RETRY_AFTER_S}\r\n"
            "Connection: close\r\n\r\n"
        ).encode()
        with contextlib.suppress(OSError):
            request.setblocking(False)  # never wait on a client that reads nothing
            request.send(head + body)
        super().shutdown_request(request)

    def reading(self, request: socket.socket) -> None:
        """The server now waits for a request on this connection."""
        with self._idle:
            if request in self._open:
                self._reading[request] = time.monotonic() + self.read_timeout

    def read_done(self, request: socket.socket) -> None:
        """The request has been read whole; its handling is not timed."""
        with self._idle:
            self._reading.pop(request, None)

    def service_actions(self) -> None:
        """Cut the connections whose request did not arrive in time (called
        by ``serve_forever`` at every poll)."""
        now = time.monotonic()
        with self._idle:
            late = [sock for sock, due in self._reading.items() if due < now]
            for sock in late:
                del self._reading[sock]
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def shutdown_request(self, request: Any) -> None:
        """Close the connection and forget it."""
        try:
            super().shutdown_request(request)
        finally:
            with self._idle:
                self._open.discard(request)
                self._reading.pop(request, None)
                self._idle.notify_all()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """Log a handler's failure; a client that hung up is no error."""
        exc = sys.exc_info()[1]
        if isinstance(exc, ConnectionError):
            logger.debug("client %s went away: %s", client_address, exc)
        else:
            logger.exception("error while serving %s", client_address)

    def close_connections(self, timeout: float) -> bool:
        """Shut down every open connection; wait for their threads to end.

        Args:
            timeout: Seconds to wait for the handlers to finish.

        Returns:
            Whether every connection was closed in time.
        """
        with self._idle:
            for sock in self._open:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
            return self._idle.wait_for(lambda: not self._open, timeout)


class JSONRequestHandler(BaseHTTPRequestHandler):
    """Request handler helpers: JSON bodies in and out, SSE out.

    HTTP/1.1 with keep-alive; an event stream is sent with chunked
    transfer encoding so that the connection stays reusable after it.
    """

    protocol_version = "HTTP/1.1"
    server_version = "lmcache-mp"
    #: Whether the current request's status line has been sent.
    responded = False

    def setup(self) -> None:
        """Time out each socket read and write after the server's
        ``read_timeout``."""
        super().setup()
        self.connection.settimeout(self._tracker().read_timeout)

    def handle_one_request(self) -> None:
        """Read and answer one request, timed until it has been read."""
        self._tracker().reading(self.connection)
        super().handle_one_request()

    def _tracker(self) -> TrackingHTTPServer:
        server = self.server
        assert isinstance(server, TrackingHTTPServer)
        return server

    def request_read(self) -> None:
        """Say that the request has been read whole (its handling, which
        may generate for long, is not timed)."""
        self._tracker().read_done(self.connection)

    def send_response(self, code: int, message: str | None = None) -> None:
        """Send the status line (and note that a response has begun)."""
        self.responded = True
        super().send_response(code, message)

    def log_message(self, format: str, *args: Any) -> None:
        """Log through :mod:`logging` (debug) instead of stderr."""
        logger.debug("%s - %s", self.address_string(), format % args)

    def send_json(
        self,
        status: int,
        doc: Any,
        headers: Iterable[tuple[str, str]] = (),
    ) -> None:
        """Send a complete JSON response.

        Args:
            status: The HTTP status.
            doc: The JSON document.
            headers: Extra headers.
        """
        body = json.dumps(doc, separators=(",", ":")).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for name, value in headers:
            self.send_header(name, value)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)
        self.wfile.flush()

    def send_api_error(self, err: APIError) -> None:
        """Send an :class:`APIError` as its status and JSON body."""
        self.send_json(err.status, err.body(), err.headers)

    def read_json(self, max_bytes: int) -> Any:
        """Read and parse the request's JSON body.

        Args:
            max_bytes: Largest body accepted.

        Returns:
            The parsed document.

        Raises:
            APIError: 411 without a Content-Length, 413 for a body over
                ``max_bytes`` (the connection is then closed, its
                body unread), 400 for a body cut short or that is not
                UTF-8 JSON (nested too deep for the parser included).
        """
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            self.close_connection = True
            raise APIError(
                411, "chunked request bodies are not supported", code="length_required"
            )
        raw_length = self.headers.get("Content-Length")
        try:
            length = int(raw_length) if raw_length is not None else -1
        except ValueError:
            length = -1
        if length < 0:
            self.close_connection = True
            raise APIError(
                411,
                f"a Content-Length header is required (got {raw_length!r})",
                code="length_required",
            )
        if length > max_bytes:
            self.close_connection = True
            raise APIError(
                413,
                f"the request body has {length} bytes, more than the "
                f"{max_bytes} accepted",
                code="request_too_large",
            )
        raw = self.rfile.read(length)
        if len(raw) < length:
            self.close_connection = True
            raise APIError(
                400,
                f"the request body ended after {len(raw)} of {length} bytes",
                code="invalid_json",
            )
        self.request_read()
        try:
            return json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise APIError(
                400, f"the request body is not valid JSON: {exc}", code="invalid_json"
            ) from exc

    def start_events(self) -> None:
        """Send the headers of a 200 ``text/event-stream`` response."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self.wfile.flush()

    def send_event(self, data: str) -> None:
        """Send one event as one HTTP chunk, flushed at once.

        Args:
            data: The event data (one line).
        """
        frame = encode_event(data)
        self.wfile.write(b"%x\r\n%s\r\n" % (len(frame), frame))
        self.wfile.flush()

    def end_events(self) -> None:
        """Send the last (empty) chunk of an event stream."""
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()
