"""A ``post_completion`` for any OpenAI-compatible server (vLLM, ``lmcache-mp serve``).

:func:`post_completion` returns a small picklable callable that sends a
stream's prompt token ids to ``POST {base_url}/v1/completions`` with
``"stream": true`` and yields one :class:`~lmcache_mp.stream.TokenEvent`
per generated token, parsing the server-sent events as they arrive.

Token ids come from ``choices[0].token_ids`` (vLLM's ``return_token_ids``,
vLLM >= 0.10.2) or, for older vLLM, from ``logprobs.tokens`` written as
``"token_id:123"`` (``logprobs`` with ``return_tokens_as_token_ids``).
``usage.prompt_tokens_details.cached_tokens`` becomes the events'
``cached_tokens`` (vLLM reports it when started with
``--enable-prompt-tokens-details``).

Where ``cached_tokens`` lands: the figure is put on every event yielded
after the client knows it. A server that sends usage with every chunk
(``stream_options.continuous_usage_stats``, asked for by default) gives it
from the first token on. Otherwise it arrives in the final usage chunk,
after the last token; so the last token of a chunk that carries a
``finish_reason`` is held back until the next event (the usage chunk or
``[DONE]``, which follow at once) and carries the figure. No other token is
delayed.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import operator
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from lmcache_mp.engine.http._client import Endpoint, open_stream, read_lines
from lmcache_mp.engine.http._sse import DONE, iter_events
from lmcache_mp.errors import LMCacheStreamError, SamplingParamsError, StreamInputError
from lmcache_mp.hints import releases_gil
from lmcache_mp.stream import TokenEvent

__all__ = ["OpenAICompletions", "TokenIdSource", "post_completion"]

#: How the client asks the server for the generated token ids.
TokenIdSource = Literal["return_token_ids", "logprobs"]
_SOURCES: tuple[str, ...] = ("return_token_ids", "logprobs")
#: Request fields the client sets itself.
_RESERVED = ("model", "prompt", "stream")
_ROUTE = "/v1/completions"
_TOKEN_ID_PREFIX = "token_id:"
#: Most bytes, and seconds, spent reading after ``[DONE]`` before closing.
_DRAIN_LIMIT = 64 * 1024
_DRAIN_TIMEOUT = 1.0


def _is_int(value: Any) -> bool:
    """Whether ``value`` is a JSON integer (bool excluded)."""
    return isinstance(value, int) and not isinstance(value, bool)


@releases_gil
@dataclass(frozen=True)
class OpenAICompletions:
    """A ``post_completion`` callable backed by an OpenAI completions server.

    Made by :func:`post_completion`; see there for the arguments. It holds
    no connection (one is opened per call), so it pickles to worker
    processes as its settings.
    """

    base_url: str
    model: str
    timeout: float = 300.0
    connect_timeout: float = 10.0
    api_key: str | None = field(default=None, repr=False)
    extra_body: Mapping[str, Any] | None = field(default=None, hash=False)
    token_ids: TokenIdSource = "return_token_ids"
    continuous_usage: bool = True

    def __post_init__(self) -> None:
        Endpoint.parse(self.base_url)
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a non-empty str, got {self.model!r}")
        for name in ("timeout", "connect_timeout"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise ValueError(f"{name} must be a number of seconds, got {value!r}")
            if not value > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {value!r}")
        if self.token_ids not in _SOURCES:
            raise ValueError(
                f"token_ids is {self.token_ids!r}, expected one of {_SOURCES}"
            )
        if self.extra_body is not None:
            if not isinstance(self.extra_body, Mapping):
                kind = type(self.extra_body).__name__
                raise ValueError(f"extra_body must be a mapping, got {kind}")
            # A private plain copy: the caller's dict may change later, and
            # a read-only proxy would not pickle.
            object.__setattr__(self, "extra_body", dict(self.extra_body))

    @property
    def url(self) -> str:
        """The completions URL requests go to."""
        return Endpoint.parse(self.base_url).url(_ROUTE)

    def request_body(
        self,
        prompt_token_ids: Sequence[int],
        sampling_params: Mapping[str, Any],
        cache_salt: str = "",
    ) -> dict[str, Any]:
        """Return the JSON body a call sends.

        ``extra_body`` comes first, then the sampling params (passed through
        as they are: ``max_tokens``, ``temperature``, ``top_p``, ``seed``,
        ``ignore_eos``, ``stop_token_ids``, ...), then the fields the client
        owns: ``model``, ``prompt``, ``stream``, the token id request and
        ``stream_options.include_usage``.

        Args:
            prompt_token_ids: The prompt.
            sampling_params: Sampling params.
            cache_salt: Sent as ``cache_salt`` when non-empty.

        Returns:
            The body.

        Raises:
            SamplingParamsError: If the params set a field the client owns
                or ask for more than one choice (``n``).
            StreamInputError: If the prompt is not token ids.
        """
        if not isinstance(sampling_params, Mapping):
            raise SamplingParamsError(
                f"sampling params are {type(sampling_params).__name__}, "
                "expected a mapping"
            )
        for key in _RESERVED:
            if key in sampling_params:
                raise SamplingParamsError(
                    f"sampling param {key!r} is set by the client itself; remove it"
                )
        if sampling_params.get("n", 1) not in (1, None):
            raise SamplingParamsError(
                f"sampling param 'n' is {sampling_params['n']!r}; a stream takes "
                "one completion, expected 1"
            )
        prompt: list[int] = []
        for i, tok in enumerate(prompt_token_ids):
            try:
                # Accepts numpy ints, rejects floats and strings.
                value: int | None = operator.index(tok)
            except TypeError:
                value = None
            if value is None or isinstance(tok, bool) or value < 0:
                raise StreamInputError(
                    f"prompt token {i} is {tok!r}, expected an int token id >= 0"
                )
            prompt.append(value)
        body: dict[str, Any] = dict(self.extra_body or {})
        body.update(sampling_params)
        body.update(model=self.model, prompt=prompt, stream=True)
        options = dict(body.get("stream_options") or {})
        options["include_usage"] = True
        if self.continuous_usage:
            options.setdefault("continuous_usage_stats", True)
        body["stream_options"] = options
        if self.token_ids == "return_token_ids":
            body["return_token_ids"] = True
        else:
            if body.get("logprobs") is None:
                body["logprobs"] = 0
            body["return_tokens_as_token_ids"] = True
        if cache_salt:
            body["cache_salt"] = cache_salt
        return body

    def __call__(
        self,
        prompt_token_ids: Sequence[int],
        sampling_params: Mapping[str, Any],
        cache_salt: str = "",
    ) -> Iterator[TokenEvent]:
        """Stream a completion of the prompt, one event per generated token.

        The request is built now (bad params raise here); it is sent on the
        first ``next()``, and each token is yielded as its event arrives.

        Args:
            prompt_token_ids: The prompt, as token ids.
            sampling_params: Sampling params, passed through.
            cache_salt: Per-user isolation salt, sent when non-empty.

        Returns:
            An iterator of :class:`TokenEvent`.

        Raises:
            SamplingParamsError: If the params cannot be sent (see
                :meth:`request_body`, or a value is not JSON).
            StreamInputError: If the prompt is not token ids.
            LMCacheStreamError: On iteration: the server cannot be reached
                or times out, answers with an HTTP error (the message has
                the status and the server's message), sends a malformed or
                error event, sends text without token ids, or closes the
                stream before ``data: [DONE]``.
        """
        body = self.request_body(prompt_token_ids, sampling_params, cache_salt)
        try:
            payload = json.dumps(body, allow_nan=False).encode()
        except (TypeError, ValueError) as exc:
            raise SamplingParamsError(
                f"sampling params cannot be sent as JSON: {exc}"
            ) from exc
        return self._stream(payload)

    def _headers(self) -> dict[str, str]:
        headers = {
            "Content-Type": "application/json",
            "Accept": "text/event-stream",
            "User-Agent": "lmcache-mp",
        }
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    def _stream(self, payload: bytes) -> Iterator[TokenEvent]:
        """Send the request and translate its events into token events."""
        url = self.url
        conn, resp = open_stream(
            Endpoint.parse(self.base_url),
            _ROUTE,
            payload,
            self._headers(),
            connect_timeout=self.connect_timeout,
            read_timeout=self.timeout,
        )
        decoder = _ChunkDecoder(self.token_ids, url)
        try:
            lines = read_lines(resp, url, self.timeout, decoder.progress)
            for data in iter_events(lines):
                if data.strip() == DONE:
                    last = decoder.finish()
                    _drain(conn, resp, min(self.timeout, _DRAIN_TIMEOUT))
                    yield from last
                    return
                yield from decoder.feed(data)
            raise LMCacheStreamError(
                f"POST {url}: the server closed the stream before data: [DONE] "
                f"after {decoder.progress()}"
            )
        except UnicodeDecodeError as exc:
            raise LMCacheStreamError(
                f"POST {url}: an event is not UTF-8 after {decoder.progress()}: {exc}"
            ) from exc
        finally:
            conn.close()


def _drain(
    conn: http.client.HTTPConnection, resp: http.client.HTTPResponse, timeout: float
) -> None:
    """Read the end of the body that follows ``[DONE]``, briefly.

    Closing a socket with unread bytes makes the kernel reset the
    connection, which the server then sees as an error. A body delimited
    by the connection's close has no end marker to read, so it is left.
    """
    if not resp.chunked and resp.length is None:
        return
    with contextlib.suppress(OSError, http.client.HTTPException):
        if conn.sock is not None:
            conn.sock.settimeout(timeout)
        resp.read(_DRAIN_LIMIT)


class _ChunkDecoder:
    """Turns completion chunks into token events, in order."""

    def __init__(self, source: str, url: str) -> None:
        self._source = source
        self._url = url
        self._held: TokenEvent | None = None
        self._pending_text = ""
        self._cached: int | None = None
        self._count = 0
        self._reported_tokens: int | None = None

    def progress(self) -> str:
        """How far the stream got, for error messages."""
        return f"{self._count} tokens"

    def _error(self, problem: str) -> LMCacheStreamError:
        return LMCacheStreamError(
            f"POST {self._url}: {problem} (after {self._count} tokens)"
        )

    def feed(self, data: str) -> list[TokenEvent]:
        """Decode one event's data; return the events it releases."""
        try:
            chunk = json.loads(data)
        except ValueError as exc:
            raise self._error(f"an event is not JSON ({exc}): {data[:200]!r}") from exc
        if not isinstance(chunk, dict):
            raise self._error(f"an event is not a JSON object: {data[:200]!r}")
        if chunk.get("error"):
            message = chunk["error"]
            if isinstance(message, dict):
                message = message.get("message", message)
            raise self._error(f"the server reported an error mid-stream: {message}")
        self._read_usage(chunk.get("usage"))
        out: list[TokenEvent] = []
        if self._held is not None:
            out.append(self._release())
        choices = chunk.get("choices", [])
        if not isinstance(choices, list):
            raise self._error(f"'choices' is {choices!r}, expected a list")
        for choice in choices:
            if not isinstance(choice, dict):
                raise self._error(f"a choice is {choice!r}, expected an object")
            if choice.get("index", 0) == 0:
                out.extend(self._read_choice(choice))
        return out

    def finish(self) -> list[TokenEvent]:
        """End of stream: release the held token and check the count."""
        out = [self._release()] if self._held is not None else []
        if self._count == 0 and self._reported_tokens:
            raise self._error(
                f"usage reports {self._reported_tokens} completion tokens but "
                "no token id was sent"
            )
        return out

    def _release(self) -> TokenEvent:
        held, self._held = self._held, None
        assert held is not None
        text, self._pending_text = held.text + self._pending_text, ""
        return TokenEvent(held.token_id, text, self._cached)

    def _read_usage(self, usage: Any) -> None:
        if usage is None:
            return
        if not isinstance(usage, dict):
            raise self._error(f"'usage' is {usage!r}, expected an object")
        completion = usage.get("completion_tokens")
        if _is_int(completion):
            self._reported_tokens = completion
        details = usage.get("prompt_tokens_details")
        if details is None:
            return
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        if cached is None:
            return
        if not _is_int(cached) or cached < 0:
            raise self._error(
                f"usage.prompt_tokens_details.cached_tokens is {cached!r}, "
                "expected an int >= 0"
            )
        self._cached = cached

    def _read_choice(self, choice: dict[str, Any]) -> list[TokenEvent]:
        text = choice.get("text") or ""
        if not isinstance(text, str):
            raise self._error(f"choices[0].text is {text!r}, expected a string")
        ids = self._read_ids(choice, text)
        if not ids:
            self._pending_text += text
            return []
        out = [
            TokenEvent(tok, self._pending_text + text if i == 0 else "", self._cached)
            for i, tok in enumerate(ids)
        ]
        self._pending_text = ""
        self._count += len(ids)
        if choice.get("finish_reason") is not None:
            # The usage chunk comes right after: keep the last token for it.
            self._held = out.pop()
        return out

    def _read_ids(self, choice: dict[str, Any], text: str) -> list[int]:
        if self._source == "return_token_ids":
            raw = choice.get("token_ids")
            where = "choices[0].token_ids"
        else:
            logprobs = choice.get("logprobs")
            raw = logprobs.get("tokens") if isinstance(logprobs, dict) else None
            where = "choices[0].logprobs.tokens"
        if raw is None:
            if text:
                raise self._error(self._missing_ids_message(where))
            return []
        if not isinstance(raw, list):
            raise self._error(f"{where} is {raw!r}, expected a list")
        return [self._token_id(item, where) for item in raw]

    def _token_id(self, item: Any, where: str) -> int:
        if self._source == "logprobs":
            if not isinstance(item, str) or not item.startswith(_TOKEN_ID_PREFIX):
                raise self._error(
                    f"{where} holds {item!r}, expected 'token_id:<int>' "
                    "(return_tokens_as_token_ids)"
                )
            digits = item[len(_TOKEN_ID_PREFIX) :]
            item = int(digits) if digits.isdigit() else None
        if not _is_int(item) or item < 0:
            raise self._error(f"{where} holds {item!r}, expected token ids >= 0")
        return int(item)

    def _missing_ids_message(self, where: str) -> str:
        if self._source == "return_token_ids":
            hint = (
                "the server may not support return_token_ids (vLLM >= 0.10.2 "
                "does); for older vLLM use token_ids='logprobs'"
            )
        else:
            hint = "the server may not support return_tokens_as_token_ids"
        return f"the server sent text without token ids ({where} missing); {hint}"


def post_completion(
    base_url: str,
    model: str,
    *,
    timeout: float = 300.0,
    connect_timeout: float = 10.0,
    api_key: str | None = None,
    extra_body: Mapping[str, Any] | None = None,
    token_ids: TokenIdSource = "return_token_ids",
    continuous_usage: bool = True,
) -> OpenAICompletions:
    """Return a ``post_completion`` callable for an OpenAI-compatible server.

    Example::

        engine = post_completion("http://127.0.0.1:8000", "Qwen/Qwen3-8B")
        stream = create_request(ctx, engine, prompt_ids)

    Args:
        base_url: The server's root URL, e.g. ``"http://127.0.0.1:8000"``
            (``.../v1``, as OpenAI clients take it, is accepted too).
        model: The served model's name, sent as ``model``.
        timeout: Read timeout: seconds to wait for the response to start
            and then for each next piece of it.
        connect_timeout: Seconds to wait for the connection.
        api_key: Sent as ``Authorization: Bearer <api_key>`` when given.
        extra_body: Extra request fields (e.g. ``{"top_k": 20}``), sent
            with every request; sampling params override them.
        token_ids: ``"return_token_ids"`` (vLLM >= 0.10.2 and
            ``lmcache-mp serve``) or ``"logprobs"`` (older vLLM: ids read
            from ``logprobs`` with ``return_tokens_as_token_ids``).
        continuous_usage: Ask for usage in every chunk
            (``stream_options.continuous_usage_stats``), so that
            ``cached_tokens`` is known from the first token on.

    Returns:
        A picklable callable ``(prompt_token_ids, sampling_params,
        cache_salt) -> Iterator[TokenEvent]``.

    Raises:
        ValueError: If an argument is invalid (bad URL, non-positive
            timeout, unknown ``token_ids``).
    """
    return OpenAICompletions(
        base_url=base_url,
        model=model,
        timeout=timeout,
        connect_timeout=connect_timeout,
        api_key=api_key,
        extra_body=extra_body,
        token_ids=token_ids,
        continuous_usage=continuous_usage,
    )
