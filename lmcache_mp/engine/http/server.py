"""``lmcache-mp serve``: an embedded engine behind an OpenAI-compatible API.

The toy model (:class:`EmbeddedEngine`), or with ``--model`` a trained one
(:class:`HFEngine`, e.g. ``--model smollm2-135m``). Routes:
``GET /health``, ``GET /v1/models`` (with the model's ``vocab_size``) and
``POST /v1/completions`` (streaming and not; prompt as text or token ids;
``return_token_ids``; ``stream_options.include_usage``; usage with
``prompt_tokens_details.cached_tokens``). Errors are OpenAI-style JSON
bodies with 4xx codes.

The prompt's log-probabilities, as vLLM answers them:
``prompt_logprobs: K`` and ``echo`` with ``logprobs: K`` (and
``return_tokens_as_token_ids``; ``max_tokens: 0`` for no completion), K up
to ``--max-logprobs`` (20, vLLM's default), not streamed. They are the
engine's ``score`` over the prompt's cached prefix (edited or not), as its
decode would read it: positions whose KV came from the cache were never
computed and are ``null``. ``prompt_logprobs_from: N`` (an extension)
says the context ends at ``N``: the answer is then exactly
``engine.score(prompt[:N], prompt[N:])``, rows from ``N`` on. Nothing is
stored, and at most one token is generated, sampled from the distribution
after the prompt. (vLLM instead skips its cache for such a request and
computes every position.)

With ``--store shm:///NAME`` the server's engine reads and writes the named
shared-memory KV store, so that a batch opened on the same store sees the
KV the server prefilled, and the server reuses the KV the batch edited (its
``usage.prompt_tokens_details.cached_tokens`` shows it).

The server bounds its work, as vLLM does with ``--max-num-seqs`` and its
waiting queue: ``max_num_seqs`` generations run at once (one per physical
core by default, BLAS capped to share the cores between them), up to
``max_queued`` more wait for a slot, and the rest are refused at once with
503 and ``Retry-After``; so are connections past ``max_connections``. A
client has ``read_timeout`` seconds to send each request, however slowly
it drips in.

Run ``lmcache-mp serve --port 0`` (or ``python -m lmcache_mp.engine.http.server``);
its first line is ``lmcache-mp serve: listening on http://HOST:PORT``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import ipaddress
import signal
import sys
import threading
import time
from collections.abc import Iterator
from types import FrameType, TracebackType
from typing import Any

from lmcache_mp._util.blas import limit_blas_while, physical_cores
from lmcache_mp.cache_kind import LMCacheSDKCacheKind
from lmcache_mp.engine._config import KV_DTYPES, EngineConfig
from lmcache_mp.engine._embedded import EmbeddedEngine
from lmcache_mp.engine._hf import HFEngine
from lmcache_mp.engine.http._handler import HTTPServer
from lmcache_mp.engine.http._served import ServedEngine, served_vocab
from lmcache_mp.engine.http._server import Admission, logger
from lmcache_mp.errors import LMCacheError
from lmcache_mp.kv import DEFAULT_CHUNK_SIZE, KVStore, SharedMemoryKVStore, connect

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_MAX_CONNECTIONS",
    "DEFAULT_MAX_LOGPROBS",
    "DEFAULT_MAX_QUEUED",
    "DEFAULT_MODEL_NAME",
    "DEFAULT_QUEUE_TIMEOUT",
    "DEFAULT_READ_TIMEOUT",
    "EngineServer",
    "ServerLimits",
    "add_serve_parser",
    "cli",
    "run_serve_command",
    "serve",
]

#: The model name the server answers to unless told otherwise.
DEFAULT_MODEL_NAME = "lmcache-mp-embedded"
_LISTENING = "lmcache-mp serve: listening on"
#: Largest request body accepted by default (a long prompt's ids fit).
DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024
#: Most tokens listed per position of a prompt's log-probabilities (vLLM's
#: ``--max-logprobs`` default).
DEFAULT_MAX_LOGPROBS = 20
#: Requests that may wait for a generation slot before the rest get 503.
DEFAULT_MAX_QUEUED = 256
#: Seconds a queued request waits for a slot before it gets 503.
DEFAULT_QUEUE_TIMEOUT = 60.0
#: Seconds a client has to send a whole request (headers and body).
DEFAULT_READ_TIMEOUT = 30.0
#: Open connections served at once; past them, 503 with no thread.
DEFAULT_MAX_CONNECTIONS = 1024


def _count(name: str, value: Any, minimum: int) -> int:
    """``value`` checked to be an int of at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _seconds(name: str, value: Any) -> float:
    """``value`` checked to be a positive number of seconds."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    return float(value)


@dataclasses.dataclass(frozen=True)
class ServerLimits:
    """How much work a server takes on at once.

    Args:
        max_num_seqs: Generations computed at once (vLLM's
            ``--max-num-seqs``); ``None``: one per physical core.
        max_queued: Requests that may wait for a slot; past them, 503
            with ``Retry-After``.
        queue_timeout: Seconds a queued request waits for a slot (then 503).
        read_timeout: Seconds a client has to send each request, headers
            and body, and the longest a read or write may block.
        max_connections: Open connections served at once; past them, 503.

    Raises:
        ValueError: For a bound below 1 (``max_queued``: below 0) or a
            timeout that is not a positive number.
    """

    max_num_seqs: int | None = None
    max_queued: int = DEFAULT_MAX_QUEUED
    queue_timeout: float = DEFAULT_QUEUE_TIMEOUT
    read_timeout: float = DEFAULT_READ_TIMEOUT
    max_connections: int = DEFAULT_MAX_CONNECTIONS

    def __post_init__(self) -> None:
        if self.max_num_seqs is not None:
            _count("max_num_seqs", self.max_num_seqs, 1)
        _count("max_queued", self.max_queued, 0)
        _count("max_connections", self.max_connections, 1)
        _seconds("queue_timeout", self.queue_timeout)
        _seconds("read_timeout", self.read_timeout)

    @property
    def running(self) -> int:
        """Generations computed at once (``max_num_seqs`` resolved)."""
        return physical_cores() if self.max_num_seqs is None else self.max_num_seqs


class EngineServer:
    """A running OpenAI-compatible server of an embedded engine.

    Made by :func:`serve`. It serves on a background thread, so it can be
    used from tests and notebooks; :meth:`shutdown` (or leaving its ``with``
    block) stops it, closes open connections and closes the KV store handle
    (a temporary store is then removed; a named one stays).

    Args:
        engine: The engine to serve.
        host: Address to listen on.
        port: TCP port; 0 picks a free one.
        model_name: The name clients must send as ``model``.
        max_body_bytes: Largest request body accepted.
        store: The store handle to close on shutdown, if the server owns it.
        query_store: The engine's QUERY context, to close on shutdown if
            the server owns it.
        max_logprobs: Most tokens listed per position of a prompt's
            log-probabilities.
        limits: How much work it takes on at once; ``ServerLimits()`` by
            default.

    Raises:
        OSError: If the address cannot be bound.
        ValueError: For a bad model name, body limit or ``max_logprobs``.
    """

    def __init__(
        self,
        engine: EmbeddedEngine | HFEngine,
        *,
        host: str = "127.0.0.1",
        port: int = 8000,
        model_name: str = DEFAULT_MODEL_NAME,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        store: KVStore | None = None,
        max_logprobs: int = DEFAULT_MAX_LOGPROBS,
        query_store: KVStore | None = None,
        limits: ServerLimits | None = None,
    ) -> None:
        if not isinstance(model_name, str) or not model_name:
            raise ValueError(f"model_name must be a non-empty str, got {model_name!r}")
        self.max_body_bytes = _count("max_body_bytes", max_body_bytes, 1)
        self.max_logprobs = _count("max_logprobs", max_logprobs, 0)
        self.limits = limits if limits is not None else ServerLimits()
        #: The bound on generations: running at once, and waiting.
        self.admission = Admission(
            self.limits.running, self.limits.max_queued, self.limits.queue_timeout
        )
        self.engine: ServedEngine = engine
        self.vocab = served_vocab(engine)
        self.model_name = model_name
        self._store = store
        self._query_store = query_store
        # Read now: tests swap the engine for a stub that has none.
        self._records_queries = engine.query_ctx is not None
        self._created = int(time.time())
        self._httpd = HTTPServer(
            (host, port),
            self,
            max_connections=self.limits.max_connections,
            read_timeout=self.limits.read_timeout,
        )
        # Every generation slot's BLAS calls share the cores; OpenBLAS also
        # aborts the process when more callers than it was built for run
        # at once, which the slots bound.
        self._blas = contextlib.ExitStack()
        self._thread = threading.Thread(
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": 0.1},
            name=f"lmcache-mp-serve-{self.port}",
            daemon=True,
        )
        self._lock = threading.Lock()
        self._stopped = threading.Event()

    @property
    def host(self) -> str:
        """The address listened on."""
        return str(self._httpd.server_address[0])

    @property
    def port(self) -> int:
        """The TCP port listened on (the real one when 0 was asked)."""
        return int(self._httpd.server_address[1])

    @property
    def url(self) -> str:
        """The base URL, e.g. ``http://127.0.0.1:8000``."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def __repr__(self) -> str:
        return f"<EngineServer {self.url} model={self.model_name!r}>"

    def start(self) -> EngineServer:
        """Start serving on a background thread; return ``self``."""
        self._blas.enter_context(limit_blas_while(self.admission.running))
        self._thread.start()
        return self

    def models(self) -> dict[str, Any]:
        """Return the ``GET /v1/models`` document."""
        return {
            "object": "list",
            "data": [
                {
                    "id": self.model_name,
                    "object": "model",
                    "created": self._created,
                    "owned_by": "lmcache-mp",
                    "max_model_len": self.vocab.max_model_len,
                    # Not in vLLM's card: lets a scoring client size its rows,
                    # and one that shares the store check it.
                    "vocab_size": self.vocab.size,
                    **self._store_card(),
                }
            ],
        }

    def _store_card(self) -> dict[str, Any]:
        """The store's chunk size, and its URL where it holds no secret."""
        ctx = self.engine.ctx
        card: dict[str, Any] = {
            "chunk_size": ctx.chunk_size,
            "records_queries": self._records_queries,
        }
        if isinstance(ctx, SharedMemoryKVStore):
            card["kv_store"] = ctx.url
        return card

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the server has been shut down.

        Args:
            timeout: Seconds to wait; ``None`` waits for good.

        Returns:
            Whether it has stopped.
        """
        return self._stopped.wait(timeout)

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop serving, close connections and the store; idempotent.

        Args:
            timeout: Seconds to wait for in-flight requests to end once
                their connections are closed.
        """
        with self._lock:
            if self._stopped.is_set():
                return
            if self._thread.is_alive():
                self._httpd.shutdown()
                self._thread.join(timeout)
            self._httpd.server_close()
            if not self._httpd.close_connections(timeout):
                logger.warning("some connections did not close in %ss", timeout)
            if self._query_store is not None:
                self._query_store.close()
            if self._store is not None:
                self._store.close()
            self._blas.close()
            self._stopped.set()

    def __enter__(self) -> EngineServer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.shutdown()


