"""The peers ``lmcache-mp bench --compare`` runs the same modify on.

Each peer edits every stream's cached KV the way a user of that library
would, over the same embedded store:

* ``loky``: joblib's reusable process executor; the parent retrieves each
  KV, the worker gets it pickled, edits it and sends the result back
  pickled; the parent stores it.
* ``ray``: Ray tasks on a local runtime; the KV goes in with ``ray.put``
  and comes back through Ray's object store.
* ``upstream``: LMCache's own ``LMCacheBatchedStream`` (``lmcache==0.5.6``,
  one thread per stream), its streams reading and writing the store
  through a torch adapter with the ``kind`` its contexts have.

A peer is a :class:`Peer`: ``start`` once (not timed, as a pool start),
``modify`` per repeat (timed), ``close``. Each needs its package; a missing
one is a :class:`PeerUnavailable` naming what to install.
"""

from __future__ import annotations

import abc
import importlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from lmcache_mp.edits import Edit
from lmcache_mp.kv import SharedMemoryKVStore
from lmcache_mp.stream import TokenEvent

__all__ = ["PEERS", "Peer", "PeerUnavailable", "make_peer", "no_engine"]

#: Peer names, as ``--compare`` spells them.
PEERS = ("loky", "ray", "upstream")

#: One stream: its tokens and salt in the store.
Item = tuple[list[int], str]


class PeerUnavailable(RuntimeError):
    """Raised when a peer's package is not installed (the message says which)."""


