"""``POST /v1/completions`` for the embedded engine: request and responses.

Parses an OpenAI completions request into what the engine takes, and
builds the OpenAI-shaped JSON of a response, a stream chunk and usage
(vLLM's extensions included: ``return_token_ids``, ``cache_salt``,
``ignore_eos``, ``stop_token_ids``, ``stream_options.continuous_usage_stats``).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lmcache_mp.engine._sampling import SamplingParams
from lmcache_mp.engine.http._server import APIError
from lmcache_mp.errors import SamplingParamsError

__all__ = ["CompletionRequest", "ResponseBuilder", "parse_request"]

#: Request fields the engine samples with, passed to it as they are.
SAMPLING_KEYS = (
    "max_tokens",
    "temperature",
    "top_p",
    "seed",
    "ignore_eos",
    "stop_token_ids",
)
#: OpenAI fields the engine cannot honour, with the values that mean "off".
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "n": (None, 1),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "stop": (None, "", []),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
}


def _bad(message: str, param: str, code: str = "invalid_value") -> APIError:
    return APIError(400, message, code=code, param=param)


@dataclass(frozen=True)
class CompletionRequest:
    """A validated completions request.

    Args:
        prompt: The prompt's token ids (text prompts are tokenized).
        sampling: The sampling params for the engine.
        params: The same, validated.
        stream: Answer with server-sent events.
        include_usage: Send a usage chunk before ``[DONE]``.
        continuous_usage: Put usage in every chunk too.
        return_token_ids: Add ``token_ids`` (and ``prompt_token_ids``).
        cache_salt: The isolation salt.
        prompt_logprobs: vLLM's ``prompt_logprobs``: top tokens listed per
            prompt position, or ``None``.
        echo: Put the prompt before the completion's text.
        logprobs: With ``echo``, top tokens listed per echoed prompt token.
        tokens_as_ids: Name tokens ``"token_id:<id>"`` in ``logprobs``.
        echo_only: ``echo`` with ``max_tokens`` 0: generate nothing.
        score_from: lmcache-mp's ``prompt_logprobs_from``: the first
            position to score, the context before it (vLLM ignores it).
    """

    prompt: list[int]
    sampling: dict[str, Any]
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    return_token_ids: bool = False
    cache_salt: str = ""
    prompt_logprobs: int | None = None
    echo: bool = False
    logprobs: int | None = None
    tokens_as_ids: bool = False
    echo_only: bool = False
    score_from: int | None = None

    @property
    def scores(self) -> bool:
        """Whether the prompt's log-probabilities are asked for."""
        return self.prompt_logprobs is not None or self.logprobs is not None

    @property
    def generates(self) -> int:
        """Tokens to generate: ``max_tokens``, 0 for an echo alone."""
        return 0 if self.echo_only else self.params.max_tokens


def _flag(doc: dict[str, Any], key: str, where: str | None = None) -> bool:
    value = doc.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _bad(f"{where or key} is {value!r}, expected true or false", key)
    return value


def _prompt(value: Any, tokenize: Callable[[str], list[int]]) -> list[int]:
    """Return the prompt's token ids; one prompt per request."""
    # OpenAI's batch forms hold one prompt here: ["text"] or [[1, 2, 3]].
    if (
        isinstance(value, list)
        and len(value) == 1
        and isinstance(value[0], (str, list))
    ):
        value = value[0]
    if isinstance(value, str):
        return tokenize(value)
    if isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    ):
        return list(value)
    if isinstance(value, list) and value and isinstance(value[0], (str, list)):
        raise _bad(
            f"prompt holds {len(value)} prompts; this server takes one per request",
            "prompt",
        )
    raise _bad(
        f"prompt is {str(value)[:100]}, expected a string or a list of token ids",
        "prompt",
    )


