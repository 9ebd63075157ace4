"""The Redis store's command sequences: writes, staging, commit, scans.

Each function takes a client and runs one or a few round trips; callers
turn Redis errors into the store's own (``_redis_conn.redis_errors``).
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

from lmcache_mp.kv._chunk import (
    DIGEST_BYTES,
    HEADER_SIZE,
    CorruptChunk,
    decode_chunk,
)
from lmcache_mp.kv._common import require_layout
from lmcache_mp.kv._layout import Layout, parse_layout
from lmcache_mp.kv._redis_conn import redis_module

if TYPE_CHECKING:
    import redis

__all__ = [
    "STAGE_TTL_S",
    "KnownLayout",
    "chunk_bytes",
    "delete_matching",
    "drop_if_same",
    "fetch",
    "holds_staged",
    "move_all",
    "plan_writes",
    "probe",
    "publish",
    "set_values",
    "stage_values",
    "valid_prefix",
]

#: Seconds a staged chunk lives uncommitted: a dead worker's staging vanishes.
STAGE_TTL_S = 600
# A commit retries this often when a staged key changes under its WATCH.
_COMMIT_TRIES = 16
# Keys a SCAN step returns and an UNLINK removes at a time.
_BATCH = 1000
_DIGEST = slice(HEADER_SIZE - DIGEST_BYTES, HEADER_SIZE)


class KnownLayout:
    """A namespace's layout as last read from the server.

    Re-read on every retrieve and store (it rides along in the same round
    trip), so that a handle follows a layout value that was evicted and
    fixed again.

    Args:
        where: The layout key's place, for messages.
    """

    def __init__(self, where: str) -> None:
        self.where = where
        self.layout: Layout | None = None
        self._raw: bytes | None = None

    def adopt(self, raw: bytes | None) -> Layout | None:
        """Take the layout value read (``None``: keep the one known).

        Args:
            raw: The layout key's value, as the server returned it.

        Returns:
            The layout now known, or ``None`` if none ever was.

        Raises:
            KVStoreError: If the value is not a layout document.
        """
        if raw is not None and raw != self._raw:
            self.layout, self._raw = parse_layout(raw, self.where), raw
        return self.layout

    def agree(self, raw: bytes | None, wanted: Layout, url: str) -> Layout:
        """Adopt ``raw`` and return it, if it is ``wanted``.

        Args:
            raw: The layout key's value after a SET NX of ``wanted``.
            wanted: The layout of the KV being written.
            url: The store's URL (password masked), for the message.

        Returns:
            The store's layout (``wanted`` if the value was just lost).

        Raises:
            KVConfigError: If the fixed layout differs from ``wanted``.
            KVStoreError: If the value is not a layout document.
        """
        return require_layout(self.adopt(raw) or wanted, wanted, url)


def valid_prefix(
    keys: Sequence[bytes],
    values: Sequence[bytes | None],
    layout: Layout,
    chunk_size: int,
) -> tuple[list[memoryview], tuple[bytes, CorruptChunk] | None]:
    """The payloads of the leading chunks that are there and valid.

    Args:
        keys: The chunk keys, in order.
        values: What the server holds at each (``None``: nothing).
        layout: The store's layout.
        chunk_size: The store's chunk size.

    Returns:
        ``(payloads, bad)``: the valid prefix, and the value after it with
        why it failed, when that one is there but corrupt.
    """
    payloads = []
    for key, value in zip(keys, values, strict=True):
        if value is None:
            break
        try:
            payloads.append(decode_chunk(value, key, layout, chunk_size))
        except CorruptChunk as exc:
            return payloads, (value, exc)
    return payloads, None


def plan_writes(
    types: Sequence[bytes], rewrite: bool
) -> tuple[list[int], set[int], list[int]]:
    """Which chunks a write sets, from the TYPE of each chunk key.

    Args:
        types: What :func:`probe` found at each chunk's key.
        rewrite: Set every chunk (an overwrite or a staging), not only the
            missing ones.

    Returns:
        ``(to set, missing, planted)`` chunk indices: planted keys hold a
        value that is not a string, never a chunk, and are replaced.
    """
    missing = {i for i, kind in enumerate(types) if kind == b"none"}
    planted = [i for i, kind in enumerate(types) if kind not in (b"none", b"string")]
    todo = [i for i in range(len(types)) if rewrite or i in missing]
    return sorted({*todo, *planted}), missing, planted


def fetch(conn: redis.Redis, keys: Sequence[str]) -> list[bytes | None]:
    """GET every key in one round trip (MGET, which refreshes their recency).

    Args:
        conn: The client.
        keys: The keys.

    Returns:
        Each key's value, ``None`` where it is missing or not a string.

    Raises:
        redis.RedisError: If the server fails.
    """
    # The client returns bytes (decode_responses is off).
    return cast("list[bytes | None]", conn.mget(keys))


def probe(
    conn: redis.Redis, layout_key: str, layout_doc: bytes, keys: Sequence[str]
) -> tuple[bytes | None, list[bytes]]:
    """Before a write, in one round trip: fix the layout unless one is
    (SET NX) and read the one fixed; TYPE and TOUCH every chunk key.

    Args:
        conn: The client.
        layout_key: The namespace's layout key.
        layout_doc: The layout of the KV being written (``encode_layout``).
        keys: The chunk keys.

    Returns:
        ``(layout value, type of each key)``: ``b"none"`` for a missing key,
        ``b"string"`` for a chunk (now touched for LRU), else a value that
        is not a chunk.

    Raises:
        redis.RedisError: If the server fails.
    """
    pipe = conn.pipeline(transaction=False)
    pipe.set(layout_key, layout_doc, nx=True)
    pipe.get(layout_key)
    for key in keys:
        pipe.type(key)
        pipe.touch(key)
    found = pipe.execute()
    return found[1], found[2::2]


def set_values(
    conn: redis.Redis, items: Sequence[tuple[str, bytes, bool]]
) -> tuple[int, int]:
    """SET each ``(key, value, only_if_missing)`` in one round trip.

    A value the server refuses for lack of memory is skipped; a key it
    could not replace is deleted, so that no prefix mixes old and new
    chunks.

    Args:
        conn: The client.
        items: ``(key, value, nx)``: with ``nx``, only if the key is missing.

    Returns:
        ``(written, refused)``: values set, and values refused for memory.

    Raises:
        redis.RedisError: For any other failure.
    """
    mod = redis_module()
    pipe = conn.pipeline(transaction=False)
    for key, value, nx in items:
        pipe.set(key, value, nx=nx)
    results = pipe.execute(raise_on_error=False)
    oom = mod.exceptions.OutOfMemoryError
    refused = [
        (key, nx)
        for (key, _, nx), result in zip(items, results, strict=True)
        if isinstance(result, oom)
    ]
    stale = [key for key, nx in refused if not nx]
    if stale:
        conn.delete(*stale)
    for result in results:
        if isinstance(result, Exception) and not isinstance(result, oom):
            raise result
    return sum(r is True for r in results), len(refused)


def stage_values(
    conn: redis.Redis, tmp_key: str, items: Sequence[tuple[str, bytes]]
) -> list[tuple[str, str]]:
    """Write each ``(chunk key, value)`` under a staged key that expires.

    A staged key is ``{tmp_key}:{digest}-{random}``: the chunk header's
    digest in it lets a second commit see that its chunks are in place.
    All or nothing: on any failure the staged keys written are deleted.

    Args:
        conn: The client.
        tmp_key: The namespace's staging prefix (``{prefix}:{kind}:tmp``).
        items: ``(chunk key, chunk value)`` pairs.

    Returns:
        The ``(staged key, chunk key)`` moves for :func:`move_all`.

    Raises:
        redis.RedisError: If a value cannot be written (out of memory too).
    """
    moves = [
        (f"{tmp_key}:{value[_DIGEST].hex()}-{secrets.token_hex(8)}", key)
        for key, value in items
    ]
    pipe = conn.pipeline(transaction=False)
    for (tmp, _), (_, value) in zip(moves, items, strict=True):
        pipe.set(tmp, value, ex=STAGE_TTL_S)
    results = pipe.execute(raise_on_error=False)
    for result in results:
        if isinstance(result, Exception):
            conn.delete(*(tmp for tmp, _ in moves))
            raise result
    return moves


def move_all(conn: redis.Redis, moves: Sequence[tuple[str, str]]) -> int:
    """RENAME every staged key onto its chunk key (then PERSIST it) in one
    MULTI/EXEC, if every staged key is still there; else move none.

    The staged keys are WATCHed, so one that expires or is evicted between
    the check and EXEC aborts the transaction, which is then retried.

    Args:
        conn: The client.
        moves: ``(staged key, chunk key)`` pairs from :func:`stage_values`.

    Returns:
        How many staged keys were there (all of them: moved).

    Raises:
        redis.RedisError: If the server fails, or the keys keep changing.
    """
    mod = redis_module()
    staged = [tmp for tmp, _ in moves]
    for _ in range(_COMMIT_TRIES):
        with conn.pipeline() as pipe:
            try:
                pipe.watch(*staged)  # type: ignore[no-untyped-call]
                present = int(pipe.exists(*staged))
                if present < len(staged):
                    return present
                pipe.multi()
                for tmp, key in moves:
                    pipe.rename(tmp, key)
                    pipe.persist(key)
                pipe.execute()
                return present
            except mod.WatchError:
                continue
    raise mod.RedisError(f"staged keys changed during {_COMMIT_TRIES} commit tries")


def publish(conn: redis.Redis, moves: Sequence[tuple[str, str]], keep: bool) -> int:
    """Commit staged chunks (``keep``: :func:`move_all`) or delete them.

    A second commit finds the staged keys gone and the chunks holding their
    digests (:func:`holds_staged`): nothing to do. A commit that finds
    staged keys lost (expired, evicted) moves none and deletes the rest.

    Args:
        conn: The client.
        moves: ``(staged key, chunk key)`` pairs from :func:`stage_values`.
        keep: Commit; otherwise discard.

    Returns:
        How many staged keys a commit found lost (0: committed, now or
        before; always 0 for a discard).

    Raises:
        redis.RedisError: If the server fails.
    """
    if not moves:
        return 0
    present = move_all(conn, moves) if keep else 0
    if present == len(moves) or (keep and holds_staged(conn, moves)):
        return 0
    conn.delete(*(tmp for tmp, _ in moves))
    return len(moves) - present if keep else 0


def holds_staged(conn: redis.Redis, moves: Sequence[tuple[str, str]]) -> bool:
    """Whether every chunk key holds the chunk its staged key was for.

    How a second commit tells "already committed" from "staging lost":
    the header digest in each staged key's name is compared with the
    digest the chunk key's value holds.

    Args:
        conn: The client.
        moves: ``(staged key, chunk key)`` pairs from :func:`stage_values`.

    Returns:
        True if every chunk holds its staged value's digest.

    Raises:
        redis.RedisError: If the server fails.
    """
    pipe = conn.pipeline(transaction=False)
    for _, key in moves:
        pipe.getrange(key, _DIGEST.start, _DIGEST.stop - 1)
    found = pipe.execute(raise_on_error=False)
    wanted = [tmp.rsplit(":", 1)[1].partition("-")[0] for tmp, _ in moves]
    return all(
        isinstance(got, bytes) and got.hex() == want
        for got, want in zip(found, wanted, strict=True)
    )


def drop_if_same(conn: redis.Redis, key: str, value: bytes) -> None:
    """Delete ``key`` if it still holds ``value`` (WATCH, GET, MULTI, DEL).

    A writer may have stored a good chunk there since it was read, and
    that one is kept.

    Args:
        conn: The client.
        key: The chunk key.
        value: The corrupt value read from it.

    Raises:
        redis.RedisError: If the server fails.
    """
    mod = redis_module()
    with conn.pipeline() as pipe:
        try:
            pipe.watch(key)  # type: ignore[no-untyped-call]
            if pipe.get(key) == value:
                pipe.multi()
                pipe.delete(key)
                pipe.execute()
        except mod.WatchError:
            pass


def chunk_bytes(
    conn: redis.Redis, pattern: str, only: set[str] | None = None
) -> list[int]:
    """The length of every value whose key matches ``pattern``.

    Args:
        conn: The client.
        pattern: A SCAN MATCH pattern ending in ``*``.
        only: Count only keys whose part after the pattern's ``*`` is one
            of these.

    Returns:
        One length per key found (SCAN, then STRLEN in one round trip).

    Raises:
        redis.RedisError: If the server fails.
    """
    keys = list(conn.scan_iter(match=pattern, count=_BATCH))
    if only is not None:
        cut = len(pattern) - 1
        keys = [k for k in keys if k[cut:].decode() in only]
    if not keys:
        return []
    pipe = conn.pipeline(transaction=False)
    for key in keys:
        pipe.strlen(key)
    return [int(n) for n in pipe.execute()]


def delete_matching(conn: redis.Redis, pattern: str) -> None:
    """Delete every key matching ``pattern``.

    SCAN, then UNLINK in batches, so that neither blocks the server long.

    Args:
        conn: The client.
        pattern: A SCAN MATCH pattern.

    Raises:
        redis.RedisError: If the server fails.
    """
    batch: list[bytes] = []
    for key in conn.scan_iter(match=pattern, count=_BATCH):
        batch.append(key)
        if len(batch) >= _BATCH:
            conn.unlink(*batch)
            batch = []
    if batch:
        conn.unlink(*batch)
