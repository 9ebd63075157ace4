"""A batch's pins on its member streams' KV: taken when a stream
joins and after each phase, released when the batch closes."""

from __future__ import annotations

import contextlib
from typing import Any

from lmcache_mp._core.streambase import StreamBase
from lmcache_mp.executors import PhaseExecutor
from lmcache_mp.kv import PinOwner

__all__ = ["pin_stream", "release", "unpin_stream"]


def pin_stream(stream: StreamBase, owner: PinOwner, stores: dict[int, Any]) -> None:
    """Pin the KV of ``stream``'s tokens in each of its stores that pin,
    replacing its previous pins there.

    The store then never evicts it while the batch is open, and the
    stream's phases pin what they store (its state names ``owner``).

    Args:
        stream: A member stream.
        owner: The batch.
        stores: The stores holding the batch's pins, by ``id``; updated.

    Raises:
        KVStoreError: If a store cannot record the pin.
    """
    stream.state.pin = owner
    for ctx in stream.contexts.values():
        pin = getattr(ctx, "pin", None)
        if pin is not None:
            stores[id(ctx)] = ctx
            pin(owner, stream._stream_id, stream.tokens, stream.cache_salt)


def unpin_stream(stream: StreamBase, owner: PinOwner) -> None:
    """Release the pins ``owner`` holds on ``stream``'s KV in its stores,
    which may then evict it like any chunk no one pins.

    Args:
        stream: A stream leaving the batch.
        owner: The batch.

    Raises:
        KVStoreError: If a store cannot remove the pin.
    """
    stream.state.pin = None
    for ctx in stream.contexts.values():
        unpin = getattr(ctx, "unpin", None)
        if unpin is not None:
            unpin(owner, stream._stream_id)


def release(executor: PhaseExecutor, stores: dict[int, Any], owner: PinOwner) -> None:
    """Close a batch: stop its executor, release its pins in every store.

    Args:
        executor: The batch's executor.
        stores: The stores holding its pins; emptied.
        owner: The batch.
    """
    executor.close()
    for ctx in list(stores.values()):
        with contextlib.suppress(Exception):
            # A store closed or removed before the batch keeps nothing.
            ctx.unpin(owner)
    stores.clear()
