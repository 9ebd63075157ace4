"""The benchmark's configuration, and what it derives from it."""

from __future__ import annotations

import dataclasses
import multiprocessing
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from lmcache_mp._harness.options import TOY, check_count
from lmcache_mp._harness.prompts import document_tokens
from lmcache_mp.bench._shapes import SHAPES
from lmcache_mp.bench._synthetic import SYNTHETIC_VOCAB, SyntheticEngine
from lmcache_mp.edits import (
    EDITS,
    KIND_EDITS,
    AttentionConfig,
    Edit,
    Stride,
    keep_count,
    make_edit,
)
from lmcache_mp.engine import (
    KV_DTYPES,
    EmbeddedEngine,
    EngineConfig,
    HFEngine,
    LoadedModel,
    load_model,
)
from lmcache_mp.engine import resolve_model as resolve
from lmcache_mp.executors import EXECUTOR_NAMES
from lmcache_mp.kv import KVContext, KVStore, Layout, chunk_file_size, resolve_dtype

__all__ = [
    "AUTO_UNHINTED",
    "BENCH_DTYPES",
    "BENCH_EDITS",
    "BENCH_ENGINES",
    "BENCH_EXECUTORS",
    "DEFAULT_KEEP",
    "DEFAULT_MODEL",
    "DROPPING_EDITS",
    "SWEEPS",
    "SYNTHETIC",
    "BenchConfig",
    "at_sweep_value",
    "sweep_values",
]

#: ``auto`` on an unhinted copy of the edit: the GIL measurement and cost
#: model at work, where the ready-made edits' hints skip them.
AUTO_UNHINTED = "auto-unhinted"
#: Executors the bench can run: the library's names and the engines.
BENCH_EXECUTORS = (*EXECUTOR_NAMES, AUTO_UNHINTED, "dask", "ray")
#: ``engine`` for the exact toy model (:class:`EmbeddedEngine`, random
#: weights).
#: ``engine`` for real shapes' stand-in without a model
#: (:class:`~lmcache_mp.bench._synthetic.SyntheticEngine`).
SYNTHETIC = "synthetic"
#: The engines named by a keyword; any other ``engine`` is a trained model
#: that :meth:`HFEngine.from_pretrained` loads.
BENCH_ENGINES = (TOY, SYNTHETIC)
#: The default engine: SmolLM2-135M, a trained model, so that
#: the main job shows what an edit keeps of a real model's output.
DEFAULT_MODEL = "smollm2-135m"
#: KV dtypes: the toy engine's, and bfloat16 for the others.
BENCH_DTYPES = (*KV_DTYPES, "bfloat16")
#: Edits the bench runs: :data:`~lmcache_mp.edits.EDITS`, and the
#: :data:`~lmcache_mp.edits.KIND_EDITS`, whose streams get a QUERY context.
BENCH_EDITS = tuple(sorted({*EDITS, *KIND_EDITS}))
#: The published KV-compression methods, sized by ``keep`` and given the toy model's
#: attention (heads; streamingllm rerotates).
_METHODS = (
    "expected_attention",
    "h2o",
    "keydiff",
    "knorm",
    "rkv",
    "snapkv",
    "streamingllm",
    "tova",
)
#: Edits that drop tokens, to which ``keep`` applies.
DROPPING_EDITS = tuple(sorted({"pyscore", "random", "redundancy", "window", *_METHODS}))
#: Parameters ``sweep`` can vary, as spelled on the command line.
SWEEPS = ("workers", "streams", "prompt-tokens")
#: ``keep`` when none is given.
DEFAULT_KEEP = 0.5
#: Attention sinks the ``window`` edit keeps besides its window.
_WINDOW_SINKS = 4
#: Most tokens a scored drop protects at each end (the edits' default).
_MAX_PROTECTED = 256
#: Passes of the pyscore loop: enough that the GIL-bound edit, not the
#: phase's overhead, dominates a 1,024-token stream's modify.
_PYSCORE_WORK = 96
#: Smallest prompt a ``prompt-tokens`` sweep starts from.
_SWEEP_MIN_PROMPT = 256


