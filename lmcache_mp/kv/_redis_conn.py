"""The Redis store's link to its server: URL, lazy import, pools, errors.

``redis`` is an optional extra: nothing here imports it before a
``redis://`` store is first used, so importing ``lmcache_mp`` never does.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, NamedTuple, cast
from urllib.parse import parse_qsl, quote, unquote, urlsplit

from lmcache_mp.errors import (
    KVConfigError,
    KVStoreAuthError,
    KVStoreConnectionError,
    KVStoreError,
    KVStoreSecurityError,
)

if TYPE_CHECKING:
    import redis

__all__ = [
    "DEFAULT_PREFIX",
    "DEFAULT_TIMEOUT_S",
    "LRU_POLICIES",
    "RedisLink",
    "RedisTarget",
    "ServerMemory",
    "check_policy",
    "client_for",
    "evicted_keys",
    "redis_errors",
    "redis_module",
    "server_memory",
]

#: Namespace of a store whose URL names no ``prefix``.
DEFAULT_PREFIX = "lmcache-mp"
#: Seconds every connect and every call may take (URL query ``timeout=``).
DEFAULT_TIMEOUT_S = 5.0
_DEFAULT_PORT = 6379
# No ':' (it separates the key's parts) and no glob characters (destroy
# deletes by SCAN MATCH "{prefix}:*").
_PREFIX = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_FORM = "redis://[[USER]:PASSWORD@]HOST[:PORT][/DB][?prefix=NAME&timeout=SECONDS]"
#: Policies that evict any key by recency or frequency. Chunks carry no
#: TTL, so a volatile-* policy would never evict them and writes would
#: fail once the server is full; noeviction fails them at once.
LRU_POLICIES = frozenset({"allkeys-lru", "allkeys-lfu"})


@dataclass(frozen=True)
class RedisTarget:
    """Where a Redis store lives: the server, the credentials, the prefix."""

    host: str
    port: int
    db: int
    username: str | None
    password: str | None
    prefix: str
    timeout: float

    @classmethod
    def parse(cls, url: str) -> RedisTarget:
        """Parse a ``redis://`` URL.

        Args:
            url: ``redis://[[USER]:PASSWORD@]HOST[:PORT][/DB][?prefix=NAME&
                timeout=SECONDS]``; user and password are percent-decoded.

        Returns:
            The target.

        Raises:
            KVConfigError: If the URL is malformed, the prefix is not letters,
                digits, '.', '_' or '-', or the timeout not a positive number.
        """
        parts = urlsplit(url)
        try:
            port = parts.port or _DEFAULT_PORT
        except ValueError as exc:
            raise KVConfigError(f"bad store URL: {exc}; expected {_FORM}") from exc
        db_text = parts.path.lstrip("/") or "0"
        query = dict(parse_qsl(parts.query, keep_blank_values=True))
        unknown = sorted(set(query) - {"prefix", "timeout"})
        if (
            parts.scheme.lower() != "redis"
            or not parts.hostname
            or not db_text.isdigit()
            or parts.fragment
            or unknown
        ):
            extra = f" (unknown options: {', '.join(unknown)})" if unknown else ""
            raise KVConfigError(f"bad store URL{extra}: expected {_FORM}")
        prefix = query.get("prefix", DEFAULT_PREFIX)
        if not _PREFIX.fullmatch(prefix):
            raise KVConfigError(
                f"bad store prefix {prefix!r}: letters, digits, '.', '_' or '-' "
                "(at most 128, not starting with '.' or '-')"
            )
        try:
            timeout = float(query.get("timeout", DEFAULT_TIMEOUT_S))
        except ValueError:
            timeout = -1.0
        if not 0 < timeout < float("inf"):
            raise KVConfigError(
                f"bad store timeout {query['timeout']!r}: a positive number of seconds"
            )
        return cls(
            host=parts.hostname,
            port=port,
            db=int(db_text),
            username=unquote(parts.username) if parts.username else None,
            password=unquote(parts.password) if parts.password else None,
            prefix=prefix,
            timeout=timeout,
        )

    def url(self, *, secret: bool) -> str:
        """The canonical URL; with ``secret`` false the password is masked.

        Args:
            secret: Include the password (to reopen the store), or ``***``
                in its place (for messages and ``repr``).

        Returns:
            ``redis://...`` with the prefix, and the timeout when not the
            default.
        """
        auth = quote(self.username, safe="") if self.username else ""
        if self.password is not None:
            auth += ":" + (quote(self.password, safe="") if secret else "***")
        host = f"[{self.host}]" if ":" in self.host else self.host
        query = f"prefix={self.prefix}"
        if self.timeout != DEFAULT_TIMEOUT_S:
            query += f"&timeout={self.timeout:g}"
        at = "@" if auth else ""
        return f"redis://{auth}{at}{host}:{self.port}/{self.db}?{query}"


def redis_module() -> ModuleType:
    """Import ``redis`` on first use.

    Returns:
        The ``redis`` module.

    Raises:
        KVConfigError: If it is not installed, naming the extra to install.
    """
    try:
        import redis
    except ImportError as exc:
        raise KVConfigError(
            "redis:// stores need the redis package (pip install 'lmcache-mp[redis]')"
        ) from exc
    return redis


# One pool per (target, process): a forked child must never write to its
# parent's sockets, so the pid is part of the key, and the at-fork hook
# drops the parent's pools (and a lock another thread may have held).
_POOLS: dict[tuple[RedisTarget, int], redis.ConnectionPool] = {}
_POOLS_LOCK = threading.Lock()


def _forget_parent_pools() -> None:
    global _POOLS_LOCK
    _POOLS_LOCK = threading.Lock()
    _POOLS.clear()


os.register_at_fork(after_in_child=_forget_parent_pools)


def client_for(target: RedisTarget) -> redis.Redis:
    """A client on this process's connection pool for ``target``.

    Every connect and every call is bounded by ``target.timeout`` (a
    timeout is not retried); a dropped connection is retried once at once
    (a pooled socket the server closed), never with a backoff that would
    stall the caller.

    Args:
        target: The server, credentials and timeout.

    Returns:
        A client; connections are made when it is first used.

    Raises:
        KVConfigError: If ``redis`` is not installed.
    """
    mod = redis_module()
    key = (target, os.getpid())
    with _POOLS_LOCK:
        pool = _POOLS.get(key)
        if pool is None:
            from redis.backoff import NoBackoff
            from redis.retry import Retry

            pool = mod.ConnectionPool(
                host=target.host,
                port=target.port,
                db=target.db,
                username=target.username,
                password=target.password,
                socket_timeout=target.timeout,
                socket_connect_timeout=target.timeout,
                retry=Retry(NoBackoff(), 1, supported_errors=(mod.ConnectionError,)),
            )
            _POOLS[key] = pool
    client: redis.Redis = mod.Redis(connection_pool=pool)
    return client


@contextlib.contextmanager
def redis_errors(where: str, timeout: float) -> Iterator[None]:
    """Turn Redis errors raised inside into the store's typed errors.

    Args:
        where: The store's URL with the password masked, for the message.
        timeout: The calls' time limit, for the message.

    Raises:
        KVStoreAuthError: The server refused the credentials.
        KVStoreConnectionError: It cannot be reached or did not answer.
        KVStoreSecurityError: Its ACL refused a command (``NOPERM``).
        KVStoreError: Any other Redis error.
    """
    mod = redis_module()
    try:
        yield
    except mod.AuthenticationError as exc:
        raise KVStoreAuthError(
            f"{where}: authentication refused by the Redis server (wrong user or "
            f"password, or one is needed): {exc}"
        ) from exc
    except mod.TimeoutError as exc:
        raise KVStoreConnectionError(
            f"{where}: the Redis server did not answer within {timeout:g} s: {exc}"
        ) from exc
    except mod.ConnectionError as exc:
        raise KVStoreConnectionError(
            f"{where}: cannot reach the Redis server: {exc}"
        ) from exc
    except mod.exceptions.NoPermissionError as exc:
        raise KVStoreSecurityError(
            f"{where}: the Redis server's ACL refused a command: {exc}"
        ) from exc
    except mod.RedisError as exc:
        raise KVStoreError(f"{where}: Redis error: {exc}") from exc


class ServerMemory(NamedTuple):
    """What a Redis server says about its memory limit."""

    maxmemory: int
    """Bytes before it evicts; 0 for none (or hidden by the ACL)."""
    policy: str | None
    """``maxmemory-policy``; ``None`` when the ACL hides it."""


def server_memory(client: redis.Redis) -> ServerMemory:
    """Read ``maxmemory`` and its policy: CONFIG GET, else INFO memory.

    An ACL user often may not run CONFIG; INFO carries the same two values.
    Where both are refused the limit is reported as 0 and no policy.

    Args:
        client: The client.

    Returns:
        ``(maxmemory, policy)``.

    Raises:
        redis.RedisError: For anything but an ACL refusal.
    """
    mod = redis_module()
    with contextlib.suppress(mod.exceptions.NoPermissionError):
        conf = cast("dict[str, str]", client.config_get("maxmemory*"))
        return ServerMemory(int(conf["maxmemory"]), conf["maxmemory-policy"])
    with contextlib.suppress(mod.exceptions.NoPermissionError):
        info = client.info("memory")
        return ServerMemory(int(info["maxmemory"]), str(info["maxmemory_policy"]))
    return ServerMemory(0, None)


def check_policy(memory: ServerMemory, where: str) -> None:
    """Refuse a server that would fail writes instead of evicting.

    A server without ``maxmemory`` never evicts (unbounded; its policy does
    not matter). One with a limit must evict any key by recency or use
    (:data:`LRU_POLICIES`): chunks have no TTL, so ``volatile-*`` would
    never evict them and ``noeviction`` refuses writes once full;
    ``allkeys-random`` would evict without regard to use. A policy the
    ACL hides is not checked, with a warning.

    Args:
        memory: What the server said (:func:`server_memory`).
        where: The store's URL with the password masked.

    Raises:
        KVConfigError: For any other policy under a ``maxmemory``.
    """
    if memory.policy is None:
        warnings.warn(
            f"{where}: the server's ACL refuses CONFIG GET and INFO: its "
            "maxmemory and eviction policy are unknown (capacity reported as 0)",
            RuntimeWarning,
            stacklevel=5,  # at the caller of connect()
        )
    elif memory.maxmemory and memory.policy not in LRU_POLICIES:
        raise KVConfigError(
            f"{where}: the Redis server has maxmemory {memory.maxmemory} with "
            f"maxmemory-policy {memory.policy}, which does not evict chunks "
            "by use; a KV store needs allkeys-lru or allkeys-lfu (CONFIG SET "
            "maxmemory-policy allkeys-lru)"
        )


def evicted_keys(client: redis.Redis) -> int:
    """The server's count of evicted keys since it started.

    Args:
        client: The client.

    Returns:
        INFO stats ``evicted_keys``; 0 when the ACL refuses INFO.

    Raises:
        redis.RedisError: For anything but an ACL refusal.
    """
    mod = redis_module()
    with contextlib.suppress(mod.exceptions.NoPermissionError):
        return int(client.info("stats")["evicted_keys"])
    return 0


class RedisLink:
    """One store handle's way to its server.

    This process's client (a forked or unpickled copy gets its own pool),
    the handle's open/closed state, its typed errors, and the server's
    eviction count when the handle first used it in this process.

    Args:
        target: The server, credentials and prefix.
        where: The handle's URL with the password masked, for messages.
    """

    def __init__(self, target: RedisTarget, where: str) -> None:
        self.target = target
        self.where = where
        self.closed = False
        self._lock = threading.Lock()
        self._client: redis.Redis | None = None
        self._pid = 0
        self._evicted_base: int | None = None

    def client(self) -> redis.Redis:
        """This process's client, open or closed handle alike.

        Returns:
            The client on this process's pool (made on the first call in a
            process, so a forked copy never shares its parent's sockets).

        Raises:
            KVConfigError: If ``redis`` is not installed.
        """
        pid = os.getpid()
        with self._lock:
            if self._client is None or self._pid != pid:
                self._client, self._pid = client_for(self.target), pid
                # A forked copy counts evictions from its own first use.
                self._evicted_base = None
            return self._client

    def open_client(self) -> redis.Redis:
        """The client, for a handle that must be open; call inside
        :meth:`errors` (the first call here reads the eviction baseline).

        Returns:
            This process's client.

        Raises:
            KVStoreError: If the handle is closed.
            redis.RedisError: If the baseline cannot be read.
        """
        if self.closed:
            raise KVStoreError(f"{self.where}: the store is closed")
        client = self.client()
        if self._evicted_base is None:
            self._evicted_base = evicted_keys(client)
        return client

    def evictions(self, client: redis.Redis) -> int:
        """Keys the server evicted since this handle first used it here.

        Args:
            client: This process's client.

        Returns:
            The ``evicted_keys`` delta (0 after a restart reset the count).

        Raises:
            redis.RedisError: If the server fails.
        """
        return max(0, evicted_keys(client) - (self._evicted_base or 0))

    def errors(self) -> contextlib.AbstractContextManager[None]:
        """:func:`redis_errors` for this handle.

        Returns:
            A context manager turning Redis errors into typed store errors.
        """
        return redis_errors(self.where, self.target.timeout)
