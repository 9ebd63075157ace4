"""A real LMCache server as a KV context that pickles to process workers.

Upstream's ``lmcache.sdk.context.LMCacheSDKContext`` (``lmcache==0.5.6``)
opens a ZMQ request client and fetches the server's ``/config`` and
``/status`` when it is made, so it cannot be pickled. :func:`lmcache_context`
returns a spec that pickles by its arguments only and builds the upstream
context lazily, once per process: every copy of the spec in a process (and
every thread) shares that process's one context, which is closed when the
process exits (``atexit`` in a parent, ``multiprocessing.util.Finalize`` in
a pool worker, which leaves through ``os._exit`` after running
multiprocessing's finalizers, never ``atexit``'s hooks).

``lmcache`` itself is imported only when a context is first used.
"""

from __future__ import annotations

import atexit
import multiprocessing.util
import os
import sys
import threading
from collections.abc import Sequence
from typing import Any, NamedTuple

from lmcache_mp._util.arrays import as_numpy, as_type
from lmcache_mp.cache_kind import LMCacheSDKCacheKind, as_kind
from lmcache_mp.errors import (
    CacheKindError,
    KVConfigError,
    KVStoreConnectionError,
    KVStoreError,
)

__all__ = ["LMCacheContext", "lmcache_context"]

#: How to install upstream (what its SDK context and server import).
INSTALL_HINT = (
    "pip install --no-deps lmcache==0.5.6 after what it imports, "
    "pip install 'lmcache-mp[lmcache]' (pass your torch, e.g. "
    "'torch==2.13.0', on that line: lmcache's own dependencies pull a CUDA "
    "torch)"
)
#: Longest a close waits for the server to drop this process's registration.
_CLOSE_TIMEOUT = 5.0
#: Upstream's ZMQ message-queue module (see _forget_after_fork).
_UPSTREAM_MQ = "lmcache.v1.multiprocess.transport.zmq_impl.mq"
#: Run before multiprocessing's own finalizers of priority 0 (its pools').
_EXIT_PRIORITY = 10


class _Key(NamedTuple):
    url: str
    http_url: str
    model_name: str
    kind: str
    timeout: float


#: This process's upstream contexts, by their arguments.
_contexts: dict[_Key, Any] = {}
_lock = threading.Lock()
#: The process the exit hooks were registered in (a forked child registers
#: its own: multiprocessing clears the finalizers it inherits).
_hooked_pid: int | None = None


def _forget_after_fork() -> None:
    """In a forked child: drop the parent's contexts without closing them
    (their sockets are the parent's), so the child builds its own.

    Upstream's ZMQ clients share one polling thread per process
    (``ClientPollingLoop``), which a fork does not copy: a child that
    inherited the parent's loop would wait on it forever, so it is dropped
    too and the child's first client starts its own.
    """
    global _lock, _hooked_pid
    _contexts.clear()
    _lock = threading.Lock()
    _hooked_pid = None
    mq = sys.modules.get(_UPSTREAM_MQ)
    loop = getattr(mq, "ClientPollingLoop", None)
    if loop is not None:
        loop._instance = None
        loop._instance_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)


def _close_upstream(ctx: Any) -> None:
    """Unregister ``ctx`` from the server (bounded wait) and close its client.

    Upstream's ``close()`` only closes the request client; the server would
    keep the context's registration until its reaper drops it.
    """
    try:
        if hasattr(ctx, "_transfer_ctx"):  # registered by register_caches()
            future = ctx._req_client.unregister_kv_cache_engine_driven_context(
                ctx.instance_id
            )
            future.result(timeout=min(ctx.mq_timeout, _CLOSE_TIMEOUT))
    except Exception:  # the server may be gone already: close anyway
        pass
    finally:
        ctx.close()


def close_all() -> None:
    """Close every upstream context this process built (the exit hook).

    Safe to call more than once; a later use builds a new context.
    """
    with _lock:
        contexts = list(_contexts.values())
        _contexts.clear()
    for ctx in contexts:
        _close_upstream(ctx)


def _hook_exit() -> None:
    """Register :func:`close_all` to run when this process exits (once)."""
    global _hooked_pid
    if _hooked_pid == os.getpid():
        return
    _hooked_pid = os.getpid()
    atexit.register(close_all)
    multiprocessing.util.Finalize(None, close_all, exitpriority=_EXIT_PRIORITY)