def _sampling(doc: dict[str, Any]) -> tuple[dict[str, Any], SamplingParams]:
    """Validate each sampling field on its own, so errors name the field."""
    sampling = {k: doc[k] for k in SAMPLING_KEYS if doc.get(k) is not None}
    for key, value in sampling.items():
        try:
            SamplingParams.from_mapping({key: value})
        except SamplingParamsError as exc:
            raise _bad(str(exc), key) from exc
    return sampling, SamplingParams.from_mapping(sampling)


def _count(doc: dict[str, Any], key: str, most: int) -> int | None:
    """A count of listed tokens in ``[0, most]``, or ``None``."""
    value = doc.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _bad(f"{key} is {value!r}, expected an int >= 0", key)
    if value > most:
        raise _bad(
            f"{key} is {value}, more than this server's --max-logprobs {most}", key
        )
    return value


def _scoring(doc: dict[str, Any], max_logprobs: int) -> dict[str, Any]:
    """The prompt log-probability fields, checked as vLLM checks them; what
    the engine cannot do is refused naming the field."""
    fields = {
        "prompt_logprobs": _count(doc, "prompt_logprobs", max_logprobs),
        "echo": _flag(doc, "echo"),
        "logprobs": _count(doc, "logprobs", max_logprobs),
        "tokens_as_ids": _flag(doc, "return_tokens_as_token_ids"),
    }
    stream = _flag(doc, "stream")
    if fields["prompt_logprobs"] is not None and stream:
        raise _bad("prompt_logprobs are not available with stream", "prompt_logprobs")
    if fields["echo"] and stream:
        raise _bad("echo is supported without stream only", "echo")
    if fields["logprobs"] is not None and not fields["echo"]:
        raise _bad(
            "logprobs of generated tokens are not supported; the prompt's are "
            "(echo with max_tokens 0, or prompt_logprobs)",
            "logprobs",
            "unsupported_parameter",
        )
    return fields


def parse_request(
    doc: Any,
    model_name: str,
    tokenize: Callable[[str], list[int]],
    max_logprobs: int = 20,
) -> CompletionRequest:
    """Validate a completions request body.

    Args:
        doc: The parsed JSON body.
        model_name: The served model's name.
        tokenize: Turns a text prompt into token ids.
        max_logprobs: Most tokens listed per position (vLLM's
            ``--max-logprobs``).

    Returns:
        The request.

    Raises:
        APIError: 404 for another model, 400 for anything else invalid
            (naming the field).
    """
    if not isinstance(doc, dict):
        raise _bad(f"the body is {type(doc).__name__}, expected a JSON object", "")
    model = doc.get("model")
    if not isinstance(model, str):
        raise _bad(f"model is {model!r}, expected a string", "model")
    if model != model_name:
        raise APIError(
            404,
            f"the model {model!r} does not exist; this server serves {model_name!r}",
            code="model_not_found",
            param="model",
        )
    if "prompt" not in doc:
        raise _bad("prompt is required", "prompt")
    for key, off in _UNSUPPORTED.items():
        if key in doc and not any(doc[key] == v for v in off):
            raise _bad(
                f"{key}={doc[key]!r} is not supported by the embedded engine",
                key,
                "unsupported_parameter",
            )
    scoring = _scoring(doc, max_logprobs)
    prompt = _prompt(doc["prompt"], tokenize)
    echo_only = scoring["echo"] and doc.get("max_tokens") == 0
    # max_tokens 0 asks for the echo alone, as vLLM allows it (PR #2995).
    sampling, params = _sampling(
        {k: v for k, v in doc.items() if k != "max_tokens"} if echo_only else doc
    )
    scored = scoring["echo"] or scoring["prompt_logprobs"] is not None
    score_from = doc.get("prompt_logprobs_from")
    if score_from is not None and (
        isinstance(score_from, bool)
        or not isinstance(score_from, int)
        or not 1 <= score_from <= len(prompt)
    ):
        raise _bad(
            f"prompt_logprobs_from is {score_from!r}, expected an int in "
            f"[1, {len(prompt)}] (the prompt's length)",
            "prompt_logprobs_from",
        )
    if scored and not echo_only and params.max_tokens > 1:
        # A scored prompt is not stored (as the engines' score): only the
        # distribution right after it is at hand.
        raise _bad(
            f"max_tokens is {params.max_tokens}; with echo or prompt_logprobs "
            "this server generates at most 1 token",
            "max_tokens",
            "unsupported_parameter",
        )
    stream = _flag(doc, "stream")
    options = doc.get("stream_options")
    if options is not None and not stream:
        raise _bad("stream_options is only allowed with stream=true", "stream_options")
    if options is not None and not isinstance(options, dict):
        raise _bad(
            f"stream_options is {options!r}, expected an object", "stream_options"
        )
    options = options or {}
    include_usage = _flag(options, "include_usage", "stream_options.include_usage")
    continuous = _flag(
        options, "continuous_usage_stats", "stream_options.continuous_usage_stats"
    )
    salt = doc.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise _bad(f"cache_salt is {salt!r}, expected a string", "cache_salt")
    return CompletionRequest(
        prompt=prompt,
        sampling=sampling,
        params=params,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=include_usage and continuous,
        return_token_ids=_flag(doc, "return_token_ids"),
        cache_salt=salt or "",
        echo_only=echo_only,
        score_from=score_from,
        **scoring,
    )


