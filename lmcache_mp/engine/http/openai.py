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
from typing import Any, Literal, get_args

import numpy as np
import numpy.typing as npt

from lmcache_mp.engine.http._chunks import ChunkDecoder, is_int
from lmcache_mp.engine.http._client import (
    Endpoint,
    client_headers,
    open_stream,
    read_lines,
    request_json,
    served_models,
)
from lmcache_mp.engine.http._logprobs import (
    SCORE_SOURCES,
    ScoreSource,
    dense_row,
    read_rows,
    score_fields,
)
from lmcache_mp.engine.http._sse import DONE, iter_events
from lmcache_mp.errors import LMCacheStreamError, SamplingParamsError, StreamInputError
from lmcache_mp.hints import releases_gil
from lmcache_mp.stream import TokenEvent

__all__ = [
    "OpenAICompletions",
    "ScoreSource",
    "TokenIdSource",
    "post_completion",
    "served_models",
]

#: How the client asks the server for the generated token ids.
TokenIdSource = Literal["return_token_ids", "logprobs"]
_SOURCES: tuple[str, ...] = get_args(TokenIdSource)
#: Request fields the client sets itself.
_RESERVED = ("model", "prompt", "stream")
_ROUTE = "/v1/completions"
#: Most bytes, and seconds, spent reading after ``[DONE]`` before closing.
_DRAIN_LIMIT = 64 * 1024
_DRAIN_TIMEOUT = 1.0


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
    vocab_size: int | None = None
    scoring: ScoreSource = "prompt_logprobs"
    top_logprobs: int = 20
    #: The served model's vocabulary size, once asked (``vocab_size=None``).
    _served_vocab: int | None = field(
        default=None, init=False, repr=False, compare=False
    )

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
        if self.scoring not in SCORE_SOURCES:
            raise ValueError(
                f"scoring is {self.scoring!r}, expected one of {SCORE_SOURCES}"
            )
        for name in ("vocab_size", "top_logprobs"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < 1):
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
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
        prompt = _token_ids(prompt_token_ids, "prompt")
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

    def score(
        self,
        prompt: Sequence[int],
        continuation: Sequence[int],
        cache_salt: str = "",
    ) -> npt.NDArray[np.float32]:
        """Teacher-force ``continuation`` after ``prompt`` on the server: the
        log-probabilities at each of its tokens, in one request.

        The contract of :meth:`HFEngine.score
        <lmcache_mp.engine.HFEngine.score>`, so that ``lmcache-mp eval``
        scores through a server. One non-streaming
        ``POST /v1/completions`` of ``prompt + continuation`` asks for the
        prompt's log-probabilities as ``scoring`` says: vLLM's
        ``prompt_logprobs`` (with ``max_tokens: 1``) or the legacy ``echo``
        with ``logprobs`` and ``return_tokens_as_token_ids`` (with
        ``max_tokens: 0``); ``top_logprobs`` tokens per position, and
        ``cache_salt`` as vLLM's ``cache_salt`` field.

        A server lists only its top tokens per position (vLLM at most its
        ``--max-logprobs``, 20 by default). Each row keeps the listed
        tokens' log-probabilities and spreads the mass they leave evenly
        over the other tokens: the argmax, hence top-1 agreement, is the
        server's exactly; a KL divergence between such rows is an
        approximation, neither a bound above nor below in general. It
        overstates where one row's likely tokens fall outside the other's
        listed ones (they get the even share, below their true
        probability), and understates within the unlisted tails, whose
        differences the flattening hides. At 20 listed tokens it comes out
        above the exact KL, more so on the toy model's flatter rows (see
        docs/eval.md, ``lmcache-mp eval --server``).

        Which KV the scores see is the server's business. The request says
        where the context ends (``prompt_logprobs_from``, an lmcache-mp
        extension that vLLM ignores): ``lmcache-mp serve`` then scores as
        its engine's ``score(prompt, continuation)``, over the context's
        cached prefix (edited or not). vLLM skips its prefix cache for a
        request with prompt log-probabilities (``skip_reading_prefix_cache``,
        PRs #17251 and #28194) and recomputes the prompt: there the scores
        are those of the unedited prompt.

        Args:
            prompt: The context, as a stream would send it next.
            continuation: The tokens to score (at least one).
            cache_salt: Sent as ``cache_salt`` when non-empty.

        Returns:
            ``[len(continuation), vocab_size]`` float32 log-probabilities;
            row ``i`` is the distribution ``continuation[i]`` was drawn
            from.

        Raises:
            StreamInputError: If ``prompt`` or ``continuation`` is empty or
                holds something other than token ids.
            EngineHTTPError: If the server answers with an HTTP error.
            LMCacheStreamError: If the server cannot be reached or times
                out, its answer lacks the log-probabilities of a
                continuation position, lists a token outside the
                vocabulary, or the vocabulary size is unknown (not given,
                and not in the server's ``GET /v1/models``).
        """
        whole = _token_ids([*prompt, *continuation], "score")
        if not prompt or not continuation:
            raise StreamInputError(
                "score needs a non-empty prompt and continuation, got "
                f"{len(prompt)} and {len(continuation)} tokens"
            )
        vocab = self._vocab()
        body: dict[str, Any] = dict(self.extra_body or {})
        body.update(model=self.model, prompt=whole, stream=False, temperature=0)
        body.pop("stream_options", None)  # only allowed with stream
        body.update(score_fields(self.scoring, self.top_logprobs, len(prompt)))
        if cache_salt:
            body["cache_salt"] = cache_salt
        doc = self._request("POST", _ROUTE, json.dumps(body).encode())
        rows = read_rows(doc, self.scoring, len(prompt), len(continuation), self.url)
        return np.stack([dense_row(row, vocab, self.url) for row in rows])

    def _vocab(self) -> int:
        """The vocabulary size: given, or the served model's (asked once)."""
        if self.vocab_size is not None:
            return self.vocab_size
        if self._served_vocab is None:
            cards = served_models(
                self.base_url, timeout=self.connect_timeout, api_key=self.api_key
            )
            card = next((c for c in cards if c.get("id") == self.model), {})
            size: Any = card.get("vocab_size")
            if not is_int(size) or size < 1:
                raise LMCacheStreamError(
                    f"{self.base_url}: the server does not report the vocabulary "
                    f"size of {self.model!r} (vLLM does not); pass vocab_size="
                )
            object.__setattr__(self, "_served_vocab", size)
        assert self._served_vocab is not None
        return self._served_vocab

    def _request(self, method: str, route: str, payload: bytes | None) -> Any:
        return request_json(
            Endpoint.parse(self.base_url),
            method,
            route,
            payload,
            client_headers(self.api_key, "application/json"),
            connect_timeout=self.connect_timeout,
            read_timeout=self.timeout,
        )

    def _headers(self) -> dict[str, str]:
        return client_headers(self.api_key, "text/event-stream")

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
        decoder = ChunkDecoder(self.token_ids, url)
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