def _build(key: _Key) -> Any:
    """Make, and register the caches of, upstream's context for ``key``.

    Raises:
        KVConfigError: If ``lmcache`` is not installed, the URL's scheme is
            not one upstream knows, or the server has no KV layout for the
            model.
        KVStoreConnectionError: If the server does not answer.
    """
    try:
        from lmcache.sdk.cache_kind import LMCacheSDKCacheKind as UpstreamKind
        from lmcache.sdk.context import LMCacheSDKContext, LMCacheSDKError
    except ImportError as exc:
        raise KVConfigError(
            f"lmcache_context needs upstream LMCache ({exc}): {INSTALL_HINT}"
        ) from exc
    where = f"the LMCache server at {key.http_url} (requests: {key.url})"
    try:
        ctx = LMCacheSDKContext(
            key.url,
            key.http_url,
            key.model_name,
            kind=UpstreamKind(key.kind),
            timeout=key.timeout,
        )
    except LMCacheSDKError as exc:
        cause = exc.__cause__ or exc
        raise KVStoreConnectionError(f"cannot reach {where}: {cause}") from exc
    except ValueError as exc:
        raise KVConfigError(f"bad LMCache request URL {key.url!r}: {exc}") from exc
    try:
        ctx.register_caches()
    except LMCacheSDKError as exc:
        ctx.close()
        cause = exc.__cause__
        detail = f"{exc}: {cause}" if cause else str(exc)
        raise KVConfigError(
            f"{where} has no usable KV layout for model {key.model_name!r} "
            f"(an engine must register one first): {detail}"
        ) from exc
    except BaseException:
        ctx.close()
        raise
    return ctx


def _upstream(key: _Key) -> Any:
    """This process's upstream context for ``key``, built on first use."""
    ctx = _contexts.get(key)
    if ctx is not None:
        return ctx
    with _lock:
        ctx = _contexts.get(key)
        if ctx is None:
            ctx = _build(key)
            _contexts[key] = ctx
            _hook_exit()
        return ctx


def _live() -> int:
    """How many upstream contexts this process holds (for tests)."""
    return len(_contexts)


