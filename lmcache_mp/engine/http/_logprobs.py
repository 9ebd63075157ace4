"""Log-probabilities on the wire of OpenAI completions.

Two request shapes ask a server for the log-probabilities of a prompt's
tokens, each answered with the top-K tokens of every position's
distribution (and the prompt's own token there, when not among them):

- vLLM's ``prompt_logprobs: K`` (vLLM >= 0.5.5, PR #7453; not with
  ``stream``): ``choices[0].prompt_logprobs`` holds one entry per prompt
  position, the first ``null``, each ``{"<token id>": {"logprob", "rank",
  "decoded_token"}}``.
- OpenAI's legacy ``echo: true`` with ``logprobs: K`` (vLLM since 0.2,
  with ``max_tokens: 0`` since 0.3.3, PR #2995):
  ``choices[0].logprobs.top_logprobs`` holds one entry per prompt token
  (then per generated token), the first ``null``, each ``{"<token>":
  logprob}``; with ``return_tokens_as_token_ids`` (vLLM >= 0.5) the keys
  are ``"token_id:<id>"``, the only form that names a token unambiguously.

vLLM caps K at its ``--max-logprobs`` (20 by default). This module turns a
distribution into those entries (the server's side) and entries back into a
full row (the client's side).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, get_args

import numpy as np
import numpy.typing as npt

from lmcache_mp.errors import LMCacheStreamError

__all__ = [
    "SCORE_SOURCES",
    "TOKEN_ID_PREFIX",
    "ScoreSource",
    "dense_row",
    "echo_logprobs",
    "prompt_logprobs",
    "read_rows",
    "score_fields",
    "top_entries",
]

#: How the client asks for the prompt's log-probabilities.
ScoreSource = Literal["prompt_logprobs", "echo"]
SCORE_SOURCES: tuple[str, ...] = get_args(ScoreSource)
TOKEN_ID_PREFIX = "token_id:"
#: The probability mass left to the tokens a server did not list, at least:
#: keeps every filled-in log-probability finite when the listed tokens'
#: probabilities (rounded) sum to 1.
_MIN_REST = 1e-9
#: vLLM writes -9999.0 for a log-probability of -inf in ``echo`` answers.
_FLOOR = -9999.0

_Row = npt.NDArray[np.float32]


def top_entries(row: _Row, k: int, token: int) -> list[tuple[int, float, int]]:
    """The ``k`` most likely tokens of a row, and ``token`` where not among them.

    Args:
        row: A ``[vocab]`` log-probability row.
        k: Tokens to list (0 lists ``token`` alone).
        token: The token actually at this position.

    Returns:
        ``(token id, logprob, rank)`` tuples, ``token`` first (as vLLM lists
        it), then the others from most likely; ranks count from 1.
    """
    k = min(k, row.shape[0])
    top = np.argpartition(-row, k - 1)[:k] if k else np.zeros(0, dtype=np.int64)
    top = top[np.argsort(-row[top], kind="stable")]
    # A listed token's rank is its place in the top; only the prompt's own
    # token, when not among them, is counted over the whole row.
    ranks = {int(t): place + 1 for place, t in enumerate(top)}
    if token not in ranks:
        ranks[token] = int((row > row[token]).sum()) + 1
    ids = [token, *(int(t) for t in top if t != token)]
    return [(i, float(row[i]), ranks[i]) for i in ids]


def prompt_logprobs(
    rows: _Row,
    prompt: Sequence[int],
    first: int,
    k: int,
    piece: Callable[[int], str],
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs`` of a prompt.

    Args:
        rows: The distributions of ``prompt[first:]``, one row per token.
        prompt: The prompt's token ids.
        first: The first position with a row; the ones before are ``null``.
        k: Top tokens listed per position.
        piece: A token's text (``decoded_token``).

    Returns:
        One entry per prompt position.
    """
    out: list[dict[str, dict[str, Any]] | None] = [None] * first
    for row, token in zip(rows, prompt[first:], strict=True):
        out.append(
            {
                str(i): {"logprob": lp, "rank": rank, "decoded_token": piece(i)}
                for i, lp, rank in top_entries(row, k, token)
            }
        )
    return out


def echo_logprobs(
    rows: _Row,
    prompt: Sequence[int],
    first: int,
    k: int,
    piece: Callable[[int], str],
    as_ids: bool,
) -> dict[str, list[Any]]:
    """The legacy ``logprobs`` object of an echoed prompt.

    Args:
        rows: The distributions of ``prompt[first:]``, one row per token.
        prompt: The prompt's token ids.
        first: The first position with a row; the ones before are ``null``.
        k: Top tokens listed per position.
        piece: A token's text.
        as_ids: Name tokens ``"token_id:<id>"``
            (``return_tokens_as_token_ids``) instead of by their text.

    Returns:
        ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``.
    """

    def name(token: int) -> str:
        return f"{TOKEN_ID_PREFIX}{token}" if as_ids else piece(token)

    pieces = [piece(t) for t in prompt]
    offsets = np.cumsum([0, *(len(p) for p in pieces[:-1])]).tolist()
    token_logprobs: list[float | None] = [None] * first
    top: list[dict[str, float] | None] = [None] * first
    for row, token in zip(rows, prompt[first:], strict=True):
        entries = top_entries(row, k, token)
        token_logprobs.append(entries[0][1])
        top.append({name(i): max(lp, _FLOOR) for i, lp, _ in entries})
    return {
        "tokens": [name(t) for t in prompt],
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": offsets,
    }