def usage(
    prompt_tokens: int, completion_tokens: int, cached: int | None
) -> dict[str, Any]:
    """Return an OpenAI usage object.

    Args:
        prompt_tokens: Tokens in the prompt.
        completion_tokens: Tokens generated so far.
        cached: Prompt tokens reused from the KV cache; ``None`` when not
            known (no token was generated), giving null details.

    Returns:
        The usage object.
    """
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": None if cached is None else {"cached_tokens": cached},
    }


@dataclass
class ResponseBuilder:
    """Builds the JSON of one request's response or stream chunks.

    Args:
        request: The request answered.
        model: The served model's name.
    """

    request: CompletionRequest
    model: str
    id: str = field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))
    _sent_prompt: bool = False

    def _choice(
        self, text: str, ids: list[int], finish_reason: str | None
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": finish_reason,
        }
        if self.request.return_token_ids:
            if not self._sent_prompt:
                # As vLLM: the prompt's ids go with the first chunk only.
                choice["prompt_token_ids"] = self.request.prompt
                self._sent_prompt = True
            choice["token_ids"] = ids
        return choice

    def _envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def chunk(
        self,
        text: str,
        ids: list[int],
        finish_reason: str | None,
        usage_so_far: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Return one stream chunk.

        Args:
            text: The chunk's text.
            ids: The chunk's token ids.
            finish_reason: ``"stop"``, ``"length"`` or ``None``.
            usage_so_far: Continuous usage, when asked for.

        Returns:
            The chunk.
        """
        doc = self._envelope([self._choice(text, ids, finish_reason)])
        if usage_so_far is not None:
            doc["usage"] = usage_so_far
        return doc

    def usage_chunk(self, final_usage: dict[str, Any]) -> dict[str, Any]:
        """Return the last chunk: no choices, the usage."""
        doc = self._envelope([])
        doc["usage"] = final_usage
        return doc

    def response(
        self,
        text: str,
        ids: list[int],
        finish_reason: str,
        final_usage: dict[str, Any],
        fields: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Return a complete (non-streaming) response.

        Args:
            text: The completion's text.
            ids: Its token ids.
            finish_reason: ``"stop"`` or ``"length"``.
            final_usage: Its usage.
            fields: Fields of the choice besides the text (``logprobs``,
                ``prompt_logprobs``).

        Returns:
            The response.
        """
        choice = self._choice(text, ids, finish_reason)
        choice.update(fields or {})
        doc = self._envelope([choice])
        doc["usage"] = final_usage
        return doc
