"""Which worker runs which stream: the claims a task takes on its jobs.

A task claims each job before running it and releases the claim once the
outcome is ready. After a worker dies, the parent reads the claims left
behind: their streams were running on the dead worker and fail, naming
it; every other lost stream is run again. An engine that retries a task by
itself (Dask reschedules the tasks of a lost worker) finds the claim taken
and reports the stream lost instead of running it twice: a fn
that killed one worker is not handed a second one, and a stream never
commits twice.

Claims are plain picklable dataclasses, so they cross the same boundary as
the jobs. Files serve workers that share this machine (the process pool,
Dask or Ray on one host); :class:`RedisClaims` serves workers on several
hosts that share a Redis store.
"""

from __future__ import annotations

import abc
import contextlib
import os
import secrets
from dataclasses import dataclass

from lmcache_mp._util.paths import private_tempdir, remove_tree
from lmcache_mp.kv import RedisKVStore

__all__ = ["Claims", "FileClaims", "RedisClaims"]


class Claims(abc.ABC):
    """The claims of one phase on its job numbers."""

    @abc.abstractmethod
    def begin(self, no: int, owner: str) -> str | None:
        """Claim job ``no`` for ``owner``.

        Returns:
            ``None`` when claimed, else the owner that already holds it.
        """

    @abc.abstractmethod
    def end(self, no: int) -> None:
        """Release job ``no``'s claim."""

    @abc.abstractmethod
    def owners(self) -> dict[int, str]:
        """Return job number to owner, for every claim still held."""

    @abc.abstractmethod
    def clear(self) -> None:
        """Release every claim (before jobs are run again)."""

    @abc.abstractmethod
    def remove(self) -> None:
        """Remove the claims' storage; safe to call twice."""


@dataclass(frozen=True)
class FileClaims(Claims):
    """Claims as files in a private directory of this machine.

    Args:
        path: The directory; one file per claimed job, holding its owner.
    """

    path: str

    @classmethod
    def create(cls, parent: str | None = None) -> FileClaims:
        """Make a fresh claims directory (in ``parent`` when given)."""
        if parent is None:
            return cls(private_tempdir("lmcache-mp-claims-"))
        path = os.path.join(parent, f"claims-{secrets.token_hex(4)}")
        os.mkdir(path, 0o700)
        return cls(path)

    def begin(self, no: int, owner: str) -> str | None:
        """Claim job ``no`` (an exclusive create); see :meth:`Claims.begin`."""
        name = os.path.join(self.path, str(no))
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
        try:
            fd = os.open(name, flags, 0o600)
        except FileExistsError:
            with open(name, encoding="utf-8", errors="replace") as f:
                return f.read() or "an unknown worker"
        try:
            os.write(fd, owner.encode())
        finally:
            os.close(fd)
        return None

    def end(self, no: int) -> None:
        """Release job ``no``'s claim."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(self.path, str(no)))

    def owners(self) -> dict[int, str]:
        """Return job number to owner for every claim still held."""
        found = {}
        for name in os.listdir(self.path):
            with (
                contextlib.suppress(OSError, ValueError),
                open(os.path.join(self.path, name), encoding="utf-8") as f,
            ):
                found[int(name)] = f.read()
        return found

    def clear(self) -> None:
        """Release every claim."""
        for name in os.listdir(self.path):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self.path, name))

    def remove(self) -> None:
        """Remove the directory; safe to call twice."""
        remove_tree(self.path)


#: Seconds a Redis claim outlives a phase whose parent died before
#: removing it (a phase's own timeout is usually far shorter).
_REDIS_CLAIM_TTL_S = 24 * 3600


@dataclass(frozen=True)
class RedisClaims(Claims):
    """Claims as one Redis hash, inside a store's key namespace.

    Args:
        store: The phase's :class:`~lmcache_mp.kv.RedisKVStore`; it pickles
            by URL, so every worker reaches the same server.
        key: The hash's key, under the store's prefix.
    """

    store: RedisKVStore
    key: str

    @classmethod
    def create(cls, store: RedisKVStore) -> RedisClaims:
        """Make the claims of a phase in ``store``'s namespace."""
        return cls(store, store.claims_key(secrets.token_hex(8)))

    def begin(self, no: int, owner: str) -> str | None:
        """Claim job ``no`` (HSETNX); see :meth:`Claims.begin`."""
        client = self.store.client()
        pipe = client.pipeline(transaction=True)
        pipe.hsetnx(self.key, str(no), owner)
        pipe.expire(self.key, _REDIS_CLAIM_TTL_S)
        pipe.hget(self.key, str(no))
        taken, _, holder = pipe.execute()
        if taken:
            return None
        return bytes(holder or b"an unknown worker").decode("utf-8", "replace")

    def end(self, no: int) -> None:
        """Release job ``no``'s claim."""
        self.store.client().hdel(self.key, str(no))

    def owners(self) -> dict[int, str]:
        """Return job number to owner for every claim still held."""
        raw: dict[bytes, bytes] = self.store.client().hgetall(self.key)  # type: ignore[assignment]
        return {int(k): v.decode("utf-8", "replace") for k, v in raw.items()}

    def clear(self) -> None:
        """Release every claim."""
        self.store.client().delete(self.key)

    def remove(self) -> None:
        """Delete the hash; safe to call twice."""
        with contextlib.suppress(Exception):
            self.clear()
