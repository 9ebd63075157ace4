"""The shared-memory store's pins as a batch sees them (issue #20): pin a
stream's chunks, release them, ask whether a chunk was evicted."""

from __future__ import annotations

import abc

from lmcache_mp.errors import KVStoreError
from lmcache_mp.kv._files import CHUNK_SUFFIX, is_evicted, remove_pins, write_pin
from lmcache_mp.kv._keys import Tokens, chunk_keys, token_array
from lmcache_mp.kv._pins import PinOwner

__all__ = ["FilePins"]


class FilePins(abc.ABC):
    """Pins and eviction marks of a store directory (a store's methods)."""

    _chunk_size: int
    _url: str

    @abc.abstractmethod
    def _dir_fd(self, create: bool = False) -> int:
        """The open store directory."""

    def _names(self, tokens: Tokens, cache_salt: str) -> list[str]:
        """The chunk file names of every full chunk of ``tokens``."""
        keys = chunk_keys(token_array(tokens), self._chunk_size, cache_salt)
        return [key.hex() + CHUNK_SUFFIX for key in keys]

    def pin(
        self, owner: PinOwner, stream_id: str, tokens: Tokens, cache_salt: str = ""
    ) -> None:
        """Pin the chunks of ``tokens`` for one stream of a batch, replacing
        what was pinned for it; eviction never removes pinned chunks.

        A batch calls this for its member streams (issue #20); the pin lasts
        until :meth:`unpin`, or until the process holding the batch is gone.

        Args:
            owner: The batch.
            stream_id: The stream.
            tokens: Its tokens (chunks not stored yet are pinned for when
                they are).
            cache_salt: Its salt.

        Raises:
            KVStoreError: If the store is closed or the pin cannot be written.
        """
        fd = self._dir_fd()
        try:
            write_pin(fd, owner, stream_id, self._names(tokens, cache_salt), False)
        except OSError as exc:
            raise KVStoreError(f"{self._url}: cannot pin KV: {exc}") from exc

    def unpin(self, owner: PinOwner, stream_id: str | None = None) -> None:
        """Release the pins of one stream of a batch, or all of the batch's.

        Raises:
            KVStoreError: If the store is closed.
        """
        remove_pins(self._dir_fd(), owner, stream_id)

    def was_evicted(self, tokens: Tokens, cache_salt: str = "", start: int = 0) -> bool:
        """Whether the chunk of ``tokens`` that begins at token ``start`` was
        evicted and not stored since: the KV was there and will not come
        back by waiting (issue #20).

        Args:
            tokens: The token ids.
            cache_salt: Isolation salt.
            start: A multiple of ``chunk_size``.

        Raises:
            KVStoreError: If the store is closed.
        """
        names = self._names(tokens, cache_salt)
        index = start // self._chunk_size
        return index < len(names) and is_evicted(self._dir_fd(), names[index])
