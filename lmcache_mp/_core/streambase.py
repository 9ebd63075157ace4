"""What every stream is, under either upstream API: its state, its phases.

:class:`StreamBase` is the one implementation of a stream; the public
classes add the accessors of an upstream version (``lmcache_mp.stream``:
the seed's methods, ``lmcache_mp.request``: 0.5.6's properties). The
mutable part of a stream lives in :class:`StreamState`, a plain picklable
dataclass, so that a phase can run a stream in a worker process and ship
the new state back.

Every operation is transactional: it computes the new state aside and
commits it only when it succeeded, so a stream whose ``post_completion`` or
modify fn fails keeps exactly its previous state (upstream appended partial
output before re-raising).
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from lmcache_mp._core.kinds import KindTensors
from lmcache_mp._core.records import (
    ModifyFn,
    PostCompletion,
    StreamModifyMetrics,
    StreamPerfMetrics,
    StreamState,
)
from lmcache_mp._core.storing import check_edit, store_edit
from lmcache_mp._core.validate import check_max_tokens, check_tokens
from lmcache_mp._util.arrays import as_type, check_array_type, fn_array
from lmcache_mp.cache_kind import LMCacheSDKCacheKind
from lmcache_mp.errors import (
    CacheKindError,
    KVCapacityError,
    KVConfigError,
    KVEvictedError,
    LMCacheStreamError,
    NoFullChunkError,
    StreamInputError,
)
from lmcache_mp.kv import KVContext, KVStore, pinning

__all__ = ["StreamBase"]

logger = logging.getLogger(__name__)

KV = LMCacheSDKCacheKind.KV
# The end of an engine's events (None may be an event).
_END = object()


class StreamBase:
    """One logical request spanning several inference passes: the state,
    the KV context and the phases every public stream class shares.

    Args:
        ctx: The KV context used for retrieve/store; ``None`` for a
            0.5.6 stream without one, which only generates.
        post_completion: Callable that submits a prompt to the engine.
        prompt_token_ids: Initial prompt token ids (non-empty, ints >= 0).
        cache_salt: Per-user isolation salt, or ``""``.
        stream_id: Id to use instead of a fresh UUID.
        state: Start from this state instead of the prompt (used by workers
            to rebuild a stream; ``prompt_token_ids`` is then ignored).
        others: Contexts of the other cache kinds (QUERY), by kind.
        kinds: Whether a modify fn is handed ``{kind: tensor}`` for every
            context (upstream 0.5.6) instead of the KV alone (the seed).

    Raises:
        StreamInputError: If the prompt is empty or not token ids.
    """

    def __init__(
        self,
        ctx: KVContext | None,
        post_completion: PostCompletion,
        prompt_token_ids: Sequence[int],
        cache_salt: str = "",
        *,
        stream_id: str | None = None,
        state: StreamState | None = None,
        others: Mapping[LMCacheSDKCacheKind, KVContext] | None = None,
        kinds: bool = False,
    ) -> None:
        self.ctx = ctx
        self._others = dict(others or {})
        self._kinds = kinds
        self.post_completion = post_completion
        self.cache_salt = cache_salt
        self._stream_id = stream_id if stream_id is not None else str(uuid.uuid4())
        if state is None:
            tokens = check_tokens(prompt_token_ids, self._stream_id, "prompt")
            if not tokens:
                raise StreamInputError(
                    f"stream {self._stream_id}: the prompt is empty", self._stream_id
                )
            state = StreamState(tokens=tokens)
        self._state = state

    def __repr__(self) -> str:
        s = self._state
        return (
            f"<{type(self).__name__} {self._stream_id} tokens={len(s.tokens)} "
            f"suffix={len(s.suffix)} decoded={s.decoded} done={s.done}>"
        )

    # -- upstream's public attributes, backed by the state ------------------

    @property
    def tokens(self) -> list[int]:
        """The sequence backing the stored KV; sent as the next prompt."""
        return self._state.tokens

    @tokens.setter
    def tokens(self, value: Sequence[int]) -> None:
        self._state.tokens = check_tokens(value, self._stream_id, "tokens")

    @property
    def done(self) -> bool:
        """Whether the last ``generate`` produced fewer than ``max_tokens``."""
        return self._state.done

    @done.setter
    def done(self, value: bool) -> None:
        self._state.done = bool(value)

    @property
    def state(self) -> StreamState:
        """The stream's mutable state (shared, not a copy)."""
        return self._state

    @state.setter
    def state(self, value: StreamState) -> None:
        self._state = value

    def generate(
        self, sampling_params: Mapping[str, Any], suffix_tokens: Sequence[int] = ()
    ) -> StreamPerfMetrics:
        """Run one inference pass and append its output to the stream.

        Pending suffix tokens and ``suffix_tokens`` are appended to
        ``tokens`` to form the prompt; the generated tokens are appended
        after them. ``done`` is set when fewer than ``max_tokens`` came back.

        Args:
            sampling_params: Engine sampling params (``max_tokens`` defaults
                to 1, as upstream).
            suffix_tokens: Extra tokens to append before generating.

        Returns:
            The call's :class:`StreamPerfMetrics`.

        Raises:
            StreamInputError: If ``max_tokens`` or ``suffix_tokens`` is bad.
            KVCapacityError: If the engine stores the KV in a store it does
                not fit; the stream's state is then unchanged.
            LMCacheStreamError: If ``post_completion`` fails or yields
                something that is not a token event; the stream's state is
                then unchanged.
        """
        sid = self._stream_id
        max_tokens = check_max_tokens(sampling_params, sid)
        extra = check_tokens(suffix_tokens, sid, "suffix_tokens")
        prompt = self._state.tokens + self._state.suffix + extra
        ids: list[int] = []
        texts: list[str] = []
        gaps: list[float] = []
        cached: int | None = None
        start = last = time.perf_counter()
        try:
            # max_tokens is passed explicitly: engines default to other values
            # (vLLM: 16) than the 1 that ``done`` is computed against.
            params = {**sampling_params, "max_tokens": max_tokens}
            with pinning(self._state.pin, sid):
                events = iter(
                    self.post_completion(list(prompt), params, self.cache_salt)
                )
            for event in self._pinned(events):
                token_id = getattr(event, "token_id", None)
                if isinstance(token_id, bool) or not isinstance(
                    token_id, (int, np.integer)
                ):
                    raise LMCacheStreamError(
                        f"post_completion yielded {event!r}, expected a "
                        "TokenEvent with an int token_id",
                        sid,
                    )
                # Engines learn the figure at different times (the embedded
                # one before the first token, an OpenAI server in its final
                # usage chunk): the last one given wins.
                reported = getattr(event, "cached_tokens", None)
                if reported is not None:
                    cached = int(reported)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now
                ids.append(int(token_id))
                texts.append(str(getattr(event, "text", "")))
        except LMCacheStreamError as exc:
            if exc.stream_id is None:
                exc.stream_id = sid
            raise LMCacheStreamError(
                f"stream {sid} failed during generation: {exc}", sid
            ) from exc
        except KVCapacityError:
            raise  # the engine's store refused the KV; it names the stream
        except Exception as exc:
            raise LMCacheStreamError(
                f"stream {sid} failed during generation: {type(exc).__name__}: {exc}",
                sid,
            ) from exc
        duration = time.perf_counter() - start
        s = self._state
        self._state = StreamState(
            tokens=prompt + ids,
            suffix=[],
            decoded=s.decoded + len(ids),
            text_parts=s.text_parts + texts,
            output_ids=s.output_ids + ids,
            done=len(ids) < max_tokens,
            edited=s.edited,
        )
        return StreamPerfMetrics(
            duration=duration,
            input_tokens=len(prompt),
            output_tokens=len(ids),
            input_tput=len(prompt) / duration if duration > 0 else 0.0,
            output_tput=len(ids) / duration if duration > 0 else 0.0,
            tpot=gaps[1:],
            ttft=gaps[0] if gaps else 0.0,
            cached_tokens=cached,
        )

    def _pinned(self, events: Iterator[Any]) -> Iterator[Any]:
        """``events``, each drawn in the stream's pin scope: an engine
        storing KV while it yields them pins it to the stream's batch."""
        while True:
            with pinning(self._state.pin, self._stream_id):
                event = next(events, _END)
            if event is _END:
                return
            yield event

    @property
    def contexts(self) -> dict[LMCacheSDKCacheKind, KVContext]:
        """The stream's contexts by cache kind (``KV`` is :attr:`ctx`)."""
        own = {} if self.ctx is None else {KV: self.ctx}
        return {**own, **self._others}

    def _context(self, kind: LMCacheSDKCacheKind) -> KVContext:
        """The context of ``kind``, or a :class:`CacheKindError`."""
        ctx = self.ctx if kind is KV else self._others.get(kind)
        if ctx is None:
            have = ", ".join(k.name for k in self.contexts) or "none"
            raise CacheKindError(
                f"stream {self._stream_id}: no {kind.name} context (it has: {have})",
                self._stream_id,
            )
        return ctx

    def retrieve_kv(
        self, timeout: float = 30.0, poll_interval: float = 0.2
    ) -> npt.NDArray[Any]:
        """Return the cached KV of ``tokens``, polling until it appears.

        Args:
            timeout: Seconds to wait for a cached prefix to appear.
            poll_interval: Seconds between retrieve attempts.

        Returns:
            The KV of the longest cached chunk-aligned prefix of ``tokens``,
            as a ``[2, L, T, D]`` array.

        Raises:
            KVEvictedError: At once, if the store evicted the KV (it polls
                only while the KV may still arrive).
            NoFullChunkError: At once, if ``tokens`` are fewer than the
                context's ``chunk_size`` (no chunk of them can be cached).
            LMCacheStreamError: If nothing is cached within ``timeout``.
        """
        return self._retrieve(KV, timeout, poll_interval)

    def _retrieve(
        self, kind: LMCacheSDKCacheKind, timeout: float, poll_interval: float
    ) -> npt.NDArray[Any]:
        """:meth:`retrieve_kv` for the context of ``kind``."""
        ctx = self._context(kind)
        if len(self._state.tokens) < ctx.chunk_size:
            raise NoFullChunkError(
                f"stream {self._stream_id}: its {len(self._state.tokens)} tokens "
                f"are fewer than chunk_size {ctx.chunk_size}: no {kind.name} of "
                "them can be cached, so there is nothing to retrieve",
                self._stream_id,
            )
        deadline = time.monotonic() + timeout
        while True:
            kv = ctx.retrieve(self._state.tokens, self.cache_salt)
            self._check_evicted(ctx, kind, 0 if kv is None else int(kv.shape[2]))
            if kv is not None:
                return kv
            if time.monotonic() >= deadline:
                raise LMCacheStreamError(
                    f"stream {self._stream_id}: no cached {kind.name} for its "
                    f"{len(self._state.tokens)} tokens after {timeout:g}s "
                    f"(chunk_size {ctx.chunk_size}; was it prefilled?)",
                    self._stream_id,
                )
            time.sleep(poll_interval)

    def _retrieve_rows(
        self,
        kind: LMCacheSDKCacheKind,
        cached: int,
        timeout: float,
        poll_interval: float,
    ) -> npt.NDArray[Any]:
        """Another kind's tensor for the ``cached`` KV tokens, as a modify fn
        gets it: of every position when the kind covers them, else (after
        an edit, whose tokens' queries no one computed) of the positions
        from the edit's last cached chunk to ``cached``, the tokens
        generated since, as upstream's queries across decode."""
        ctx = self._context(kind)
        start = self._state.edited // ctx.chunk_size * ctx.chunk_size
        if start == 0 or not isinstance(ctx, KVStore):
            return self._retrieve(kind, timeout, poll_interval)
        whole = ctx.retrieve(self._state.tokens, self.cache_salt)
        if whole is not None and whole.shape[2] >= cached:
            return whole
        if cached <= start:
            # Every cached KV token is the last modify's own: no engine
            # computed one since, so no one will record its queries.
            raise LMCacheStreamError(
                f"stream {self._stream_id}: no {kind.name} for its {cached} cached "
                f"tokens: the last modify left them ({self._state.edited} tokens) "
                "and nothing was cached since (decode the stream past its next "
                f"chunk boundary, chunk_size {ctx.chunk_size}, before modifying "
                "it again)",
                self._stream_id,
            )
        deadline = time.monotonic() + timeout
        while True:
            rows = ctx.retrieve(self._state.tokens, self.cache_salt, start=start)
            if rows is not None and start + rows.shape[2] >= cached:
                return rows[:, :, : cached - start]
            if time.monotonic() >= deadline:
                raise LMCacheStreamError(
                    f"stream {self._stream_id}: no cached {kind.name} for its "
                    f"tokens {start}..{cached} after {timeout:g}s: the last "
                    f"modify left {self._state.edited} tokens, and an engine "
                    f"records the {kind.name} of what it computes after them "
                    "(decode the stream before modifying it again)",
                    self._stream_id,
                )
            time.sleep(poll_interval)

    def _unchanged(self, cached: int) -> bool:
        """Whether the ``cached`` KV tokens are all ones the last modify left
        (the store keeps its full chunks only)."""
        chunk = self._context(KV).chunk_size
        return cached <= self._state.edited // chunk * chunk

    def _check_evicted(
        self, ctx: KVContext, kind: LMCacheSDKCacheKind, cached: int
    ) -> None:
        """Fail at once when the chunk after the ``cached`` tokens a retrieve
        found was evicted: waiting would not bring it back."""
        if cached + ctx.chunk_size > len(self._state.tokens):
            return
        was_evicted = getattr(ctx, "was_evicted", None)
        if was_evicted is None or not was_evicted(
            self._state.tokens, self.cache_salt, cached
        ):
            return
        sid = self._stream_id
        raise KVEvictedError(
            f"stream {sid}: the store evicted the cached {kind.name} of its "
            f"tokens {cached}..{cached + ctx.chunk_size} (of "
            f"{len(self._state.tokens)}); it was stored and will not come back "
            "(the store was over capacity outside an open batch; raise its "
            "capacity or keep the stream in a batch, which pins its KV)",
            sid,
        )

    def _write(
        self,
        arr: npt.NDArray[Any],
        toks: list[int],
        replace: bool,
        stage: bool,
        kind: LMCacheSDKCacheKind = KV,
    ) -> Any:
        """Store a validated edit of ``kind`` (over cached chunks if ``replace``).

        Returns:
            With ``stage`` and a replacing edit on a context that can stage
            (``ctx.stage``), the staged chunks to commit or discard; else
            ``None`` (the edit is stored).
        """
        sid = self._stream_id
        ctx = self._context(kind)
        stage_fn = getattr(ctx, "stage", None) if replace and stage else None
        try:
            with pinning(self._state.pin, sid):
                if stage_fn is not None:
                    return stage_fn(arr, toks, self.cache_salt)
                wrote = store_edit(ctx, arr, toks, self.cache_salt, replace=replace)
        except (KVConfigError, TypeError, ValueError) as exc:
            raise StreamInputError(
                f"stream {sid}: the store rejected the new {kind.name}: {exc}", sid
            ) from exc
        if not wrote:
            # A same-token edit that did not land is lost: say so. An edit of
            # new tokens whose every chunk is cached already (a compression
            # round keeping what the last one kept) finds the same KV there,
            # keyed by the same token prefix.
            log = logger.warning if replace else logger.debug
            log("store reported edited %s already cached for stream %s", kind.name, sid)
        return None

    def update_kv(self, kv: Any, tokens: Sequence[int]) -> None:
        """Store an edited KV and make ``tokens`` back the stream.

        When ``tokens`` is a prefix of the stream's tokens, the KV replaces
        their cached chunks (on contexts whose ``store`` takes
        ``overwrite=``); upstream's store kept the cached chunks instead.

        Args:
            kv: The edited KV, ``[2, L, T, D]``: a numpy array, a torch
                tensor, or anything ``np.asarray`` accepts.
            tokens: The ``T`` token ids the KV belongs to.

        Raises:
            StreamInputError: If ``kv`` is not 4-D ``[2, L, T, D]``, or
                ``T != len(tokens)``, or the tokens are not token ids.
        """
        self._update(KV, kv, tokens)

    def _update(
        self, kind: LMCacheSDKCacheKind, kv: Any, tokens: Sequence[int]
    ) -> None:
        """:meth:`update_kv` for the context of ``kind``."""
        self._context(kind)  # an unknown kind fails before any check
        arr, toks = check_edit(kv, tokens, kind, self._stream_id)
        # Tokens the stream already holds: the caller edited their cached KV.
        self._write(
            arr,
            toks,
            replace=toks == self._state.tokens[: len(toks)],
            stage=False,
            kind=kind,
        )
        self._state.tokens = toks
        self._state.done = False
        if kind is KV:
            self._state.edited = len(toks)

    def modify_kv(
        self,
        fn: ModifyFn,
        timeout: float = 30.0,
        poll_interval: float = 0.2,
        *,
        array: str | None = None,
    ) -> StreamModifyMetrics:
        """Edit the cached KV with ``fn`` and store the result.

        Retrieves the chunk-aligned cached prefix of ``tokens``; the uncached
        tail is prepended to the pending suffix (so it is sent with the next
        prompt); ``fn(kv, tokens[:T])`` returns ``(new_kv, new_tokens)`` or
        ``(new_kv, new_tokens, info)``, which is stored and backs the stream.
        A stream of upstream 0.5.6's API hands ``fn`` a mapping
        ``{kind: tensor}`` of every context's tensor instead of ``kv``.

        Args:
            fn: The KV editor.
            timeout: Seconds to wait for the cached KV to appear.
            poll_interval: Seconds between retrieve attempts.
            array: What ``fn`` is handed: ``"numpy"`` arrays or ``"torch"``
                CPU tensors sharing their memory; it may return
                either. Default: numpy, and torch for a 0.5.6-API stream
                where torch is installed (upstream's tensors are torch).

        Returns:
            What the edit did, with ``info`` from the fn if it gave one.

        Raises:
            LMCacheStreamError: If no KV (or other kind) is cached within
                ``timeout``, or the fn raises (its exception is the
                ``__cause__``).
            StreamInputError: If the fn's result is malformed.
            CacheKindError: If the fn returns a kind other than KV.
        """
        if array is not None:
            check_array_type(array)
        return self._modify(fn, timeout, poll_interval, stage=False, array=array)[0]

    def _modify(
        self,
        fn: ModifyFn,
        timeout: float,
        poll_interval: float,
        *,
        stage: bool,
        array: str | None = None,
        skip_unchanged: bool = False,
    ) -> tuple[StreamModifyMetrics, Any]:
        """:meth:`modify_kv`; with ``stage``, a same-token edit is staged and
        returned for the caller to commit with the new state (a batch); with
        ``skip_unchanged``, a stream whose cached KV is all the last
        modify's own is left as it is, ``fn`` not called (a compression
        round: nothing was generated into the cache since)."""
        sid = self._stream_id
        start = time.perf_counter()
        kv = self.retrieve_kv(timeout=timeout, poll_interval=poll_interval)
        cached = int(kv.shape[2])
        if skip_unchanged and self._unchanged(cached):
            elapsed = time.perf_counter() - start
            kept = StreamModifyMetrics(
                elapsed, cached, cached, int(kv.nbytes), 0, retrieve_s=elapsed
            )
            return kept, None
        given = self._state.tokens[:cached]
        kind_of_array = fn_array(array, self._kinds)
        read = int(kv.nbytes)
        arg: Any = as_type(kv, kind_of_array)
        if self._kinds:
            # Upstream 0.5.6: every context's tensor of the current tokens.
            tensors = {KV: arg}
            for kind in self._others:
                other = self._retrieve_rows(kind, cached, timeout, poll_interval)
                read += int(other.nbytes)
                tensors[kind] = as_type(other, kind_of_array)
            arg = KindTensors(tensors)
        retrieved = time.perf_counter()
        try:
            result = fn(arg, list(given))
        except Exception as exc:
            raise LMCacheStreamError(
                f"stream {sid}: modify fn raised {type(exc).__name__}: {exc}", sid
            ) from exc
        if not isinstance(result, tuple) or len(result) not in (2, 3):
            raise StreamInputError(
                f"stream {sid}: modify fn returned {type(result).__name__}, "
                "expected a tuple (new_kv, new_tokens) or (new_kv, new_tokens, info)",
                sid,
            )
        edited = time.perf_counter()
        new_kv, toks = check_edit(result[0], result[1], KV, sid)
        # Only a same-token edit overwrites, and a batch stages it: any other
        # edit leaves the chunks of the previous state intact, so a worker
        # dying before the batch commits leaves the stream fully unmodified
        # .
        staged = self._write(new_kv, toks, replace=toks == given, stage=stage)
        s = self._state
        self._state = dataclasses.replace(
            s,
            tokens=toks,
            suffix=s.tokens[cached:] + s.suffix,
            done=False,
            edited=len(toks),
        )
        end = time.perf_counter()
        figures = StreamModifyMetrics(
            duration=end - start,
            tokens_before=cached,
            tokens_after=len(toks),
            kv_bytes_in=read,
            kv_bytes_out=int(new_kv.nbytes),
            info=result[2] if len(result) == 3 else None,
            retrieve_s=retrieved - start,
            fn_s=edited - retrieved,
            store_s=end - edited,
        )
        return figures, staged
