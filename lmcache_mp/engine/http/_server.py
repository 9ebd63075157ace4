"""The HTTP plumbing of ``lmcache-mp serve``: threads, JSON, errors, SSE.

Standard library only: a :class:`ThreadingHTTPServer` (one daemon thread
per connection) that remembers its open connections so that shutdown can
close them, and a request handler base with OpenAI-style JSON errors and
chunked server-sent events.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import sys
import threading
from collections.abc import Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from lmcache_mp.engine.http._sse import encode_event

__all__ = ["APIError", "JSONRequestHandler", "TrackingHTTPServer"]

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


class TrackingHTTPServer(ThreadingHTTPServer):
    """A threading HTTP server that can close its open connections.

    Handler threads are daemons and are not joined on close; instead
    :meth:`close_connections` shuts every open socket down, which ends
    their reads and writes, and waits for them to finish.
    """

    daemon_threads = True
    block_on_close = False
    # socketserver's default backlog is 5: a batch opening one connection
    # per stream (32 at once in the tests) overflowed it and a connection
    # was reset once under load.
    request_queue_size = 128

    def __init__(
        self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler]
    ) -> None:
        self._open: set[socket.socket] = set()
        self._idle = threading.Condition()
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        """Remember the connection, then handle it on a new thread."""
        with self._idle:
            self._open.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        """Close the connection and forget it."""
        try:
            super().shutdown_request(request)
        finally:
            with self._idle:
                self._open.discard(request)
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
                body unread), 400 for a body that is not UTF-8 JSON.
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
        try:
            return json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
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