def _import(module: str, peer: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise PeerUnavailable(
            f"--compare {peer} needs {module!r}: pip install 'lmcache-mp[compare]' "
            f"({type(exc).__name__}: {exc})"
        ) from exc


def _apply(
    edit: Edit, kv: np.ndarray, tokens: list[int]
) -> tuple[np.ndarray, list[int]]:
    new_kv, new_tokens = edit(kv, tokens)[:2]
    return np.ascontiguousarray(new_kv), list(new_tokens)


def _store_result(
    store: SharedMemoryKVStore,
    tokens: list[int],
    salt: str,
    new_kv: Any,
    new_tokens: list[int],
) -> None:
    # As lmcache_mp does: a same-token edit replaces the cached chunks.
    store.store(new_kv, new_tokens, salt, overwrite=new_tokens == tokens)


class Peer(abc.ABC):
    """A peer library running a modify phase.

    Args:
        name: One of :data:`PEERS`.
        workers: Worker processes (loky, Ray) or ignored (upstream: one
            thread per stream).
    """

    def __init__(self, name: str, workers: int) -> None:
        self.name = name
        self.workers = workers

    @abc.abstractmethod
    def start(self) -> None:
        """Start the peer's runtime and warm it up (not timed)."""

    def prepare(  # noqa: B027 - an optional hook, not an abstract step
        self, store: SharedMemoryKVStore, items: Sequence[Item]
    ) -> None:
        """Point the runner at a repeat's fresh store (not timed); peers
        need nothing."""

    @abc.abstractmethod
    def modify(
        self, store: SharedMemoryKVStore, items: Sequence[Item], edit: Edit
    ) -> list[list[int]]:
        """Edit every stream's KV in ``store``; return each one's new tokens."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop what :meth:`start` started."""

    @property
    def label(self) -> str:
        """The runner's name in the table."""
        return self.name

    def figures(self) -> dict[str, Any]:
        """What the table shows besides the wall time, after the repeats.

        Returns:
            ``workers``; ``pickled_bytes`` per phase (``None``: each KV is
            pickled in and out, as loky and Ray do); ``stream_p50_ms``, the
            retrieve/fn/store split where the runner reports one.
        """
        return {"workers": self.workers, "pickled_bytes": None, "stream_p50_ms": None}


class _Loky(Peer):
    def start(self) -> None:
        loky = _import("loky", "loky")
        self._executor = loky.get_reusable_executor(max_workers=self.workers)
        list(self._executor.map(abs, range(self.workers * 2)))

    def modify(
        self, store: SharedMemoryKVStore, items: Sequence[Item], edit: Edit
    ) -> list[list[int]]:
        futures = [
            self._executor.submit(_apply, edit, store.retrieve(toks, salt), toks)
            for toks, salt in items
        ]
        out = []
        for (toks, salt), future in zip(items, futures, strict=True):
            new_kv, new_tokens = future.result()
            _store_result(store, toks, salt, new_kv, new_tokens)
            out.append(new_tokens)
        return out

    def close(self) -> None:
        self._executor.shutdown(wait=True, kill_workers=True)


class _Ray(Peer):
    def start(self) -> None:
        self._ray = ray = _import("ray", "ray")
        ray.init(
            num_cpus=self.workers,
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
        )
        self._task = ray.remote(_apply)
        warm = [
            self._task.remote(_NoEdit(), np.zeros((2, 1, 1, 1)), [0])
            for _ in range(self.workers)
        ]
        ray.get(warm)

    def modify(
        self, store: SharedMemoryKVStore, items: Sequence[Item], edit: Edit
    ) -> list[list[int]]:
        ray = self._ray
        edit_ref = ray.put(edit)
        refs = [
            self._task.remote(edit_ref, ray.put(store.retrieve(toks, salt)), toks)
            for toks, salt in items
        ]
        out = []
        for (toks, salt), ref in zip(items, refs, strict=True):
            new_kv, new_tokens = ray.get(ref)
            _store_result(store, toks, salt, new_kv, new_tokens)
            out.append(new_tokens)
        return out

    def close(self) -> None:
        self._ray.shutdown()


class _NoEdit:
    """What Ray's warm-up task runs."""

    def __call__(self, kv: Any, tokens: list[int]) -> tuple[Any, list[int]]:
        return kv, tokens


class _TorchContext:
    """Upstream's context interface over the embedded store, in torch."""

    def __init__(self, store: SharedMemoryKVStore, kind: Any, torch: Any) -> None:
        self.kind = kind
        self.chunk_size = store.chunk_size
        self._store = store
        self._torch = torch

    def retrieve(self, tokens: Sequence[int], cache_salt: str = "") -> Any:
        kv = self._store.retrieve(list(tokens), cache_salt)
        return None if kv is None else self._torch.from_numpy(kv)

    def store(self, kv: Any, tokens: Sequence[int], cache_salt: str = "") -> bool:
        arr = kv.numpy() if hasattr(kv, "numpy") else np.asarray(kv)
        return self._store.store(arr, list(tokens), cache_salt)


class _Upstream(Peer):
    def start(self) -> None:
        self._torch = _import("torch", "upstream")
        self._batch_mod = _import("lmcache.sdk.batch", "upstream")
        self._request = _import("lmcache.sdk.request", "upstream")
        self._kind = _import("lmcache.sdk.cache_kind", "upstream").LMCacheSDKCacheKind

    def modify(
        self, store: SharedMemoryKVStore, items: Sequence[Item], edit: Edit
    ) -> list[list[int]]:
        ctx = _TorchContext(store, self._kind.KV, self._torch)
        batch = self._batch_mod.LMCacheBatchedStream()
        streams = []
        for toks, salt in items:
            stream = self._request.LMCacheRequestStream([ctx], no_engine, toks, salt)
            batch.add(stream)
            streams.append(stream)
        batch.modify_request_streams(_upstream_fn(edit, self._kind.KV, self._torch))
        self._streams = len(streams)
        return [list(s.tokens) for s in streams]

    def close(self) -> None:
        """Upstream starts threads per phase only: nothing to stop."""

    def figures(self) -> dict[str, Any]:
        """One thread per stream, nothing pickled."""
        return {**super().figures(), "workers": self._streams, "pickled_bytes": 0}


def _upstream_fn(edit: Edit, kind: Any, torch: Any) -> Callable[..., Any]:
    def fn(tensors: Any, tokens: Sequence[int]) -> tuple[Any, list[int]]:
        new_kv, new_tokens = _apply(edit, tensors[kind].numpy(), list(tokens))
        return torch.from_numpy(new_kv), new_tokens

    return fn


def no_engine(
    prompt_token_ids: list[int], sampling_params: dict[str, Any], cache_salt: str
) -> Iterable[TokenEvent]:
    """The ``post_completion`` of the compare bench's streams: it runs no
    engine, and a stream that calls it fails saying so."""
    raise RuntimeError("the compare bench runs no engine")


def make_peer(name: str, workers: int) -> Peer:
    """Build a peer by name.

    Args:
        name: One of :data:`PEERS`.
        workers: Its worker processes.

    Returns:
        The peer, not started.

    Raises:
        ValueError: For an unknown name.
    """
    classes: dict[str, type[Peer]] = {"loky": _Loky, "ray": _Ray, "upstream": _Upstream}
    if name not in classes:
        raise ValueError(f"unknown peer {name!r}; choose from {', '.join(PEERS)}")
    return classes[name](name, workers)
