"""What both store backends share beyond the chunk format: the handle's
base class and the staged chunks it returns, the checks of a KV and its
layout, and the warnings and errors a store gives.

Kept in one place so that the shared-memory and Redis stores refuse the
same inputs with the same messages."""

from __future__ import annotations

import abc
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Protocol, TypeVar

import numpy as np
import numpy.typing as npt

from lmcache_mp._util.arrays import as_numpy
from lmcache_mp.cache_kind import LMCacheSDKCacheKind
from lmcache_mp.errors import (
    CorruptChunkWarning,
    KVCapacityError,
    KVConfigError,
    KVStoreError,
)
from lmcache_mp.kv._buffers import contiguous, empty_kv, scratch
from lmcache_mp.kv._chunk import CorruptChunk, chunk_views
from lmcache_mp.kv._keys import Tokens, check_start, token_array
from lmcache_mp.kv._layout import Layout, resolve_dtype
from lmcache_mp.kv._pins import PinScope

__all__ = [
    "StagedChunks",
    "StoreHandle",
    "as_bytes",
    "capacity_error",
    "check_positive",
    "chunk_payloads",
    "join_payloads",
    "kv_layout",
    "require_layout",
    "warn_corrupt",
]


_Handle = TypeVar("_Handle", bound="StoreHandle")


