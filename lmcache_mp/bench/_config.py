"""The benchmark's configuration, and what it derives from it."""

from __future__ import annotations

import dataclasses
import multiprocessing
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from lmcache_mp.edits import EDITS, KIND_EDITS, Edit, make_edit
from lmcache_mp.engine import EngineConfig
from lmcache_mp.engine._config import KV_DTYPES
from lmcache_mp.executors import EXECUTOR_NAMES

__all__ = [
    "BENCH_EDITS",
    "BENCH_EXECUTORS",
    "DEFAULT_KEEP",
    "DROPPING_EDITS",
    "SWEEPS",
    "BenchConfig",
    "at_sweep_value",
    "sweep_values",
]

#: Executors the bench can run: the library's names and the engines.
BENCH_EXECUTORS = (*EXECUTOR_NAMES, "dask", "ray")
#: Edits the bench runs: :data:`~lmcache_mp.edits.EDITS`, and the
#: :data:`~lmcache_mp.edits.KIND_EDITS`, whose streams get a QUERY context.
BENCH_EDITS = tuple(sorted({*EDITS, *KIND_EDITS}))
#: The methods of issue #21, sized by ``keep`` and given the toy model's
#: attention (heads; streamingllm rerotates).
_METHODS = ("h2o", "keydiff", "knorm", "rkv", "snapkv", "streamingllm", "tova")
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
#: Passes of the pyscore loop: ~0.4 s per 1,024-token stream on one core
#: here, the size of issue #12's GIL-bound row.
_PYSCORE_WORK = 96
#: Smallest prompt a ``prompt-tokens`` sweep starts from.
_SWEEP_MIN_PROMPT = 256


def _positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"BenchConfig.{name} must be an int >= 1, got {value!r}")


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark: prefill -> modify -> decode, once per executor.

    Args:
        executors: Executors to compare, side by side, in this order:
            ``"serial"``, ``"thread"``, ``"process"``, ``"auto"``,
            ``"dask"``, ``"ray"``.
        streams: Request streams in the batch.
        prompt_tokens: Tokens of each stream's prompt.
        layers: Transformer blocks of the embedded model.
        kv_heads: Attention heads (K/V heads == query heads).
        head_dim: Channels per head (even).
        dtype: KV dtype, ``"float32"`` or ``"float16"``.
        edits: Ready-made edits to run (names of
            :data:`lmcache_mp.edits.EDITS`); each gets its own runs.
        keep: Fraction of tokens the dropping edits keep (``None``: 0.5).
            The ``window`` edit keeps its sinks and a window sized to match.
        max_tokens: Tokens each stream decodes.
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
        scheduler: Dask scheduler address for ``dask`` (``None``: a local
            cluster per run, one worker per ``workers``).
        ray_address: Ray cluster address for ``ray`` (``None``: a local
            runtime per run).

    Raises:
        ValueError: If a field is out of range; the message names it.
    """

    # Sized so that the default run spends its time in modify, the phase
    # the library exists for (issue #12): 8 MiB of KV per stream, the
    # GIL-bound edit, a short decode.
    executors: tuple[str, ...] = ("thread", "process", "auto")
    streams: int = 8
    prompt_tokens: int = 1024
    layers: int = 8
    kv_heads: int = 4
    head_dim: int = 32
    dtype: str = "float32"
    edits: tuple[str, ...] = ("pyscore",)
    keep: float | None = None
    max_tokens: int = 16
    workers: int | None = None
    start_method: str = "spawn"
    repeat: int = 1
    sweep: str | None = None
    chunk_size: int = 256
    seed: int = 0
    store: str | None = None
    scheduler: str | None = None
    ray_address: str | None = None

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
            _positive(name, getattr(self, name))
        if self.workers is not None:
            _positive("workers", self.workers)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"BenchConfig.seed must be an int, got {self.seed!r}")
        if self.seed < 0:
            raise ValueError(f"BenchConfig.seed must be >= 0, got {self.seed}")
        if self.dtype not in KV_DTYPES:
            raise ValueError(
                f"BenchConfig.dtype is {self.dtype!r}; choose one of "
                f"{', '.join(KV_DTYPES)}"
            )
        if self.keep is not None and not 0.0 < self.keep <= 1.0:
            raise ValueError(f"BenchConfig.keep must be in (0, 1], got {self.keep!r}")
        methods = multiprocessing.get_all_start_methods()
        if self.start_method not in methods:
            raise ValueError(
                f"BenchConfig.start_method is {self.start_method!r}; choose one "
                f"of {', '.join(methods)}"
            )
        if self.sweep is not None and self.sweep not in SWEEPS:
            raise ValueError(
                f"BenchConfig.sweep is {self.sweep!r}; choose one of "
                f"{', '.join(SWEEPS)}"
            )
        # Builds the model config now, so a shape the engine rejects fails
        # before anything runs.
        self.engine_config()

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
    def width(self) -> int:
        """``D``: the KV width of one token in one layer."""
        return self.kv_heads * self.head_dim

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
            # A decode prompt is the edited prompt plus the prefill's token.
            max_position=self.prompt_tokens + self.max_tokens,
        )

    def edit(self, name: str) -> Edit:
        """Build the named edit with this config's ``keep`` and ``seed``.

        The scored drops protect ``prompt_tokens // 16`` tokens at each end
        (at most their default of 256), so that short prompts, in tests and
        sweeps, still lose tokens.

        Args:
            name: A name of :data:`BENCH_EDITS`.

        Returns:
            The edit.
        """
        keep = DEFAULT_KEEP if self.keep is None else self.keep
        ends = min(_MAX_PROTECTED, self.prompt_tokens // 16)
        scored = {"keep": keep, "keep_first": ends, "keep_last": ends}
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
            return make_edit(name, keep=keep, attention=self.engine_config().attention)
        return make_edit(name)

    def prompts(self) -> list[list[int]]:
        """The streams' prompts: random token ids drawn from ``seed``.

        EOS (id 0) is left out, so that the prompt reads like text.

        Returns:
            ``streams`` lists of ``prompt_tokens`` ids.
        """
        cfg = self.engine_config()
        rng = np.random.default_rng(self.seed)
        ids = rng.integers(1, cfg.vocab_size, size=(self.streams, self.prompt_tokens))
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
