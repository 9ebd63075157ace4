"""The request handler of ``lmcache-mp serve``: routing and completions.

The handler serves whatever :class:`App` its server points at (the public
``EngineServer``): ``GET /health``, ``GET /v1/models`` and
``POST /v1/completions``, answering errors as OpenAI-style JSON.
"""

from __future__ import annotations

import contextlib
import json
import socket
from collections.abc import Iterator
from typing import Any, Protocol

import numpy as np

from lmcache_mp.engine._sampling import Sampler
from lmcache_mp.engine.http._completions import (
    CompletionRequest,
    ResponseBuilder,
    parse_request,
    usage,
)
from lmcache_mp.engine.http._logprobs import echo_logprobs, prompt_logprobs
from lmcache_mp.engine.http._served import ServedEngine, ServedVocab, score_prompt
from lmcache_mp.engine.http._server import (
    Admission,
    APIError,
    JSONRequestHandler,
    TrackingHTTPServer,
    logger,
)
from lmcache_mp.errors import LMCacheError, SamplingParamsError, StreamInputError
from lmcache_mp.stream import TokenEvent

__all__ = ["App", "HTTPServer"]


class App(Protocol):
    """What the handler needs from the server it runs in."""

    engine: ServedEngine
    vocab: ServedVocab
    model_name: str
    max_body_bytes: int
    max_logprobs: int
    admission: Admission

    def models(self) -> dict[str, Any]:
        """Return the ``GET /v1/models`` document."""
        ...


_ROUTES = {
    "/health": ("GET",),
    "/v1/models": ("GET",),
    "/v1/completions": ("POST",),
}


class _Handler(JSONRequestHandler):
    """Routes requests to the app held by the server."""

    @property
    def app(self) -> App:
        server = self.server
        assert isinstance(server, HTTPServer)
        return server.app

    def _dispatch(self, method: str) -> None:
        path = self.path.split("?", 1)[0]
        self.responded = False
        if method == "GET":
            self.request_read()
        try:
            allowed = _ROUTES.get(path)
            if allowed is None:
                raise APIError(
                    404, f"no route {method} {path}", code="unknown_url", param=None
                )
            if method not in allowed:
                raise APIError(
                    405,
                    f"{path} takes {', '.join(allowed)}, not {method}",
                    code="method_not_allowed",
                    headers=[("Allow", ", ".join(allowed))],
                )
            if path == "/health":
                self.send_json(200, {"status": "ok"})
            elif path == "/v1/models":
                self.send_json(200, self.app.models())
            else:
                self._completions()
        except (ConnectionError, TimeoutError):
            # The client hung up, or was too slow to send or to read.
            self.close_connection = True
        except Exception as exc:
            if self.responded:
                # Mid-response: all that is left is to hang up.
                logger.exception("%s %s failed mid-response", method, path)
                self.close_connection = True
            elif isinstance(exc, APIError):
                self.send_api_error(exc)
            else:
                logger.exception("%s %s failed", method, path)
                self._internal_error(exc)

    def _internal_error(self, exc: Exception) -> None:
        self.send_api_error(
            APIError(
                500,
                f"internal error: {type(exc).__name__}: {exc}",
                code="internal_error",
            )
        )

    def do_GET(self) -> None:
        """Handle GET."""
        self._dispatch("GET")

    def do_POST(self) -> None:
        """Handle POST."""
        self._dispatch("POST")

    def do_PUT(self) -> None:
        """Handle PUT (no route takes it)."""
        self._dispatch("PUT")

    def do_DELETE(self) -> None:
        """Handle DELETE (no route takes it)."""
        self._dispatch("DELETE")

    def do_PATCH(self) -> None:
        """Handle PATCH (no route takes it)."""
        self._dispatch("PATCH")

    def _completions(self) -> None:
        app = self.app
        try:
            ticket = app.admission.enter()
        except APIError:
            self.close_connection = True  # its body is left unread
            raise
        try:
            doc = self.read_json(app.max_body_bytes)
            request = parse_request(
                doc, app.model_name, app.vocab.tokenize, app.max_logprobs
            )
            with ticket.run():
                self._complete(request)
        finally:
            ticket.release()

    def _complete(self, request: CompletionRequest) -> None:
        """Answer a parsed completion request (in a generation slot)."""
        app = self.app
        if request.echo or request.prompt_logprobs is not None:
            self._scored(request)
            return
        with _engine_errors("prefill"):
            events = app.engine(request.prompt, request.sampling, request.cache_salt)
            # Prefill now: its errors still get a proper status code.
            first = next(events, None)
        with contextlib.closing(_Generation(events, first)) as gen:
            if request.stream:
                self._stream(request, gen)
            else:
                self._respond(request, gen)

    def _scored(self, request: CompletionRequest) -> None:
        """Answer with the prompt's log-probabilities (or its echo), scored as
        the engine's ``score`` scores: over the cached prefix, nothing
        stored; the one token asked for at most is sampled from the
        distribution after the prompt."""
        vocab, prompt = self.app.vocab, request.prompt
        with _engine_errors("scoring"):
            first, reused, rows = score_prompt(
                self.app.engine,
                prompt,
                request.cache_salt,
                request.generates > 0,
                request.score_from,
            )
        ids = []
        if request.generates:
            token = Sampler(request.params).sample(rows[-1].astype(np.float64))
            rows = rows[:-1]
            if not request.params.stops_at(token, vocab.eos):
                ids.append(token)
        text = "".join(vocab.piece(t) for t in ids)
        fields: dict[str, Any] = {}
        if request.prompt_logprobs is not None:
            fields["prompt_logprobs"] = prompt_logprobs(
                rows, prompt, first, request.prompt_logprobs, vocab.piece
            )
        if request.echo:
            text = vocab.detokenize(prompt) + text
            if request.logprobs is not None:
                fields["logprobs"] = echo_logprobs(
                    rows,
                    prompt,
                    first,
                    request.logprobs,
                    vocab.piece,
                    request.tokens_as_ids,
                )
        builder = ResponseBuilder(request, self.app.model_name)
        reason = _finish_reason(len(ids), request) or "stop"
        final = usage(len(prompt), len(ids), reused)
        self.send_json(200, builder.response(text, ids, reason, final, fields))

    def _respond(self, request: CompletionRequest, gen: _Generation) -> None:
        ids: list[int] = []
        texts: list[str] = []
        try:
            for event in gen:
                ids.append(event.token_id)
                texts.append(event.text)
        except LMCacheError as exc:
            logger.exception("generation failed")
            raise APIError(
                500, f"the engine failed: {exc}", code="engine_error"
            ) from exc
        builder = ResponseBuilder(request, self.app.model_name)
        reason = _finish_reason(len(ids), request) or "stop"
        final = usage(len(request.prompt), len(ids), gen.cached)
        self.send_json(200, builder.response("".join(texts), ids, reason, final))

    def _stream(self, request: CompletionRequest, gen: _Generation) -> None:
        builder = ResponseBuilder(request, self.app.model_name)
        self.start_events()
        count = 0
        finished = False
        try:
            for event in gen:
                count += 1
                reason = _finish_reason(count, request)
                finished = reason is not None
                so_far = None
                if request.continuous_usage:
                    so_far = usage(len(request.prompt), count, gen.cached)
                chunk = builder.chunk(event.text, [event.token_id], reason, so_far)
                self.send_event(_json(chunk))
        except LMCacheError as exc:
            logger.exception("generation failed mid-stream")
            self.send_event(_json(APIError(500, str(exc), code="engine_error").body()))
            finished = True
        if not finished:
            so_far = None
            if request.continuous_usage:
                so_far = usage(len(request.prompt), count, gen.cached)
            self.send_event(_json(builder.chunk("", [], "stop", so_far)))
        if request.include_usage:
            final = usage(len(request.prompt), count, gen.cached)
            self.send_event(_json(builder.usage_chunk(final)))
        self.send_event("[DONE]")
        self.end_events()