class LMCacheContext:
    """A KV context on a running LMCache multiprocess server.

    Made by :func:`lmcache_context`. It holds only its arguments: it pickles
    by them, and each process that uses a copy builds (once) and shares its
    own upstream ``LMCacheSDKContext``.
    """

    __slots__ = ("_key",)

    def __init__(
        self,
        url: str,
        http_url: str,
        model_name: str,
        kind: LMCacheSDKCacheKind = LMCacheSDKCacheKind.KV,
        timeout: float = 60.0,
    ) -> None:
        """Record where the server is; nothing is opened.

        Args:
            url: The server's request endpoint (``tcp://host:port``).
            http_url: Its HTTP endpoint (``http://host:port``).
            model_name: The model whose KV layout an engine registered.
            kind: The cache kind served.
            timeout: Seconds any one server call may take.

        Raises:
            KVConfigError: If an argument has the wrong type or value.
        """
        try:
            kind = as_kind(kind)
        except CacheKindError:
            raise KVConfigError(f"{kind!r} is not a cache kind") from None
        for name, value in (("url", url), ("http_url", http_url)):
            if not isinstance(value, str) or not value:
                raise KVConfigError(f"{name} must be a non-empty str, got {value!r}")
        if not isinstance(model_name, str) or not model_name:
            raise KVConfigError(f"model_name must be a non-empty str: {model_name!r}")
        if isinstance(timeout, bool) or not isinstance(timeout, int | float):
            raise KVConfigError(f"timeout must be a number, got {timeout!r}")
        if not timeout > 0:
            raise KVConfigError(f"timeout must be positive, got {timeout!r}")
        self._key = _Key(url, http_url.rstrip("/"), model_name, kind.value, timeout)

    def __reduce__(self) -> tuple[Any, ...]:
        key = self._key
        return (
            type(self),
            (key.url, key.http_url, key.model_name, self.kind, key.timeout),
        )

    def __repr__(self) -> str:
        key = self._key
        return (
            f"lmcache_context({key.url!r}, {key.http_url!r}, {key.model_name!r}, "
            f"kind={self.kind}, timeout={key.timeout!r})"
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LMCacheContext) and other._key == self._key

    def __hash__(self) -> int:
        return hash(self._key)

    @property
    def kind(self) -> LMCacheSDKCacheKind:
        """The cache kind served (lmcache_mp's enum; no server call)."""
        return LMCacheSDKCacheKind(self._key.kind)

    @property
    def chunk_size(self) -> int:
        """Tokens per chunk, as the server is configured.

        Raises:
            KVConfigError: See :func:`lmcache_context`.
            KVStoreConnectionError: If the server cannot be reached.
        """
        return int(_upstream(self._key).chunk_size)

    def retrieve(self, tokens: Sequence[int], cache_salt: str = "") -> Any:
        """Return the KV of the longest cached chunk-aligned prefix.

        Args:
            tokens: The token ids whose KV is wanted.
            cache_salt: Isolation salt.

        Returns:
            A CPU torch tensor ``[2, L, T, D]`` (``[1, L, T, D]`` for QUERY),
            ``T`` a multiple of ``chunk_size``; ``None`` on a miss.

        Raises:
            KVStoreConnectionError: If the server cannot be reached or does
                not answer within ``timeout``.
            KVStoreError: If the server fails the request.
        """
        return self._call("retrieve", list(tokens), cache_salt)

    def store(self, kv: Any, tokens: Sequence[int], cache_salt: str = "") -> bool:
        """Store the full chunks of ``kv``.

        Args:
            kv: ``[2, L, len(tokens), D]``: a torch tensor or a numpy array
                (handed over as a tensor without a copy).
            tokens: The token ids the KV belongs to.
            cache_salt: Isolation salt.

        Returns:
            Whether the server stored it.

        Raises:
            KVConfigError: If ``kv``'s token axis does not match ``tokens``.
            KVStoreConnectionError: If the server cannot be reached or does
                not answer within ``timeout``.
            KVStoreError: If the server fails the request.
        """
        if not (hasattr(kv, "detach") and hasattr(kv, "numpy")):
            kv = as_type(as_numpy(kv), "torch")
        if kv.ndim != 4 or kv.shape[2] != len(tokens):
            raise KVConfigError(
                f"kv of shape {tuple(kv.shape)} does not hold {len(tokens)} tokens"
            )
        return bool(self._call("store", kv, list(tokens), cache_salt))

    def close(self) -> None:
        """Close this process's upstream context for these arguments.

        Every copy in the process shares it; a later use builds a new one.
        """
        with _lock:
            ctx = _contexts.pop(self._key, None)
        if ctx is not None:
            _close_upstream(ctx)

    def _call(self, op: str, *args: Any) -> Any:
        """Run upstream's ``op`` with ``args``, its failures as lmcache_mp's."""
        ctx = _upstream(self._key)
        what = f"{op} on the LMCache server at {self._key.url}"
        try:
            return getattr(ctx, op)(*args)
        except (KVStoreError, KVConfigError):
            raise
        except TimeoutError as exc:
            raise KVStoreConnectionError(f"{what} timed out: {exc}") from exc
        except Exception as exc:
            if type(exc).__name__ != "LMCacheSDKError":
                raise
            raise KVStoreError(f"{what} failed: {exc}") from exc


def lmcache_context(
    url: str,
    http_url: str,
    model_name: str,
    *,
    kind: LMCacheSDKCacheKind = LMCacheSDKCacheKind.KV,
    timeout: float = 60.0,
) -> LMCacheContext:
    """A KV context on a running LMCache multiprocess server (upstream 0.5.6's
    ``LMCacheSDKContext``) that pickles to process workers.

    Nothing is opened here: each process builds upstream's context on its
    first ``chunk_size``/``retrieve``/``store`` and closes it when it exits.

    Args:
        url: The server's request endpoint, e.g. ``tcp://127.0.0.1:5555``.
        http_url: Its HTTP endpoint, e.g. ``http://127.0.0.1:8080``.
        model_name: The model whose KV layout an engine (vLLM) registered.
        kind: ``KV`` or ``QUERY`` (upstream's kind of the same value is
            used).
        timeout: Seconds any one server call may take (also bounds the
            first connection).

    Returns:
        The context spec.

    Raises:
        KVConfigError: For a bad argument here; on first use, when ``lmcache``
            is not installed or the server has no layout for the model.
        KVStoreConnectionError: On first use, when the server does not
            answer (the message names its URL).
    """
    return LMCacheContext(url, http_url, model_name, kind, timeout)