def _token_ids(tokens: Sequence[int], what: str) -> list[int]:
    """The ids as Python ints, or a :class:`StreamInputError` naming one."""
    ids: list[int] = []
    for i, tok in enumerate(tokens):
        try:
            # Accepts numpy ints, rejects floats and strings.
            value: int | None = operator.index(tok)
        except TypeError:
            value = None
        if value is None or isinstance(tok, bool) or value < 0:
            raise StreamInputError(
                f"{what} token {i} is {tok!r}, expected an int token id >= 0"
            )
        ids.append(value)
    return ids


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
    vocab_size: int | None = None,
    scoring: ScoreSource = "prompt_logprobs",
    top_logprobs: int = 20,
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
        vocab_size: The served model's vocabulary size, the width of
            :meth:`~OpenAICompletions.score`'s rows; ``None`` asks the
            server's ``GET /v1/models`` (``lmcache-mp serve`` reports it,
            vLLM does not).
        scoring: How :meth:`~OpenAICompletions.score` asks for the prompt's
            log-probabilities: ``"prompt_logprobs"`` (vLLM >= 0.5.5 and
            ``lmcache-mp serve``) or ``"echo"`` (``echo`` + ``logprobs``
            with ``return_tokens_as_token_ids``: vLLM >= 0.5 and
            ``lmcache-mp serve``).
        top_logprobs: Tokens listed per position when scoring (vLLM's
            ``--max-logprobs`` caps it, 20 by default).

    Returns:
        A picklable callable ``(prompt_token_ids, sampling_params,
        cache_salt) -> Iterator[TokenEvent]``.

    Raises:
        ValueError: If an argument is invalid (bad URL, non-positive
            timeout, unknown ``token_ids`` or ``scoring``, a vocabulary
            size or ``top_logprobs`` below 1).
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
        vocab_size=vocab_size,
        scoring=scoring,
        top_logprobs=top_logprobs,
    )
