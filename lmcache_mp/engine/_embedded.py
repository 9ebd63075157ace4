"""The embedded engine: a ``post_completion`` callable over a KV context."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from lmcache_mp._util.arrays import as_numpy
from lmcache_mp.engine._base import CachingEngine
from lmcache_mp.engine._config import EngineConfig
from lmcache_mp.engine._decode_cache import rows_of
from lmcache_mp.engine._model import KVSequence
from lmcache_mp.engine._prompt import check_prompt
from lmcache_mp.engine._queries import record_queries
from lmcache_mp.engine._sampling import Sampler, SamplingParams
from lmcache_mp.engine._stats import EngineStats
from lmcache_mp.engine._vocab import ToyVocab
from lmcache_mp.errors import StreamInputError
from lmcache_mp.hints import gil_bound
from lmcache_mp.kv import KVContext
from lmcache_mp.stream import TokenEvent

__all__ = ["EmbeddedEngine"]


@gil_bound
class EmbeddedEngine(CachingEngine):
    """A small deterministic transformer, used like vLLM with LMCache.

    Each call looks up the longest cached prefix of the prompt in ``ctx``,
    reuses that KV as it is stored (edited or not) instead of recomputing
    it, computes the rest of the prompt, stores the prompt's full chunks
    back, then decodes token by token. When the whole prompt is cached, its
    last token is still computed (its logits start the decode), so at most
    ``len(prompt) - 1`` tokens are reused.

    The arithmetic is exact fixed point (see ``_fixed``), so a cache hit
    on unmodified KV yields exactly the tokens a cold run yields, and the
    same prompt, params and seed yield the same tokens in any process.

    An engine pickles as its config and context only; each process builds
    the weights once, on first use, and shares them between engines. The
    totals of :meth:`stats` are per process: an unpickled copy starts at 0.

    With ``query_ctx``, each prefill also records the prompt's queries, as
    query-aware compression (SnapKV) needs them: a ``[1, L, T, D]`` tensor
    in the KV dtype, row ``p`` of layer ``l`` being the rotated query that
    position ``p`` attended with (heads side by side, as in a KV row),
    stored with ``query_ctx.store(q, prompt, salt)``. The store keeps full
    chunks only, the same token ranges as the KV (as upstream LMCache
    stores Q), so the prompt's last window is the last stored rows.
    Positions whose KV was reused were not computed by this call: their
    queries are taken from ``query_ctx.retrieve(prompt, salt)``. Where it
    has fewer of them than were reused (an edited KV), the computed rows
    are stored as a range from the first chunk boundary after the reused
    ones, never a tensor with a hole in it: the queries of what was
    generated since the edit, which query-aware edits score with across
    decode. Recording reads the forward pass and changes neither the KV
    nor the tokens.

    Decoding stores the KV of the generated tokens too, a chunk at a time
    as they complete one (keyed by prompt plus generated tokens), and with
    ``query_ctx`` their queries, as vLLM + LMCache's ``save_decode_cache``
    does: a modify after a decode sees the generation's KV, and the next
    decode reuses it.

    Args:
        ctx: The KV context to retrieve from and store to.
        config: The model; ``EngineConfig()`` by default.
        query_ctx: A QUERY-kind context to record the prompts' queries in,
            e.g. ``ctx.for_kind(LMCacheSDKCacheKind.QUERY)`` of the same
            named store; ``None`` records nothing.
        save_decode_cache: ``False``: store the prompt's chunks only.

    Raises:
        CacheKindError: If ``query_ctx`` is given and its ``kind`` is not
            ``LMCacheSDKCacheKind.QUERY``.
    """

    def __init__(
        self,
        ctx: KVContext,
        config: EngineConfig | None = None,
        *,
        query_ctx: KVContext | None = None,
        save_decode_cache: bool = True,
    ) -> None:
        super().__init__(ctx, query_ctx, save_decode_cache)
        self._config = config if config is not None else EngineConfig()
        self._vocab = ToyVocab(self._config.vocab_size, self._config.eos_token_id)

    def _args(self) -> tuple[Any, ...]:
        return (self._ctx, self._config)

    @property
    def config(self) -> EngineConfig:
        """The model's configuration."""
        return self._config

    @property
    def vocab(self) -> ToyVocab:
        """The model's vocabulary."""
        return self._vocab

    def tokenize(self, text: str) -> list[int]:
        """Return the token ids of a text; see :meth:`ToyVocab.tokenize`.

        Args:
            text: The text.

        Returns:
            The token ids.
        """
        return self._vocab.tokenize(text)

    def detokenize(self, token_ids: Sequence[int]) -> str:
        """Return the text of token ids; see :meth:`ToyVocab.detokenize`.

        Args:
            token_ids: Token ids in the vocabulary.

        Returns:
            The text.

        Raises:
            StreamInputError: If an id is not in the vocabulary.
        """
        return self._vocab.detokenize(token_ids)

    def __call__(
        self,
        prompt_token_ids: Sequence[int],
        sampling_params: Mapping[str, Any],
        cache_salt: str = "",
    ) -> Iterator[TokenEvent]:
        """Generate a completion of the prompt, one event per token.

        Arguments are checked now; the prefill runs on the first ``next()``
        and each token is yielded as soon as it is decoded. The first event
        carries ``cached_tokens``: prompt tokens whose KV was reused.

        Args:
            prompt_token_ids: The prompt (ids in ``[0, vocab_size)``).
            sampling_params: ``max_tokens`` (16), ``temperature`` (1.0; 0 is
                greedy), ``top_p`` (1.0), ``seed``, ``ignore_eos`` (False),
                ``stop_token_ids``; other keys are ignored.
            cache_salt: Isolation salt passed to the context.

        Returns:
            An iterator of :class:`TokenEvent`; EOS and stop tokens end it
            and are not yielded.

        Raises:
            SamplingParamsError: If a sampling param is invalid.
            StreamInputError: If the prompt is empty, holds a token outside
                the vocabulary, or does not fit ``max_position`` with
                ``max_tokens``.
            KVConfigError: On iteration, if the cached KV's (or recorded
                queries') layout does not match the model.
        """
        params = SamplingParams.from_mapping(sampling_params)
        cfg = self._config
        prompt = check_prompt(
            prompt_token_ids, params.max_tokens, cfg.vocab_size, cfg.max_position
        )
        return self._generate(prompt, params, cache_salt)

    def _generate(
        self, prompt: list[int], params: SamplingParams, salt: str
    ) -> Iterator[TokenEvent]:
        """Prefill (reusing cached KV), store, then decode lazily."""
        capacity = len(prompt) + params.max_tokens
        seq = KVSequence(self._config, capacity)
        cached = self._ctx.retrieve(prompt, salt)
        reused = 0 if cached is None else seq.load(as_numpy(cached), len(prompt) - 1)
        query_ctx, queries = self._query_ctx, None
        queries_from: int | None = 0
        if query_ctx is not None:
            cfg = self._config
            shape = (1, cfg.layers, capacity, cfg.width)
            queries = np.zeros(shape, dtype=cfg.kv_dtype)
        logits = seq.extend(prompt[reused:], None if queries is None else queries[0])
        # Queries first: a concurrent prefill that finds this KV finds its
        # queries too, and never records a shorter prefix of them.
        if query_ctx is not None and queries is not None:
            head = queries[:, :, : len(prompt)]
            queries_from = record_queries(query_ctx, head, prompt, reused, salt)
        # As LMCache offloads after prefill: the context keeps full chunks.
        self._ctx.store(seq.prefix(len(prompt)), prompt, salt)
        computed = len(prompt) - reused
        self._count(EngineStats(1, len(prompt), reused, computed, 0))
        saver = self._decode_cache(prompt, salt, queries_from)
        rows = None if queries is None else rows_of(queries)
        sampler = Sampler(params)
        one = EngineStats(generated_tokens=1)
        for step in range(params.max_tokens):
            token = sampler.sample(logits)
            if params.stops_at(token, self._config.eos_token_id):
                return
            self._count(one)
            yield TokenEvent(
                token, self._vocab.piece(token), reused if step == 0 else None
            )
            if step + 1 < params.max_tokens:
                logits = seq.extend([token], None if queries is None else queries[0])
                if saver is not None:
                    saver.computed(token, rows_of(seq.kv), rows)

    def score(
        self,
        prompt: Sequence[int],
        continuation: Sequence[int],
        cache_salt: str = "",
    ) -> npt.NDArray[np.float32]:
        """Teacher-force ``continuation`` after ``prompt``: the model's
        log-probabilities at each of its tokens, in one forward pass.

        The contract of :meth:`HFEngine.score
        <lmcache_mp.engine.HFEngine.score>` (vLLM's ``prompt_logprobs``),
        so that ``lmcache-mp eval`` runs on either engine: the
        prompt's cached prefix (edited or not) is reused as :meth:`__call__`
        reuses it, the rest is computed, nothing is stored.

        Args:
            prompt: The context, as a stream would send it next (its tokens
                then its pending suffix).
            continuation: The tokens to score (at least one).
            cache_salt: Isolation salt passed to the context.

        Returns:
            ``[len(continuation), vocab_size]`` float32 log-probabilities;
            row ``i`` is the distribution ``continuation[i]`` was drawn
            from (its argmax is the greedy token, as :meth:`__call__`
            decodes it).

        Raises:
            StreamInputError: As :meth:`__call__`, for the whole sequence,
                or if ``prompt`` or ``continuation`` is empty.
            KVConfigError: If the cached KV's layout is not the model's.
        """
        if not continuation or not prompt:
            raise StreamInputError(
                "score needs a non-empty prompt and continuation, got "
                f"{len(prompt)} and {len(continuation)} tokens"
            )
        cfg = self._config
        whole = check_prompt(
            [*prompt, *continuation], 1, cfg.vocab_size, cfg.max_position
        )
        seq = KVSequence(cfg, len(whole))
        cached = self._ctx.retrieve(whole[: len(prompt)], cache_salt)
        reused = 0 if cached is None else seq.load(as_numpy(cached), len(prompt) - 1)
        logits = seq.extend_logits(whole[reused:-1], last=len(continuation))
        shifted = logits - logits.max(axis=1, keepdims=True)
        logprobs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
        result: npt.NDArray[np.float32] = logprobs.astype(np.float32)
        return result
