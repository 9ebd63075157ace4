"""A same-token edit written aside, committed with the stream's new state."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from lmcache_mp.errors import KVStoreError

__all__ = ["StagedChunks"]


class _Stager(Protocol):
    """What a store that stages offers its staged chunks (both backends)."""

    def _publish(self, moves: Sequence[tuple[str, str]], keep: bool) -> None:
        """Move staged chunks onto their chunks (``keep``) or drop them."""


@dataclass
class StagedChunks:
    """Chunks written aside by a store's ``stage`` (shared-memory or Redis).

    Pickles by the store's location, so a worker can stage and the parent
    commit. :meth:`commit` and :meth:`discard` are each safe to call twice;
    a discard after a commit does nothing, a commit after a discard raises.

    Args:
        store: The store the chunks belong to.
        moves: ``(staged, chunk)`` names: temp and chunk files in the
            shared-memory store's directory, or staged and chunk keys in
            the Redis store.
    """

    store: _Stager
    moves: tuple[tuple[str, str], ...]
    #: ``"committed"`` or ``"discarded"`` once settled by this handle.
    _settled: str = field(default="", init=False, compare=False, repr=False)

    def commit(self) -> None:
        """Replace the cached chunks with the staged ones.

        The shared-memory store renames each file atomically; the Redis
        store moves them all in one transaction, so a reader sees the old
        stream or the new one, never a mix.

        Raises:
            KVStoreError: If the store is closed or gone, or a staged chunk
                is gone before the commit (Redis: expired or evicted); the
                cached chunks are then left as they were; or if this handle
                has discarded them.
        """
        if self._settled == "discarded":
            raise KVStoreError("these staged chunks were discarded")
        if not self._settled:
            self._settled = "committed"
            self.store._publish(self.moves, keep=True)

    def discard(self) -> None:
        """Remove the staged chunks; the cached chunks stay as they were.

        Raises:
            KVStoreError: If the store is closed or gone.
        """
        if not self._settled:
            self._settled = "discarded"
            self.store._publish(self.moves, keep=False)
