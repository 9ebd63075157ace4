"""A same-token edit written aside, committed with the stream's new state."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lmcache_mp.kv._shm import SharedMemoryKVStore

__all__ = ["StagedChunks"]


@dataclass(frozen=True)
class StagedChunks:
    """Chunks written aside by :meth:`SharedMemoryKVStore.stage`.

    Pickles by the store's location, so a worker can stage and the parent
    commit. :meth:`commit` and :meth:`discard` are each safe to call twice.

    Args:
        store: The store the chunks belong to.
        moves: ``(temp file, chunk file)`` names in the store's directory.
    """

    store: SharedMemoryKVStore
    moves: tuple[tuple[str, str], ...]

    def commit(self) -> None:
        """Replace the cached chunks with the staged ones (each atomically).

        Raises:
            KVStoreError: If the store is closed or gone.
        """
        self.store._publish(self.moves, keep=True)

    def discard(self) -> None:
        """Remove the staged files; the cached chunks stay as they were.

        Raises:
            KVStoreError: If the store is closed or gone.
        """
        self.store._publish(self.moves, keep=False)
