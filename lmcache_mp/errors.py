"""Every exception and warning lmcache_mp raises.

Each class subclasses the nearest standard-library class as well as
:class:`LMCacheError`, so callers can catch either the precise failure
(``except TimeoutError``) or anything from this package
(``except LMCacheError``).
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping
from concurrent.futures.process import BrokenProcessPool
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lmcache_mp.metrics import Metrics

__all__ = [
    "CacheKindError",
    "CorruptChunkWarning",
    "EngineHTTPError",
    "KVCapacityError",
    "KVConfigError",
    "KVEvictedError",
    "KVStoreAuthError",
    "KVStoreConnectionError",
    "KVStoreError",
    "KVStoreSecurityError",
    "LMCacheBatchedStreamError",
    "LMCacheError",
    "LMCachePicklingError",
    "LMCacheStreamError",
    "ModelLoadError",
    "NoFullChunkError",
    "PhaseTimeoutError",
    "RemoteTraceback",
    "SamplingParamsError",
    "StreamInputError",
    "TerminatedWorkerError",
]


class LMCacheError(Exception):
    """Base class of every error raised by lmcache_mp itself."""


class LMCacheStreamError(LMCacheError, RuntimeError):
    """Raised when one stream's operation fails.

    Raised by ``generate`` when ``post_completion`` fails or yields something
    that is not a token event, by ``retrieve_kv`` when no KV appears before
    the timeout, and by ``update_kv``/``modify_kv`` when an edit is invalid.
    Upstream's class of the same name is a ``RuntimeError`` too.

    Attributes:
        stream_id: The id of the stream that failed, or ``None`` when the
            error is not tied to a stream (e.g. an HTTP engine error raised
            before a stream is known).
    """

    def __init__(self, message: str, stream_id: str | None = None) -> None:
        super().__init__(message)
        self.stream_id = stream_id

    def __reduce__(self) -> tuple[object, ...]:
        # Keep stream_id across the pipe from a worker (exceptions pickle
        # only ``args`` by default).
        return (type(self), (str(self), self.stream_id))


class StreamInputError(LMCacheStreamError, ValueError):
    """Raised when a stream is given bad input.

    Examples: prompt token ids that are not non-negative ints, an empty
    prompt, ``max_tokens`` below 1, or a modify fn whose result is not a
    4-D ``[2, L, T, D]`` array with ``T == len(new_tokens)``.
    """


class CacheKindError(StreamInputError, KeyError):
    """Raised when a stream lacks the context of a cache kind an operation
    needs, or is given a kind it does not know.

    Examples: ``retrieve(kind=QUERY)`` on a stream with only a KV context;
    a context whose ``.kind`` is not an ``LMCacheSDKCacheKind``; the
    ``snapkv`` edit given a stream without a QUERY context; a modify fn
    returning a kind other than KV.
    """

    def __str__(self) -> str:
        # KeyError quotes its message; this is a sentence, not a key.
        return str(self.args[0]) if self.args else ""


class EngineHTTPError(LMCacheStreamError):
    """Raised by the OpenAI-compatible client when the server answers a
    completion, scoring or models request with an HTTP error (4xx/5xx).

    Attributes:
        status: The HTTP status code.
        server_message: The server's own error message (from its OpenAI-style
            JSON error body, or the body's text).
    """

    def __init__(
        self,
        message: str,
        stream_id: str | None = None,
        status: int = 0,
        server_message: str = "",
    ) -> None:
        super().__init__(message, stream_id)
        self.status = status
        self.server_message = server_message

    def __reduce__(self) -> tuple[object, ...]:
        return (
            type(self),
            (str(self), self.stream_id, self.status, self.server_message),
        )


class SamplingParamsError(LMCacheError, ValueError):
    """Raised by an engine when a sampling parameter has an invalid value."""


class LMCacheBatchedStreamError(LMCacheError, RuntimeError):
    """Raised when a batch operation fails.

    Raised for an unknown stream id, a duplicate ``add``, an invalid mode or
    executor, and at the end of a phase in which one or more streams failed.
    In the last case every other stream has still run and committed.

    Attributes:
        failures: Stream id to the exception that stream raised (its remote
            traceback, when it ran in a worker, is the exception's
            ``__cause__``). Empty for errors not tied to a phase.
        metrics: The report of the streams that succeeded, when the error
            ends a phase; ``None`` otherwise.
    """

    def __init__(
        self,
        message: str,
        failures: Mapping[str, BaseException] | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        super().__init__(message)
        self.failures: dict[str, BaseException] = dict(failures or {})
        self.metrics = metrics

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (str(self), self.failures, self.metrics))


class RemoteTraceback(LMCacheError):
    """The formatted traceback of an exception raised in a worker process.

    Never raised on its own: it is set as the ``__cause__`` of the exception
    re-raised in the parent, so that the parent's traceback shows where the
    worker failed (as ``concurrent.futures`` does).
    """

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return f'\n"""\n{self.tb}"""'


class TerminatedWorkerError(LMCacheError, BrokenProcessPool):
    """Raised for each stream whose worker process died while running it.

    The message gives the exit code or the signal and its likely cause
    (``os._exit``, the kernel's OOM killer, a segfault in native code).
    The pool is rebuilt before the next phase.

    Attributes:
        exitcode: The worker's exit code, negative for a signal, or ``None``
            when it could not be read.
    """

    def __init__(self, message: str, exitcode: int | None = None) -> None:
        super().__init__(message)
        self.exitcode = exitcode

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (str(self), self.exitcode))


class PhaseTimeoutError(LMCacheError, TimeoutError):
    """Raised for each stream still running when a phase's ``timeout`` ends.

    The workers running those streams are terminated, the streams keep their
    previous state, and the pool is rebuilt before the next phase.
    """


class LMCachePicklingError(LMCacheError, pickle.PicklingError):
    """Raised before any stream is touched when a phase's modify fn,
    ``post_completion`` or KV context cannot be pickled for the workers.

    The message names the object and the reason given by cloudpickle.
    """


class KVStoreError(LMCacheError, OSError):
    """Raised when the KV store cannot be opened, read or written."""


class KVStoreSecurityError(KVStoreError, PermissionError):
    """Raised when a store directory is not owned by the current user or is
    accessible to other users (its mode is not 0700), or when a Redis
    server's ACL refuses a command the store needs (``NOPERM``)."""


class KVStoreConnectionError(KVStoreError, ConnectionError):
    """Raised when a networked store (``redis://``) cannot be reached.

    Raised by ``connect()``, ``ping()`` and any later call when the server
    refuses the connection, does not answer within the URL's ``timeout``
    (a few seconds by default; never a hang), or drops the connection. The
    message names the store's URL with its password masked.
    """


class KVStoreAuthError(KVStoreConnectionError, KVStoreSecurityError):
    """Raised when a Redis server refuses the store's credentials.

    A wrong password or ACL user, a disabled user, or a server that needs a
    password the URL does not give. It is both a connection error (no
    usable connection) and a security error (the server said no); the
    message says "authentication" and never contains the password.
    """


class KVCapacityError(KVStoreError):
    """Raised at once by a store call whose new chunks do not fit the store
    even after evicting every chunk it may evict.

    The KV of the member streams of open batches is pinned and never
    evicted; what cannot fit besides it is refused whole (no chunk of the
    call is written) instead of being dropped. The message names the
    stream, the bytes asked, pinned and allowed, and how to raise the
    capacity.

    Attributes:
        stream_id: The stream whose store failed, or ``None`` outside one.
        asked: Bytes the call needed to write.
        pinned: Bytes the store holds pinned by open batches.
        allowed: The store's capacity in bytes.
    """

    def __init__(
        self,
        message: str,
        stream_id: str | None = None,
        asked: int = 0,
        pinned: int = 0,
        allowed: int = 0,
    ) -> None:
        super().__init__(message)
        self.stream_id = stream_id
        self.asked = asked
        self.pinned = pinned
        self.allowed = allowed

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""

    def __reduce__(self) -> tuple[object, ...]:
        return (
            type(self),
            (str(self), self.stream_id, self.asked, self.pinned, self.allowed),
        )


class NoFullChunkError(LMCacheStreamError, LookupError):
    """Raised at once by a stream's retrieve (``retrieve_kv``, a modify)
    when its tokens are fewer than the context's ``chunk_size``.

    A store keeps only full chunks (as LMCache does), so no KV of such a
    stream can ever be cached, and polling for it would only wait out
    ``timeout``. Prefill a longer prompt, or use a smaller chunk size.
    """


class KVEvictedError(LMCacheStreamError, LookupError):
    """Raised at once by a stream's retrieve (``retrieve_kv``, a modify)
    when the store has evicted a chunk of its cached prefix.

    Polling for it would never succeed: the KV was there and is gone, so
    the stream fails without waiting ``timeout``. Within an open batch the
    store does not evict its members' KV, so this means the KV was lost
    outside one (another process's store past capacity, or a store with
    no pins such as upstream's).
    """


class KVConfigError(LMCacheError, ValueError):
    """Raised for a bad store URL or scheme, an unsupported dtype, or a KV
    whose layout (layers, width, dtype) does not match the store's."""


class ModelLoadError(LMCacheError, OSError):
    """Raised by ``HFEngine.from_pretrained`` when a model cannot be found or
    loaded: an alias whose package is not installed (the message gives the
    install command), a path that holds no model, or files ``transformers``
    cannot read."""


class CorruptChunkWarning(RuntimeWarning):
    """Warned when a stored chunk fails its header or checksum check.

    The chunk is treated as a cache miss and never returned.
    """
