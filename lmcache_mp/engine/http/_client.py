"""The HTTP side of the OpenAI client: one streaming POST per call.

A connection is opened per request and closed when its stream ends, so a
client object holds no socket and pickles to any worker process.
"""

from __future__ import annotations

import http.client
import json
import ssl
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from lmcache_mp.errors import EngineHTTPError, LMCacheStreamError

__all__ = [
    "Endpoint",
    "client_headers",
    "error_message",
    "open_stream",
    "read_lines",
    "request_json",
    "served_models",
]

#: Longest SSE line accepted (a first chunk may echo a long prompt's ids).
MAX_LINE_BYTES = 64 * 1024 * 1024
#: Most bytes of an error body read for its message.
_MAX_ERROR_BODY = 64 * 1024
#: Largest JSON response read (a prompt's top-20 log-probabilities of a
#: 4,096-token prompt are ~5 MB).
MAX_JSON_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class Endpoint:
    """Where a server listens, parsed from a base URL.

    Args:
        scheme: ``"http"`` or ``"https"``.
        host: Host name or address.
        port: TCP port.
        prefix: Path the API routes hang under (``""`` or e.g. ``"/proxy"``).
    """

    scheme: str
    host: str
    port: int
    prefix: str

    @classmethod
    def parse(cls, base_url: str) -> Endpoint:
        """Parse ``http[s]://host[:port][/prefix]``; a trailing ``/v1`` is dropped.

        OpenAI clients take base URLs ending in ``/v1``; routes here are
        given with their ``/v1``, so both spellings reach the same place.

        Args:
            base_url: The server's base URL.

        Returns:
            The endpoint.

        Raises:
            ValueError: If the URL is not an http(s) URL with a host, or has
                a query or fragment.
        """
        if not isinstance(base_url, str):
            raise ValueError(f"base_url must be a str, got {type(base_url).__name__}")
        parts = urlsplit(base_url)
        scheme = parts.scheme.lower()
        if scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(
                f"bad base_url {base_url!r}: expected http://HOST[:PORT] or "
                "https://HOST[:PORT]"
            )
        if parts.query or parts.fragment:
            raise ValueError(f"bad base_url {base_url!r}: no query or fragment")
        try:
            port = parts.port
        except ValueError as exc:
            raise ValueError(f"bad base_url {base_url!r}: {exc}") from exc
        prefix = parts.path.rstrip("/")
        if prefix.endswith("/v1"):
            prefix = prefix[: -len("/v1")]
        default = 443 if scheme == "https" else 80
        return cls(scheme, parts.hostname, port or default, prefix)

    def url(self, route: str) -> str:
        """Return the full URL of ``route`` (e.g. ``"/v1/completions"``)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}{self.prefix}{route}"


def error_message(body: bytes) -> str:
    """Return the server's message from an error body.

    Understands OpenAI's ``{"error": {"message": ...}}``, vLLM's older
    ``{"object": "error", "message": ...}`` and FastAPI's ``{"detail": ...}``;
    anything else is returned as (truncated) text.

    Args:
        body: The raw body.

    Returns:
        The message, never empty.
    """
    text = body.decode("utf-8", "replace").strip()
    try:
        doc = json.loads(text)
    except ValueError:
        doc = None
    if isinstance(doc, dict):
        err = doc.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return str(err["message"])
        if isinstance(err, str) and err:
            return err
        if isinstance(doc.get("message"), str):
            return str(doc["message"])
        if "detail" in doc:
            return str(doc["detail"])
    return text[:1000] or "(empty body)"


def _connect(
    endpoint: Endpoint, connect_timeout: float, read_timeout: float
) -> http.client.HTTPConnection:
    """Open a connection; the socket then waits ``read_timeout`` per read."""
    conn: http.client.HTTPConnection
    if endpoint.scheme == "https":
        conn = http.client.HTTPSConnection(
            endpoint.host,
            endpoint.port,
            timeout=connect_timeout,
            context=ssl.create_default_context(),
        )
    else:
        conn = http.client.HTTPConnection(
            endpoint.host, endpoint.port, timeout=connect_timeout
        )
    try:
        conn.connect()
    except TimeoutError as exc:
        conn.close()
        raise LMCacheStreamError(
            f"cannot connect to {endpoint.url('')}: no answer within "
            f"{connect_timeout:g}s (connect timeout)"
        ) from exc
    except OSError as exc:
        conn.close()
        raise LMCacheStreamError(
            f"cannot connect to {endpoint.url('')}: {type(exc).__name__}: {exc}"
        ) from exc
    assert conn.sock is not None
    conn.sock.settimeout(read_timeout)
    return conn


def _send(
    conn: http.client.HTTPConnection,
    endpoint: Endpoint,
    method: str,
    route: str,
    body: bytes | None,
    headers: Mapping[str, str],
) -> http.client.HTTPResponse:
    """Send a request; return its response, or raise for an HTTP error."""
    conn.request(method, endpoint.prefix + route, body=body, headers=dict(headers))
    resp = conn.getresponse()
    if resp.status >= 400:
        message = error_message(resp.read(_MAX_ERROR_BODY))
        raise EngineHTTPError(
            f"{method} {endpoint.url(route)} failed: HTTP {resp.status} "
            f"{resp.reason}: {message}",
            status=resp.status,
            server_message=message,
        )
    return resp


def open_stream(
    endpoint: Endpoint,
    route: str,
    body: bytes,
    headers: Mapping[str, str],
    *,
    connect_timeout: float,
    read_timeout: float,
) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """POST ``body`` and return the open connection and its event stream.

    Args:
        endpoint: The server.
        route: The path, e.g. ``"/v1/completions"``.
        body: The JSON request body.
        headers: Request headers.
        connect_timeout: Seconds to wait for the TCP (and TLS) connection.
        read_timeout: Seconds to wait for each read of the response.

    Returns:
        The connection (the caller closes it) and the response, whose
        status is 2xx and whose content type is ``text/event-stream``.

    Raises:
        LMCacheStreamError: If the server cannot be reached, times out,
            answers with an HTTP error (the message gives the status and the
            server's own message) or with something other than an event
            stream.
    """
    url = endpoint.url(route)
    conn = _connect(endpoint, connect_timeout, read_timeout)
    try:
        resp = _send(conn, endpoint, "POST", route, body, headers)
        ctype = resp.getheader("Content-Type", "")
        if not ctype.lower().startswith("text/event-stream"):
            raise LMCacheStreamError(
                f"POST {url}: HTTP {resp.status} answered with Content-Type "
                f"{ctype!r}, expected a text/event-stream"
            )
    except TimeoutError as exc:
        conn.close()
        raise LMCacheStreamError(
            f"POST {url}: no response within {read_timeout:g}s (read timeout)"
        ) from exc
    except (OSError, http.client.HTTPException) as exc:
        conn.close()
        raise LMCacheStreamError(
            f"POST {url} failed: {type(exc).__name__}: {exc}"
        ) from exc
    except BaseException:
        conn.close()
        raise
    return conn, resp


def read_lines(
    resp: http.client.HTTPResponse,
    url: str,
    read_timeout: float,
    progress: Callable[[], str],
) -> Iterator[bytes]:
    """Yield the response's lines as they arrive.

    Args:
        resp: The streaming response.
        url: The request URL, for messages.
        read_timeout: The read timeout, for messages.
        progress: Says how far the stream got, for messages.

    Returns:
        An iterator of raw lines, ending when the server closes the body.

    Raises:
        LMCacheStreamError: If a read times out, the connection breaks, or
            a line exceeds the size limit.
    """
    while True:
        try:
            line = resp.readline(MAX_LINE_BYTES)
        except TimeoutError as exc:
            raise LMCacheStreamError(
                f"POST {url}: no data for {read_timeout:g}s (read timeout) "
                f"after {progress()}"
            ) from exc
        except (OSError, http.client.HTTPException) as exc:
            raise LMCacheStreamError(
                f"POST {url}: the connection broke after {progress()}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        if not line:
            return
        if len(line) >= MAX_LINE_BYTES and not line.endswith(b"\n"):
            raise LMCacheStreamError(
                f"POST {url}: an event line exceeds {MAX_LINE_BYTES} bytes "
                f"after {progress()}"
            )
        yield line


def request_json(
    endpoint: Endpoint,
    method: str,
    route: str,
    body: bytes | None,
    headers: Mapping[str, str],
    *,
    connect_timeout: float,
    read_timeout: float,
) -> Any:
    """Send one request and return its parsed JSON response.

    Args:
        endpoint: The server.
        method: ``"GET"`` or ``"POST"``.
        route: The path, e.g. ``"/v1/completions"``.
        body: The JSON request body, or ``None``.
        headers: Request headers.
        connect_timeout: Seconds to wait for the connection.
        read_timeout: Seconds to wait for each read of the response.

    Returns:
        The parsed JSON document.

    Raises:
        EngineHTTPError: If the server answers with an HTTP error (the
            message gives the status and the server's own message).
        LMCacheStreamError: If the server cannot be reached, times out, or
            answers with something other than JSON.
    """
    url = endpoint.url(route)
    conn = _connect(endpoint, connect_timeout, read_timeout)
    try:
        raw = _send(conn, endpoint, method, route, body, headers).read(
            MAX_JSON_BYTES + 1
        )
    except TimeoutError as exc:
        raise LMCacheStreamError(
            f"{method} {url}: no response within {read_timeout:g}s (read timeout)"
        ) from exc
    except (OSError, http.client.HTTPException) as exc:
        raise LMCacheStreamError(
            f"{method} {url} failed: {type(exc).__name__}: {exc}"
        ) from exc
    finally:
        conn.close()
    if len(raw) > MAX_JSON_BYTES:
        raise LMCacheStreamError(
            f"{method} {url}: the response exceeds {MAX_JSON_BYTES} bytes"
        )
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise LMCacheStreamError(
            f"{method} {url}: the response is not JSON ({exc}): {raw[:200]!r}"
        ) from exc


def client_headers(api_key: str | None, accept: str) -> dict[str, str]:
    """The request headers of the client (``Authorization`` with a key)."""
    out = {
        "Content-Type": "application/json",
        "Accept": accept,
        "User-Agent": "lmcache-mp",
    }
    if api_key:
        out["Authorization"] = f"Bearer {api_key}"
    return out


def served_models(
    base_url: str, *, timeout: float = 10.0, api_key: str | None = None
) -> list[dict[str, Any]]:
    """Return the model cards of ``GET {base_url}/v1/models``.

    Args:
        base_url: The server's root URL.
        timeout: Seconds to wait for the connection and the answer.
        api_key: Sent as ``Authorization: Bearer <api_key>`` when given.

    Returns:
        The cards (``id``, ``max_model_len``; ``lmcache-mp serve`` adds
        ``vocab_size``, ``chunk_size`` and a shared store's ``kv_store``).

    Raises:
        ValueError: For a bad URL.
        EngineHTTPError: If the server answers with an HTTP error.
        LMCacheStreamError: If it cannot be reached, or answers no list.
    """
    endpoint = Endpoint.parse(base_url)
    doc = request_json(
        endpoint,
        "GET",
        "/v1/models",
        None,
        client_headers(api_key, "application/json"),
        connect_timeout=timeout,
        read_timeout=timeout,
    )
    cards = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(cards, list):
        raise LMCacheStreamError(
            f"GET {endpoint.url('/v1/models')}: 'data' is {str(cards)[:100]}, "
            "expected a list of models"
        )
    return [c for c in cards if isinstance(c, dict)]
