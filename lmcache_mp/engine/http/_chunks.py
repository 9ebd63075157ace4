"""Decoding an OpenAI completions event stream into token events.

Turns each ``data:`` chunk of ``POST /v1/completions`` with
``"stream": true`` into :class:`~lmcache_mp.stream.TokenEvent` s, in order,
reading the token ids where the client asked for them and the cache hits
from usage (see :mod:`lmcache_mp.engine.http.openai`).
"""

from __future__ import annotations

import json
from typing import Any

from lmcache_mp.errors import LMCacheStreamError
from lmcache_mp.stream import TokenEvent

__all__ = ["ChunkDecoder", "is_int"]

_TOKEN_ID_PREFIX = "token_id:"


def is_int(value: Any) -> bool:
    """Whether ``value`` is a JSON integer (bool excluded)."""
    return isinstance(value, int) and not isinstance(value, bool)


class ChunkDecoder:
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
        if is_int(completion):
            self._reported_tokens = completion
        details = usage.get("prompt_tokens_details")
        if details is None:
            return
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        if cached is None:
            return
        if not is_int(cached) or cached < 0:
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
        if not is_int(item) or item < 0:
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