@contextlib.contextmanager
def _engine_errors(phase: str) -> Iterator[None]:
    """Turn the engine's errors into API errors: bad input 400, else 500."""
    try:
        yield
    except (SamplingParamsError, StreamInputError) as exc:
        param = "prompt" if isinstance(exc, StreamInputError) else None
        raise APIError(400, str(exc), code="invalid_value", param=param) from exc
    except LMCacheError as exc:
        logger.exception("%s failed", phase)
        raise APIError(500, f"the engine failed: {exc}", code="engine_error") from exc


def _finish_reason(count: int, request: CompletionRequest) -> str | None:
    """``"length"`` once ``max_tokens`` tokens are out, else not yet known."""
    return "length" if count >= request.params.max_tokens else None


def _json(doc: Any) -> str:
    return json.dumps(doc, separators=(",", ":"))


class _Generation:
    """The engine's token events, the first one already computed."""

    def __init__(self, events: Iterator[TokenEvent], first: TokenEvent | None) -> None:
        self._events = events
        self._first = first
        self.cached = None if first is None else first.cached_tokens

    def __iter__(self) -> Iterator[TokenEvent]:
        if self._first is None:
            return
        yield self._first
        yield from self._events

    def close(self) -> None:
        """Stop the engine's generator (a client went away)."""
        close = getattr(self._events, "close", None)
        if close is not None:
            close()


class HTTPServer(TrackingHTTPServer):
    """The HTTP server, pointing at the app it serves."""

    def __init__(
        self,
        address: tuple[str, int],
        app: App,
        *,
        max_connections: int,
        read_timeout: float,
    ) -> None:
        self.app = app
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(
            address,
            _Handler,
            max_connections=max_connections,
            read_timeout=read_timeout,
        )