def serve(
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    store: str | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    config: EngineConfig | None = None,
    model_name: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    model: str | None = None,
    max_logprobs: int = DEFAULT_MAX_LOGPROBS,
    record_queries: bool = False,
    limits: ServerLimits | None = None,
    save_decode_cache: bool = True,
) -> EngineServer:
    """Serve an embedded engine over HTTP on a background thread.

    Example::

        with serve(port=0, store="shm:///mystore", chunk_size=16) as server:
            engine = post_completion(server.url, server.model_name)

    Args:
        host: Address to listen on (loopback by default: there is no
            authentication).
        port: TCP port; 0 picks a free one (see ``.url``).
        store: KV store URL to attach to, e.g. ``"shm:///mystore"``, shared
            with any process that opens it; ``None`` makes a temporary store
            removed at shutdown.
        chunk_size: Tokens per KV chunk; must match the chunk size the
            other users of the store use.
        config: The toy model; ``EngineConfig()`` by default.
        model_name: The name clients send as ``model``; by default
            ``model``, or ``"lmcache-mp-embedded"`` for the toy model.
        max_body_bytes: Largest request body accepted (413 beyond).
        model: A trained model to serve instead of the toy one: what
            :meth:`HFEngine.from_pretrained` takes (``"smollm2-135m"``, a
            model directory or a GGUF file); its KV layout is the store's.
        max_logprobs: Most tokens listed per position of a prompt's
            log-probabilities (vLLM's ``--max-logprobs``).
        record_queries: Record each prefill's queries in the store's QUERY
            namespace, for the edits that score the KV with them (SnapKV,
            TOVA, H2O, R-KV; ``EmbeddedEngine``'s ``query_ctx``).
        limits: How much work the server takes on at once
            (:class:`ServerLimits`).
        save_decode_cache: Also store the KV (and, with
            ``record_queries``, the queries) of generated tokens, a chunk
            each time they fill one, as vLLM + LMCache's
            ``save_decode_cache`` does; ``False``: the prompt's only.

    Returns:
        The running server.

    Raises:
        KVConfigError: For a bad store URL or chunk size, or a store whose
            KV layout is not the model's.
        KVStoreError: If the store cannot be opened.
        OSError: If the address cannot be bound.
        ValueError: For a bad model name, body limit or ``max_logprobs``.
        ModelLoadError: If ``model`` cannot be found or loaded.
        ImportError: For ``model``, without the ``model`` extra.
    """
    config = config if config is not None else EngineConfig()
    layout: dict[str, Any] = {}
    if model is None:
        layout = {"layers": config.layers, "width": config.width}
        layout["dtype"] = config.dtype
    ctx = connect(store, chunk_size=chunk_size, **layout)
    query_ctx = None
    try:
        if record_queries:
            query_ctx = ctx.for_kind(LMCacheSDKCacheKind.QUERY)
        keep: dict[str, Any] = {
            "query_ctx": query_ctx,
            "save_decode_cache": save_decode_cache,
        }
        engine: EmbeddedEngine | HFEngine = (
            EmbeddedEngine(ctx, config, **keep)
            if model is None
            else HFEngine.from_pretrained(model, ctx, **keep)
        )
        server = EngineServer(
            engine,
            host=host,
            port=port,
            model_name=model_name or model or DEFAULT_MODEL_NAME,
            max_body_bytes=max_body_bytes,
            store=ctx,
            max_logprobs=max_logprobs,
            query_store=query_ctx,
            limits=limits,
        )
    except BaseException:
        if query_ctx is not None:
            query_ctx.close()
        ctx.close()
        raise
    return server.start()