def score_fields(source: str, k: int, start: int) -> dict[str, Any]:
    """The request fields that ask for the prompt's log-probabilities.

    Args:
        source: ``"prompt_logprobs"`` or ``"echo"``.
        k: Top tokens per position.
        start: The first position scored (the context's length).

    Returns:
        The fields: ``prompt_logprobs`` with one generated token (vLLM
        refuses ``max_tokens: 0`` without ``echo``), or ``echo`` with
        ``logprobs``, ``return_tokens_as_token_ids`` and no generated token;
        and ``prompt_logprobs_from``, which ``lmcache-mp serve`` reads as
        where the context ends (it scores as the engine's ``score`` of
        context and continuation: the context's cached prefix reused, its
        last token computed) and vLLM ignores.
    """
    fields: dict[str, Any] = {"prompt_logprobs_from": start}
    if source == "prompt_logprobs":
        fields.update(prompt_logprobs=k, max_tokens=1)
    else:
        fields.update(
            echo=True, logprobs=k, return_tokens_as_token_ids=True, max_tokens=0
        )
    return fields


def _logprob(value: Any) -> float | None:
    """A listed token's log-probability: vLLM's ``{"logprob": x}`` or ``x``."""
    if isinstance(value, dict):
        value = value.get("logprob")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return max(float(value), _FLOOR) if not math.isnan(value) else None
    return None


def _token(key: str, source: str) -> int | None:
    if source == "echo":
        if not key.startswith(TOKEN_ID_PREFIX):
            return None
        key = key[len(TOKEN_ID_PREFIX) :]
    return int(key) if key.isdigit() else None


def read_rows(
    doc: Any, source: str, first: int, count: int, url: str
) -> list[dict[int, float]]:
    """Read the listed log-probabilities of positions ``first...`` of a prompt.

    Args:
        doc: The parsed response of a non-streaming completions request.
        source: How they were asked for (``"prompt_logprobs"`` or ``"echo"``).
        first: The first position to read.
        count: Positions to read.
        url: The request URL, for messages.

    Returns:
        ``count`` mappings of token id to log-probability.

    Raises:
        LMCacheStreamError: If the response lacks them (an older server, or
            one that ignores the field), holds fewer positions, a ``null``
            at a read position (a server that reused that position's KV
            from its cache and never computed its logits), or an entry that
            is not ``{token: logprob}`` (for ``echo``, keys other than
            ``"token_id:<id>"``: the server ignored
            ``return_tokens_as_token_ids``).
    """
    where = (
        "choices[0].prompt_logprobs"
        if source == "prompt_logprobs"
        else "choices[0].logprobs.top_logprobs"
    )

    def error(problem: str) -> LMCacheStreamError:
        return LMCacheStreamError(f"POST {url}: {where} {problem}")

    choices = doc.get("choices") if isinstance(doc, dict) else None
    choice = choices[0] if isinstance(choices, list) and choices else None
    if not isinstance(choice, dict):
        raise LMCacheStreamError(f"POST {url}: the response has no choices[0]")
    entries: Any = choice.get("prompt_logprobs")
    if source == "echo":
        logprobs = choice.get("logprobs")
        entries = logprobs.get("top_logprobs") if isinstance(logprobs, dict) else None
    if not isinstance(entries, list):
        raise error(
            f"is {str(entries)[:100]}, expected a list: the server may not "
            f"support {source!r} scoring"
        )
    if len(entries) < first + count:
        raise error(
            f"has {len(entries)} positions, expected at least {first + count} "
            "(the prompt's)"
        )
    rows = []
    for position in range(first, first + count):
        entry = entries[position]
        if entry is None:
            raise error(
                f"is null at position {position}: the server did not compute "
                "it (lmcache-mp serve leaves null the positions whose KV it "
                "reused from its cache)"
            )
        row = {}
        if isinstance(entry, dict):
            for key, value in entry.items():
                token, logprob = _token(str(key), source), _logprob(value)
                if token is None or logprob is None:
                    raise error(
                        f"holds {key!r}: {str(value)[:80]} at position {position}, "
                        + (
                            "expected 'token_id:<id>': logprob (the server may "
                            "not support return_tokens_as_token_ids)"
                            if source == "echo"
                            else "expected '<id>': {'logprob': float}"
                        )
                    )
                row[token] = logprob
        if not row:
            raise error(f"is {str(entry)[:100]} at position {position}")
        rows.append(row)
    return rows


def dense_row(entries: Mapping[int, float], vocab_size: int, url: str) -> _Row:
    """A full log-probability row from a server's listed tokens.

    The listed tokens keep the server's log-probabilities; the probability
    mass they leave (at least ``1e-9``) is spread evenly over the others.

    Args:
        entries: Token id to log-probability.
        vocab_size: The model's vocabulary size.
        url: The request URL, for messages.

    Returns:
        A ``[vocab_size]`` float32 row.

    Raises:
        LMCacheStreamError: If a token id is outside ``[0, vocab_size)``
            (the vocabulary size given is not the served model's).
    """
    ids = np.fromiter(entries.keys(), dtype=np.int64, count=len(entries))
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.size:
        raise LMCacheStreamError(
            f"POST {url}: the server listed token {int(bad[0])}, outside the "
            f"vocabulary [0, {vocab_size}): is vocab_size the served model's?"
        )
    values = np.fromiter(entries.values(), dtype=np.float64, count=len(entries))
    others = vocab_size - len(entries)
    rest = max(1.0 - float(np.exp(values).sum()), _MIN_REST)
    row = np.full(vocab_size, math.log(rest / others) if others else _FLOOR)
    row[ids] = values
    result: _Row = row.astype(np.float32)
    return result