def _one_of(name: str, value: Any, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(
            f"BenchConfig.{name} is {value!r}; choose one of {', '.join(choices)}"
        )


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark: prefill -> modify -> decode, once per executor.

    Args:
        executors: Executors to compare, side by side, in this order:
            ``"serial"``, ``"thread"``, ``"process"``, ``"auto"``,
            ``"auto-unhinted"`` (auto on a copy of the edit without its GIL
            hint; run after ``"auto"`` when not named, see :attr:`runs`),
            ``"dask"``, ``"ray"``.
        streams: Request streams in the batch.
        prompt_tokens: Tokens of each stream's prompt.
        layers: Transformer blocks of the toy or synthetic model (a trained
            model's own are set by :meth:`with_model_dims`).
        kv_heads: Attention heads (K/V heads == query heads).
        head_dim: Channels per head (even).
        dtype: KV dtype, ``"float32"``, ``"float16"``, or ``"bfloat16"``
            (not the toy engine's); a trained model runs in it.
        edits: Ready-made edits to run (names of
            :data:`lmcache_mp.edits.EDITS`); each gets its own runs.
        keep: Fraction of tokens the dropping edits keep (``None``: 0.5).
            The ``window`` edit keeps its sinks and a window sized to match.
        max_tokens: Tokens each stream decodes.
        every: Compress while decoding: every ``every`` generated tokens,
            the streams are modified again by the run's edit
            (``batch.decode(compress=edit, every=every)``, on the run's
            executor), and the dropping edits keep a budget of the tokens
            the modify phase left of a prompt instead of a fraction, so
            that the KV stays that size across rounds. Below
            ``max_tokens``. ``None``: decode without rounds.
        workers: Worker processes (``process``) or the thread cap
            (``thread``); ``None``: physical cores for processes, one
            thread per stream.
        start_method: ``"spawn"``, ``"forkserver"`` or ``"fork"``.
        repeat: Runs of each executor; figures report median and min-max.
        sweep: ``None``, or the parameter to vary (``"workers"``,
            ``"streams"``, ``"prompt-tokens"``) for a scaling curve.
        chunk_size: Tokens per KV store chunk.
        seed: Seed of the prompts, the model weights and the random edit.
        store: KV store URL (``redis://...``, ``shm:///NAME``); each run
            gets a fresh name under it and destroys it. ``None``: a fresh
            temporary shared-memory store per run.
        arena_bytes: Bytes of chunk files each run's shared-memory store
            writes before the phases, for its writes to fill
            (``connect(arena_bytes=...)``); 0: none. ``None``:
            sized to the run (:meth:`run_arena_bytes`).
        scheduler: Dask scheduler address for ``dask`` (``None``: a local
            cluster per run, one worker per ``workers``).
        ray_address: Ray cluster address for ``ray`` (``None``: a local
            runtime per run).
        shape: The name of the preset in :data:`~lmcache_mp.bench._shapes.SHAPES`
            the model dims came from, or ``None`` (recorded, not applied:
            the command line applies it).
        engine: A trained model, as :meth:`HFEngine.from_pretrained` names
            it (default ``"smollm2-135m"``: its prompts are prose, and each
            point reports the edit's agreement with the uncompressed run);
            ``"toy"`` (the exact toy model, random weights); or
            ``"synthetic"`` (a real shape's KV without a model, for
            ``--shape``).

    Raises:
        ValueError: If a field is out of range; the message names it.
    """

    # Sized so that the default run on the trained model takes a few
    # minutes on 2 cores and spends its modify in the GIL-bound edit, the
    # phase the library exists for.
    executors: tuple[str, ...] = ("thread", "process")
    streams: int = 4
    prompt_tokens: int = 512
    layers: int = 8
    kv_heads: int = 4
    head_dim: int = 32
    dtype: str = "float32"
    edits: tuple[str, ...] = ("pyscore",)
    keep: float | None = None
    max_tokens: int = 16
    every: int | None = None
    workers: int | None = None
    start_method: str = "spawn"
    repeat: int = 1
    sweep: str | None = None
    chunk_size: int = 256
    seed: int = 0
    store: str | None = None
    arena_bytes: int | None = None
    scheduler: str | None = None
    ray_address: str | None = None
    shape: str | None = None
    engine: str = DEFAULT_MODEL

    def __post_init__(self) -> None:
        """Check every field.

        Raises:
            ValueError: If a field is out of range; the message names it.
        """
        object.__setattr__(self, "executors", tuple(self.executors))
        object.__setattr__(self, "edits", tuple(self.edits))
        self._check_names("executors", self.executors, BENCH_EXECUTORS)
        self._check_names("edits", self.edits, BENCH_EDITS)
        for name in (
            "streams",
            "prompt_tokens",
            "layers",
            "kv_heads",
            "head_dim",
            "max_tokens",
            "repeat",
            "chunk_size",
        ):
            check_count("BenchConfig", name, getattr(self, name))
        for name in ("workers", "every"):
            if getattr(self, name) is not None:
                check_count("BenchConfig", name, getattr(self, name))
        if self.every is not None and self.every >= self.max_tokens:
            raise ValueError(
                f"BenchConfig.every ({self.every}) must be below max_tokens "
                f"({self.max_tokens}): no compression round would run"
            )
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"BenchConfig.seed must be an int, got {self.seed!r}")
        if self.seed < 0:
            raise ValueError(f"BenchConfig.seed must be >= 0, got {self.seed}")
        arena = self.arena_bytes
        if arena is not None and (
            isinstance(arena, bool) or not isinstance(arena, int) or arena < 0
        ):
            raise ValueError(
                f"BenchConfig.arena_bytes must be None or an int >= 0, got {arena!r}"
            )
        if arena and self.store is not None and self.store.startswith("redis"):
            raise ValueError("BenchConfig.arena_bytes is the shared-memory store's")
        if not isinstance(self.engine, str) or not self.engine:
            raise ValueError(
                f"BenchConfig.engine must name a model, {TOY!r} or "
                f"{SYNTHETIC!r}; got {self.engine!r}"
            )
        dtypes = KV_DTYPES if self.engine == TOY else BENCH_DTYPES
        if self.dtype not in dtypes:
            raise ValueError(
                f"BenchConfig.dtype is {self.dtype!r}; the {self.engine} engine "
                f"takes {', '.join(dtypes)}"
            )
        if self.shape is not None:
            _one_of("shape", self.shape, tuple(SHAPES))
        if self.keep is not None and not 0.0 < self.keep <= 1.0:
            raise ValueError(f"BenchConfig.keep must be in (0, 1], got {self.keep!r}")
        _one_of(
            "start_method",
            self.start_method,
            tuple(multiprocessing.get_all_start_methods()),
        )
        if self.sweep is not None:
            _one_of("sweep", self.sweep, SWEEPS)
        # Builds the model config now, so a shape the engine rejects fails
        # before anything runs.
        if self.engine == TOY:
            self.engine_config()
        scored = [e for e in self.edits if e in KIND_EDITS]
        if scored and self.engine == SYNTHETIC:
            # The synthetic engine records no queries to score with.
            raise ValueError(
                f"BenchConfig.edits {', '.join(scored)} score with the prompt's "
                f"queries, which the synthetic engine does not record"
            )

    @staticmethod
    def _check_names(field: str, names: Sequence[str], known: Sequence[str]) -> None:
        if not names:
            raise ValueError(f"BenchConfig.{field} is empty")
        for name in names:
            if name not in known:
                raise ValueError(
                    f"BenchConfig.{field}: unknown name {name!r}; choose from "
                    f"{', '.join(known)}"
                )
        if len(set(names)) != len(names):
            raise ValueError(f"BenchConfig.{field} names one twice: {list(names)}")

    @property
    def runs(self) -> tuple[str, ...]:
        """The executors run, in order: ``executors``, with ``auto-unhinted``
        right after ``auto`` when not named (auto is judged on
        fns without a hint too, which the ready-made edits are not)."""
        names: list[str] = []
        for name in self.executors:
            names.append(name)
            if name == "auto" and AUTO_UNHINTED not in self.executors:
                names.append(AUTO_UNHINTED)
        return tuple(names)

    @property
    def is_model(self) -> bool:
        """Whether ``engine`` names a trained model."""
        return self.engine not in BENCH_ENGINES

    def model(self) -> LoadedModel:
        """The trained model, loaded in this process once.

        Raises:
            ValueError: If ``engine`` names no trained model.
            ModelLoadError: If the model cannot be found or loaded.
            ImportError: Without the ``model`` extra.
        """
        if not self.is_model:
            raise ValueError(f"BenchConfig.engine {self.engine!r} is not a model")
        return load_model(resolve(self.engine, dtype=self.dtype))

    def with_model_dims(self) -> BenchConfig:
        """This config with a trained model's layers, KV heads and head
        size (itself for the other engines), so that the report gives the
        KV the phases really move.

        Raises:
            ModelLoadError: If the model cannot be found or loaded.
            ImportError: Without the ``model`` extra.
        """
        if not self.is_model:
            return self
        layers, _, kv_heads, head_dim = self.model().layout
        return dataclasses.replace(
            self, layers=layers, kv_heads=kv_heads, head_dim=head_dim
        )

    @property
    def width(self) -> int:
        """``D``: the KV width of one token in one layer."""
        return self.kv_heads * self.head_dim

    @property
    def prompt_kv_bytes(self) -> int:
        """Bytes of one prompt's KV: K and V of every layer and token."""
        itemsize = resolve_dtype(self.dtype).itemsize
        return 2 * self.layers * self.width * self.prompt_tokens * itemsize

    def run_arena_bytes(self, capacity: int, edit: str | None = None) -> int:
        """The arena each run's store writes before the phases.

        ``arena_bytes`` when given. Otherwise, for the temporary
        shared-memory store, the chunk files the run writes: every
        prompt's full chunks and those of what ``edit`` keeps of it
        (:meth:`kept_fraction`: writing into pages written ahead is far
        faster than into new pages, and an arena beyond what the run writes
        only adds memory; see docs/benchmarks/), no more than half of
        ``capacity`` (the store's own capacity, read again as it connects,
        may come out a little lower, and other stores share the
        filesystem); for a store given by URL, none.

        Args:
            capacity: Bytes the temporary store would hold.
            edit: The name of the run's edit (``None``: one keeping all).

        Returns:
            Bytes of arena.
        """
        if self.arena_bytes is not None:
            return self.arena_bytes
        if self.store is not None:
            return 0
        kept = round(self.kept_fraction(edit) * self.prompt_tokens)
        # The store keeps full chunks only, a file each, with a header.
        files = self.streams * (
            self.prompt_tokens // self.chunk_size + kept // self.chunk_size
        )
        layout = Layout(self.layers, self.width, resolve_dtype(self.dtype))
        return min(files * chunk_file_size(layout, self.chunk_size), capacity // 2)

    def kept_fraction(self, edit: str | None) -> float:
        """The share of a prompt's tokens the bench's ``edit`` keeps.

        Args:
            edit: A name of :data:`BENCH_EDITS`, or ``None``.

        Returns:
            ``keep`` for the :data:`DROPPING_EDITS`; one in ``every`` for
            ``stride``; 1 for the others (and ``None``), which keep every
            token.
        """
        if edit == "stride":
            return 1 / Stride.every
        if edit in DROPPING_EDITS:
            return DEFAULT_KEEP if self.keep is None else self.keep
        return 1.0

    def engine_config(self) -> EngineConfig:
        """The embedded model: ``d_model`` is the attention width.

        Raises:
            KVConfigError: If the engine rejects the shape (e.g. an odd
                ``head_dim`` or a width beyond its exact arithmetic).
        """
        return EngineConfig(
            layers=self.layers,
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            d_model=self.width,
            seed=self.seed,
            dtype=self.dtype,
            # A decode prompt is the edited prompt plus the prefill's token;
            # scoring the agreement reads that and max_tokens more.
            max_position=self.prompt_tokens + self.max_tokens + 1,
        )

    def make_engine(
        self, ctx: KVStore, query_ctx: KVContext | None = None
    ) -> EmbeddedEngine | HFEngine | SyntheticEngine:
        """The engine of this config's phases, over ``ctx``.

        Args:
            ctx: The run's KV store.
            query_ctx: Its QUERY context, for an edit scored with queries
                (the toy and trained models record them during the prefill).

        Returns:
            An :class:`HFEngine`, an :class:`EmbeddedEngine`, or a
            :class:`SyntheticEngine` of the same KV layout.

        Raises:
            ModelLoadError: If a trained model cannot be found or loaded.
        """
        if self.engine == TOY:
            return EmbeddedEngine(ctx, self.engine_config(), query_ctx=query_ctx)
        if self.engine == SYNTHETIC:
            return SyntheticEngine(ctx, self.layers, self.width, self.dtype, self.seed)
        return HFEngine.from_pretrained(
            self.engine, ctx, query_ctx=query_ctx, dtype=self.dtype
        )

    def attention(self) -> AttentionConfig:
        """The attention the published methods are given: the trained
        model's heads and RoPE, else the toy model's."""
        if self.is_model:
            return self.model().attention
        return self.engine_config().attention

    def edit(self, name: str) -> Edit:
        """Build the named edit with this config's ``keep`` and ``seed``.

        The scored drops protect ``prompt_tokens // 16`` tokens at each end
        (at most their default of 256), so that short prompts, in tests and
        sweeps, still lose tokens. With :attr:`every`, the dropping edits
        keep ``keep``'s count of a prompt's tokens as their ``budget``.

        Args:
            name: A name of :data:`BENCH_EDITS`.

        Returns:
            The edit.
        """
        keep = DEFAULT_KEEP if self.keep is None else self.keep
        # A fraction applied every round would shrink the KV round after
        # round; a budget holds it at the size the modify phase left, as
        # kvpress's DecodingPress compresses to a fixed target_size.
        size: dict[str, Any] = (
            {"keep": keep}
            if self.every is None
            else {"budget": keep_count(keep, self.prompt_tokens, 0)}
        )
        ends = min(_MAX_PROTECTED, self.prompt_tokens // 16)
        scored = {**size, "keep_first": ends, "keep_last": ends}
        if name == "random":
            return make_edit(name, seed=self.seed, **scored)
        if name == "pyscore":
            return make_edit(name, work=_PYSCORE_WORK, **scored)
        if name == "redundancy":
            return make_edit(name, **scored)
        if name == "window":
            window = max(1, round(keep * self.prompt_tokens) - _WINDOW_SINKS)
            return make_edit(name, window=window, sinks=_WINDOW_SINKS)
        if name in _METHODS:
            return make_edit(name, **size, attention=self.attention())
        return make_edit(name)

    def prompts(self) -> list[list[int]]:
        """The streams' prompts: prose for a trained model (the eval's
        documents, a different one first in each stream), else random token
        ids drawn from ``seed``.

        EOS (id 0) is left out of random ids, so that the prompt reads like
        text.

        Returns:
            ``streams`` lists of ``prompt_tokens`` ids.
        """
        if self.is_model:
            tokenizer = self.model().tokenizer

            def encode(text: str) -> list[int]:
                return list(tokenizer(text)["input_ids"])

            return document_tokens(encode, self.streams, self.prompt_tokens)
        vocab = (
            self.engine_config().vocab_size if self.engine == TOY else SYNTHETIC_VOCAB
        )
        rng = np.random.default_rng(self.seed)
        ids = rng.integers(1, vocab, size=(self.streams, self.prompt_tokens))
        return [[int(t) for t in row] for row in ids]

    def to_dict(self) -> dict[str, Any]:
        """The fields as JSON-ready data (tuples become lists)."""
        data = dataclasses.asdict(self)
        data["executors"] = list(self.executors)
        data["edits"] = list(self.edits)
        return data


def sweep_values(config: BenchConfig, cores: int) -> list[int]:
    """The values a sweep takes.

    ``workers``: 1, 2, ... up to ``cores``. ``streams``: doubling from 1 to
    ``config.streams`` (which ends the list). ``prompt-tokens``: doubling
    from 256 (or less when the prompt is shorter) to
    ``config.prompt_tokens``.

    Args:
        config: The benchmark; its ``sweep`` names the parameter.
        cores: Cores a run can use.

    Returns:
        The increasing values; ``[]`` when ``config.sweep`` is ``None``.
    """
    if config.sweep is None:
        return []
    if config.sweep == "workers":
        return list(range(1, cores + 1))
    top = config.streams if config.sweep == "streams" else config.prompt_tokens
    value = 1 if config.sweep == "streams" else min(_SWEEP_MIN_PROMPT, top)
    values = []
    while value < top:
        values.append(value)
        value *= 2
    return [*values, top]


def at_sweep_value(config: BenchConfig, value: int | None) -> BenchConfig:
    """The config of one sweep point (``config`` itself for ``None``)."""
    if value is None or config.sweep is None:
        return config
    if config.sweep == "workers":
        return dataclasses.replace(config, workers=value)
    if config.sweep == "streams":
        return dataclasses.replace(config, streams=value)
    return dataclasses.replace(config, prompt_tokens=value)
