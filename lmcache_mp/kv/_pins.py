"""Pins: the KV an open batch's streams depend on, which no store evicts.

A batch is a :class:`PinOwner`: its id, the pid and start time of the
process that holds it, and a lease. For each member stream it records in
every store the stream uses which chunks the stream's tokens map to
(``store.pin``); eviction skips them. While a stream runs a phase (in any
process or thread), the store writes it makes under :func:`pinning` add
what they write to its pins first, so KV stored mid-phase is safe before
the batch commits the stream's new tokens. Closing the batch releases its
pins; a batch whose process died releases them too: the shared-memory
store drops pins whose process is gone, the Redis store's pins are keys
that expire with the lease.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

from lmcache_mp._util.proc import process_started

__all__ = [
    "DEFAULT_LEASE_S",
    "PinOwner",
    "PinScope",
    "current_scope",
    "pinning",
]


#: Seconds a Redis pin lives unless its batch renews it.
DEFAULT_LEASE_S = 600.0


@dataclass(frozen=True)
class PinOwner:
    """The batch that holds pins, and how to tell that it is gone.

    Args:
        batch: The batch's unique id.
        pid: The pid of the process that holds the batch.
        started: That process's start time (:func:`process_started`; a
            reused pid has another).
        lease_s: Seconds a pin lives on a store that expires them (Redis)
            unless renewed.
    """

    batch: str
    pid: int
    started: int
    lease_s: float = DEFAULT_LEASE_S

    @classmethod
    def new(cls, lease_s: float = DEFAULT_LEASE_S) -> PinOwner:
        """An owner for a new batch held by the calling process."""
        pid = os.getpid()
        return cls(uuid.uuid4().hex, pid, process_started(pid) or 0, lease_s)

    def tag(self, stream_id: str | None = None) -> str:
        """A name part for this owner's pins (of one stream, if given):
        ``<pid>-<started>-<batch>[-<stream digest>]``, file-name safe."""
        tag = f"{self.pid}-{self.started}-{self.batch}"
        if stream_id is None:
            return tag
        digest = hashlib.blake2b(stream_id.encode(), digest_size=8).hexdigest()
        return f"{tag}-{digest}"


@dataclass(frozen=True)
class PinScope:
    """The stream on whose behalf the current thread uses a store, and the
    batch that pins its KV (``None``: a stream outside a batch)."""

    owner: PinOwner | None
    stream_id: str


_SCOPE: contextvars.ContextVar[PinScope | None] = contextvars.ContextVar(
    "lmcache_mp_pin_scope", default=None
)


@contextlib.contextmanager
def pinning(owner: PinOwner | None, stream_id: str) -> Iterator[None]:
    """Within the block, store writes of this thread pin what they write to
    ``stream_id`` of ``owner`` (nothing when ``owner`` is ``None``), and a
    store that cannot fit them names the stream."""
    token = _SCOPE.set(PinScope(owner, stream_id))
    try:
        yield
    finally:
        _SCOPE.reset(token)


def current_scope() -> PinScope | None:
    """The scope :func:`pinning` set for this thread, if any."""
    return _SCOPE.get()
