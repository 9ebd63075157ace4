"""Small in-memory stand-ins for a KV context and an engine (tests only)."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from lmcache_mp.stream import TokenEvent

LAYERS = 2
WIDTH = 4


def kv_for(
    tokens: Sequence[int], layers: int = LAYERS, width: int = WIDTH
) -> np.ndarray:
    """A deterministic [2, L, T, D] KV whose values encode token and position."""
    t = np.asarray(tokens, dtype=np.float32)[None, None, :, None]
    pos = np.arange(len(tokens), dtype=np.float32)[None, None, :, None]
    layer = np.arange(layers, dtype=np.float32)[None, :, None, None]
    kind = np.arange(2, dtype=np.float32)[:, None, None, None]
    col = np.arange(width, dtype=np.float32)[None, None, None, :]
    return (t + 0.001 * pos + 10 * layer + 100 * kind + 1000 * col).astype(np.float32)


class InMemoryKV:
    """A KV context in a dict: the chunk key is (salt, every token up to it)."""

    def __init__(self, chunk_size: int = 4) -> None:
        self.chunk_size = chunk_size
        self.chunks: dict[tuple[str, tuple[int, ...]], np.ndarray] = {}
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        # A copy per process (not shared): enough for tests that only need
        # the context to reach a worker.
        return {"chunk_size": self.chunk_size, "chunks": dict(self.chunks)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def retrieve(
        self, tokens: Sequence[int], cache_salt: str = ""
    ) -> np.ndarray | None:
        parts = []
        with self._lock:
            for end in range(self.chunk_size, len(tokens) + 1, self.chunk_size):
                chunk = self.chunks.get((cache_salt, tuple(tokens[:end])))
                if chunk is None:
                    break
                parts.append(chunk)
        return np.concatenate(parts, axis=2) if parts else None

    def store(
        self,
        kv: np.ndarray,
        tokens: Sequence[int],
        cache_salt: str = "",
        *,
        overwrite: bool = False,
    ) -> bool:
        wrote = False
        with self._lock:
            for end in range(self.chunk_size, len(tokens) + 1, self.chunk_size):
                key = (cache_salt, tuple(tokens[:end]))
                if overwrite or key not in self.chunks:
                    self.chunks[key] = np.array(kv[:, :, end - self.chunk_size : end])
                    wrote = True
        return wrote


class FakeEngine:
    """A post_completion that stores the prompt's KV and yields tokens.

    Token i of a reply is ``(sum(prompt) + 7 * i) % vocab``; ``eos_id`` ends
    the reply early (the EOS token itself is not yielded, as vLLM).
    """

    def __init__(self, ctx: Any, vocab: int = 50, eos_id: int | None = None) -> None:
        self.ctx = ctx
        self.vocab = vocab
        self.eos_id = eos_id
        self.calls: list[list[int]] = []

    def __call__(
        self,
        prompt_token_ids: list[int],
        sampling_params: dict[str, Any],
        cache_salt: str,
    ) -> Iterator[TokenEvent]:
        self.calls.append(list(prompt_token_ids))
        cached = self.ctx.retrieve(prompt_token_ids, cache_salt)
        hit = 0 if cached is None else cached.shape[2]
        self.ctx.store(kv_for(prompt_token_ids), prompt_token_ids, cache_salt)
        base = sum(prompt_token_ids)
        for i in range(int(sampling_params.get("max_tokens", 1))):
            tok = (base + 7 * i) % self.vocab
            if tok == self.eos_id:
                return
            yield TokenEvent(tok, f"<{tok}>", hit if i == 0 else None)


class FlakyEngine(FakeEngine):
    """Yields one token, then fails as a dropped connection would."""

    def __call__(
        self,
        prompt_token_ids: list[int],
        sampling_params: dict[str, Any],
        cache_salt: str,
    ) -> Iterator[TokenEvent]:
        yield TokenEvent(1, "x")
        raise ConnectionError("engine connection reset mid-stream")


class BadEventEngine(FakeEngine):
    """Yields bare ints instead of token events."""

    def __call__(  # type: ignore[override]
        self,
        prompt_token_ids: list[int],
        sampling_params: dict[str, Any],
        cache_salt: str,
    ) -> Iterator[int]:
        yield 7


class FileBarrierEngine(FakeEngine):
    """Answers only once ``parties`` requests are in flight at the same time.

    Each call drops a file in ``directory`` and waits (up to ``timeout``)
    until ``parties`` files exist; works across processes. A request that
    times out raises, so a run that is not fully concurrent fails fast.
    """

    def __init__(
        self, ctx: Any, directory: str, parties: int, timeout: float = 20.0
    ) -> None:
        super().__init__(ctx)
        self.directory = directory
        self.parties = parties
        self.timeout = timeout

    def __call__(
        self,
        prompt_token_ids: list[int],
        sampling_params: dict[str, Any],
        cache_salt: str,
    ) -> Iterator[TokenEvent]:
        import os
        import time
        import uuid

        open(os.path.join(self.directory, uuid.uuid4().hex), "w").close()
        deadline = time.monotonic() + self.timeout
        while len(os.listdir(self.directory)) < self.parties:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"only {len(os.listdir(self.directory))} requests in flight"
                )
            time.sleep(0.01)
        yield from super().__call__(prompt_token_ids, sampling_params, cache_salt)


def q_for(
    tokens: Sequence[int], layers: int = LAYERS, width: int = WIDTH
) -> np.ndarray:
    """A deterministic [1, L, T, D] query tensor, distinct from :func:`kv_for`."""
    return -kv_for(tokens, layers, width)[:1]


class QueryFakeEngine(FakeEngine):
    """A :class:`FakeEngine` that also stores the prompt's queries in ``q_ctx``
    (as the embedded engine does given a QUERY context)."""

    def __init__(self, ctx: Any, q_ctx: Any, vocab: int = 50) -> None:
        super().__init__(ctx, vocab)
        self.q_ctx = q_ctx

    def __call__(
        self,
        prompt_token_ids: list[int],
        sampling_params: dict[str, Any],
        cache_salt: str,
    ) -> Iterator[TokenEvent]:
        self.q_ctx.store(q_for(prompt_token_ids), prompt_token_ids, cache_salt)
        return super().__call__(prompt_token_ids, sampling_params, cache_salt)