def add_serve_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Add the ``serve`` subcommand and its options.

    Args:
        subparsers: The ``lmcache-mp`` parser's subparsers.

    Returns:
        The ``serve`` parser.
    """
    defaults = EngineConfig()
    parser = subparsers.add_parser(
        "serve",
        help="serve the toy engine or a trained model (--model) over an "
        "OpenAI-compatible HTTP API",
        description="Serve the embedded toy engine, or a trained model, with an "
        "OpenAI-compatible API (GET /health, GET /v1/models, "
        "POST /v1/completions).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (no auth!)"
    )
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    parser.add_argument(
        "--store",
        default=None,
        metavar="URL",
        help="KV store to share by name, e.g. shm:///mystore; none: a temporary one",
    )
    parser.add_argument(
        "--chunk-size",
        type=int,
        default=DEFAULT_CHUNK_SIZE,
        help="tokens per KV chunk; the same as the store's other users",
    )
    parser.add_argument(
        "--model",
        default=None,
        metavar="NAME_OR_PATH",
        help="serve a trained model (HFEngine): smollm2-135m, a model "
        "directory or a GGUF file; none: the toy model below",
    )
    parser.add_argument(
        "--model-name",
        default=None,
        help=f"the model clients ask for; none: --model, else {DEFAULT_MODEL_NAME}",
    )
    parser.add_argument(
        "--record-queries",
        action="store_true",
        help="record each prefill's queries in the store (for snapkv, tova, "
        "h2o, rkv edits)",
    )
    parser.add_argument(
        "--no-decode-cache",
        dest="save_decode_cache",
        action="store_false",
        help="store the prompt's KV only, not the generated tokens' "
        "(vLLM + LMCache's save_decode_cache off)",
    )
    parser.add_argument(
        "--max-logprobs",
        type=int,
        default=DEFAULT_MAX_LOGPROBS,
        help="most tokens listed per position of a prompt's log-probabilities",
    )
    limits = parser.add_argument_group("bounds (ServerLimits)")
    limits.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        help="generations computed at once; none: one per physical core",
    )
    limits.add_argument(
        "--max-queued",
        type=int,
        default=DEFAULT_MAX_QUEUED,
        help="requests that may wait for a slot; past them, 503 + Retry-After",
    )
    limits.add_argument(
        "--queue-timeout",
        type=float,
        default=DEFAULT_QUEUE_TIMEOUT,
        help="seconds a queued request waits for a slot",
    )
    limits.add_argument(
        "--read-timeout",
        type=float,
        default=DEFAULT_READ_TIMEOUT,
        help="seconds a client has to send each request",
    )
    limits.add_argument(
        "--max-connections",
        type=int,
        default=DEFAULT_MAX_CONNECTIONS,
        help="open connections served at once; past them, 503",
    )
    model = parser.add_argument_group("toy model (EngineConfig; not with --model)")
    for name in ("layers", "kv_heads", "head_dim", "d_model", "vocab_size", "seed"):
        model.add_argument(
            "--" + name.replace("_", "-"),
            type=int,
            default=getattr(defaults, name),
            help=name.replace("_", " "),
        )
    model.add_argument(
        "--dtype", choices=KV_DTYPES, default=defaults.dtype, help="KV dtype"
    )
    model.add_argument(
        "--max-position",
        type=int,
        default=defaults.max_position,
        help="longest prompt + completion",
    )
    return parser


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@contextlib.contextmanager
def _stop_on_signals(stop: threading.Event) -> Iterator[None]:
    """Make SIGINT and SIGTERM set ``stop`` (main thread only) while inside."""
    previous: dict[signal.Signals, Any] = {}

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, on_signal)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def cli(argv: list[str]) -> int:
    """Run ``lmcache-mp serve`` (``python -m lmcache_mp.engine.http.server``).

    Args:
        argv: The arguments after ``serve``.

    Returns:
        The exit status of :func:`run_serve_command`; 2 for bad arguments.
    """
    parser = argparse.ArgumentParser(prog="lmcache-mp")
    add_serve_parser(parser.add_subparsers())
    try:
        args = parser.parse_args(["serve", *argv])
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    return run_serve_command(args)


def run_serve_command(args: argparse.Namespace) -> int:
    """Serve with parsed ``serve`` arguments until SIGINT or SIGTERM.

    Prints ``lmcache-mp serve: listening on http://HOST:PORT`` as its first
    line once the server accepts connections.

    Args:
        args: The ``serve`` parser's arguments.

    Returns:
        The exit status: 0 after a clean shutdown, 1 if the server cannot
        start (address in use, store unreadable), 2 for bad arguments.
    """
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    bounds = {f.name for f in dataclasses.fields(ServerLimits)}
    stop = threading.Event()
    # Handlers first: a signal that comes while starting still shuts down
    # cleanly instead of raising KeyboardInterrupt mid-start.
    with _stop_on_signals(stop):
        try:
            config = EngineConfig(
                **{k: v for k, v in vars(args).items() if k in fields}
            )
            server = serve(
                host=args.host,
                port=args.port,
                store=args.store,
                chunk_size=args.chunk_size,
                config=config,
                model_name=args.model_name,
                model=args.model,
                max_logprobs=args.max_logprobs,
                record_queries=args.record_queries,
                save_decode_cache=args.save_decode_cache,
                limits=ServerLimits(
                    **{k: v for k, v in vars(args).items() if k in bounds}
                ),
            )
        except OSError as exc:
            print(f"lmcache-mp serve: cannot start: {exc}", file=sys.stderr)
            return 1
        except (ValueError, LMCacheError) as exc:
            print(f"lmcache-mp serve: {exc}", file=sys.stderr)
            return 2
        try:
            print(f"{_LISTENING} {server.url}", flush=True)
            if not _is_loopback(server.host):
                print(
                    f"lmcache-mp serve: warning: {server.host} is not a loopback "
                    "address and the API has no authentication",
                    file=sys.stderr,
                )
            # Short waits: the main thread runs signal handlers between them.
            while not stop.wait(0.2) and not server.wait(0):
                pass
        finally:
            server.shutdown()
    print("lmcache-mp serve: stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