class StoreHandle(abc.ABC):
    """What a store handle of either backend is, besides its operations: a
    context of one kind and chunk size, closed when its ``with`` ends.

    Args:
        kind: The tensor family it caches.
        chunk_size: Tokens per chunk.

    Raises:
        KVConfigError: If ``chunk_size`` is not a positive int.
    """

    def __init__(self, kind: LMCacheSDKCacheKind, chunk_size: int) -> None:
        check_positive("chunk_size", chunk_size)
        self._kind = kind
        self._chunk_size = chunk_size

    @property
    def kind(self) -> LMCacheSDKCacheKind:
        """The tensor family this context caches (upstream's ``ctx.kind``)."""
        return self._kind

    @property
    def chunk_size(self) -> int:
        """Tokens per chunk; retrieved prefixes are multiples of it."""
        return self._chunk_size

    @abc.abstractmethod
    def close(self) -> None:
        """Release the handle (each backend says what that keeps)."""

    def __enter__(self: _Handle) -> _Handle:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def check_positive(label: str, value: object) -> None:
    """Refuse a store parameter (chunk size, capacity) that is not an int >= 1.

    Args:
        label: The parameter's name, for the message.
        value: Its value.

    Raises:
        KVConfigError: Naming ``label`` and the value.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise KVConfigError(f"{label} must be a positive int, got {value!r}")


def kv_layout(
    kv: Any, tokens: Tokens, kind: LMCacheSDKCacheKind, chunk_size: int, start: int
) -> tuple[npt.NDArray[Any], npt.NDArray[np.int64], Layout]:
    """Check a tensor given to ``store``/``stage`` and return its layout.

    Args:
        kv: ``[planes, L, len(tokens) - start, D]``: anything ``as_numpy``
            accepts.
        tokens: The token ids of the prefix it ends.
        kind: The store's kind (fixes ``planes``).
        chunk_size: The store's chunk size.
        start: The first token ``kv`` holds (see :func:`check_start`).

    Returns:
        ``(array, token ids, layout)``.

    Raises:
        KVConfigError: If ``start`` is not a chunk boundary within
            ``tokens``, the shape is not ``[planes, L, len(tokens) - start,
            D]`` or the dtype is not float32/float16/bfloat16.
        TypeError: If ``kv`` is not an array or ``tokens`` not ints.
        ValueError: If a token id is negative.
    """
    arr = as_numpy(kv)
    toks = token_array(tokens)
    check_start(start, len(toks), chunk_size)
    planes = kind.planes
    held = len(toks) - start
    if arr.ndim != 4 or arr.shape[0] != planes or arr.shape[2] != held:
        which = f"tokens[{start}:]" if start else "the tokens"
        raise KVConfigError(
            f"{kind.name} has shape {arr.shape}, expected 4-D "
            f"[{planes}, layers, tokens, width] with {held} tokens on axis 2 "
            f"({which})"
        )
    layout = Layout(arr.shape[1], arr.shape[3], resolve_dtype(arr.dtype), planes)
    return arr, toks, layout


def as_bytes(arr: npt.NDArray[Any], layout: Layout) -> npt.NDArray[np.uint8]:
    """``arr`` in the store's dtype and C order, viewed as bytes.

    Args:
        arr: A KV checked by :func:`kv_layout`.
        layout: The store's layout (its dtype).

    Returns:
        ``arr`` itself viewed as bytes when it is already so, else a copy
        (in huge pages when large: see :mod:`~lmcache_mp.kv._buffers`);
        what :func:`~lmcache_mp.kv._chunk.chunk_views` slices.
    """
    return contiguous(arr, layout.dtype).view(np.uint8)


def chunk_payloads(
    arr: npt.NDArray[Any], layout: Layout, chunk_size: int, indices: Sequence[int]
) -> Iterator[tuple[int, Iterable[memoryview]]]:
    """The payload of each chunk ``indices`` of a KV, in file order.

    A C-contiguous KV of the store's dtype is sliced in place. Any other
    (an edit's strided view, such as keeping every other token, or another
    dtype) is copied one piece (a plane's layer of a chunk) at a time into
    the thread's scratch buffer rather than whole: the same bytes copied,
    but into pages already touched instead of a new copy of the KV (new
    memory, faulted in far slower than a copy; see docs/design.md), and
    small enough that the piece is still in cache when it is
    summed and written. Each piece is valid until the next is asked for.

    Args:
        arr: A KV checked by :func:`kv_layout`.
        layout: The store's layout.
        chunk_size: The store's chunk size.
        indices: The chunks wanted, by index along the tokens.

    Yields:
        ``(index, pieces)``: the pieces as
        :func:`~lmcache_mp.kv._chunk.chunk_views` returns them, or an
        iterator that stages them one at a time.
    """
    direct = arr.dtype == layout.dtype and arr.flags.c_contiguous
    raw = arr.view(np.uint8) if direct else None
    for index in indices:
        start, stop = index * chunk_size, (index + 1) * chunk_size
        if raw is not None:
            yield index, chunk_views(raw, start, stop)
        else:
            yield index, _staged_pieces(arr[:, :, start:stop], layout.dtype)


def _staged_pieces(
    part: npt.NDArray[Any], dtype: np.dtype[Any]
) -> Iterator[memoryview]:
    """Each ``[tokens, width]`` piece of ``part``, in file order, copied as
    ``dtype`` into the thread's scratch buffer (reused for the next)."""
    shape = part.shape[2:]
    buf = scratch(int(np.prod(shape)) * dtype.itemsize)
    staged = buf.view(dtype).reshape(shape)
    for plane in part:
        for layer in plane:
            np.copyto(staged, layer, casting="unsafe")
            yield buf.data


def join_payloads(
    payloads: list[memoryview], layout: Layout, chunk_size: int
) -> npt.NDArray[Any]:
    """Copy consecutive chunk payloads into one new ``[P, L, T, D]`` array.

    Args:
        payloads: Each chunk's payload bytes (``[P, L, chunk_size, D]``).
        layout: The store's layout.
        chunk_size: The store's chunk size.

    Returns:
        A C-contiguous array of ``len(payloads) * chunk_size`` tokens.
    """
    shape = (layout.planes, layout.layers, chunk_size, layout.width)
    tokens = len(payloads) * chunk_size
    out = empty_kv((*shape[:2], tokens, layout.width), layout.dtype)
    for index, payload in enumerate(payloads):
        chunk = np.frombuffer(payload, layout.dtype).reshape(shape)
        out[:, :, index * chunk_size : (index + 1) * chunk_size] = chunk
    return out


def require_layout(fixed: Layout, wanted: Layout, url: str) -> Layout:
    """Return ``fixed`` if ``wanted`` is the same layout.

    Args:
        fixed: The store's layout.
        wanted: The layout of a KV given to it.
        url: The store's URL, for the message.

    Returns:
        ``fixed``.

    Raises:
        KVConfigError: Naming both layouts and the store, if they differ.
    """
    if fixed != wanted:
        raise KVConfigError(
            f"KV layout {wanted.describe()} does not match the layout "
            f"{fixed.describe()} of store {url}"
        )
    return fixed


def warn_corrupt(where: str, exc: CorruptChunk, stacklevel: int = 3) -> None:
    """Warn that the chunk at ``where`` failed a check.

    Args:
        where: The chunk's file or key.
        exc: What failed.
        stacklevel: As ``warnings.warn``, counted from here: the default
            points at the caller of the public method that called this.
    """
    warnings.warn(
        f"{where}: corrupt chunk ({exc}); treated as a miss and removed",
        CorruptChunkWarning,
        stacklevel=stacklevel,
    )


def capacity_error(
    where: str,
    scope: PinScope | None,
    asked: int,
    pinned: int,
    used: int,
    capacity: int,
    how: str,
) -> KVCapacityError:
    """The error of a store call whose new chunks do not fit.

    Args:
        where: The store's URL.
        scope: The stream the call was made for, if known.
        asked: Bytes the call needed.
        pinned: Bytes pinned by open batches (negative: unknown).
        used: Bytes the store holds.
        capacity: The store's capacity.
        how: How to raise the capacity, in words.

    Returns:
        The :class:`KVCapacityError` to raise; nothing was stored.
    """
    sid = None if scope is None else scope.stream_id
    who = "" if sid is None else f"stream {sid}: "
    pinned_text = "unknown" if pinned < 0 else str(pinned)
    return KVCapacityError(
        f"{who}storing {asked} bytes of KV in store {where} does not fit: its "
        f"capacity is {capacity} bytes, {used} are in use, {pinned_text} of them "
        "pinned by the streams of open batches (never evicted); nothing was "
        f"stored. {how}, or close batches whose KV is no longer needed",
        sid,
        asked,
        max(pinned, 0),
        capacity,
    )


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
