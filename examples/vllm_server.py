"""The token-dropping batch against an OpenAI-compatible server.

prefill -> modify (``make_edit("random", keep=0.5, ...)``) -> decode, with the
process executor, where every request goes over HTTP to
``POST /v1/completions`` through :func:`lmcache_mp.engine.http.openai.post_completion`.

By default the example starts ``lmcache-mp serve --port 0 --store
shm:///<name>`` itself and opens the same named store as the batch's KV
context, so the server's prefill KV is what modify edits, and decode shows
the server reusing the edited KV ("Cache-Hit Tokens")::

    python examples/vllm_server.py

Against a server you started (``lmcache-mp serve --store shm:///mystore
--chunk-size 64``), give its URL and store::

    python examples/vllm_server.py --url http://127.0.0.1:8000 --store shm:///mystore

A real vLLM + LMCache deployment works the same way for prefill and decode,
but modify only sees vLLM's KV through LMCache's own KV context (upstream's
``LMCacheKVCacheContext``), not through an lmcache_mp store; see the README.
"""

from __future__ import annotations

import argparse
import json
import queue
import secrets
import signal
import subprocess
import sys
import threading
import urllib.request

import numpy as np

import lmcache_mp.batch as lmc_batch
import lmcache_mp.stream as lmc_stream
from lmcache_mp.edits import make_edit
from lmcache_mp.engine.http.openai import post_completion
from lmcache_mp.kv import connect

STARTUP_TIMEOUT = 60.0
_LISTENING = "lmcache-mp serve: listening on "


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="server base URL (default: start one)")
    parser.add_argument("--model", help="model name (default: the server's first)")
    parser.add_argument(
        "--store", help="KV store URL the server writes (default: a fresh shm store)"
    )
    parser.add_argument("--chunk-size", type=int, default=64)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--keep", type=float, default=0.5, help="fraction kept")
    # The edit's defaults protect 256 tokens at each end, as fits 1k+ prompts;
    # these keep the demo's short prompts droppable.
    parser.add_argument("--keep-first", type=int, default=32)
    parser.add_argument("--keep-last", type=int, default=32)
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--workers", type=int, default=None)
    args = parser.parse_args(argv)
    if args.url and not args.store:
        parser.error(
            "--url needs --store: the KV store the server reads and writes "
            "(for vLLM, LMCache's own context; see the module docstring)"
        )
    return args


def start_server(store: str, chunk_size: int) -> tuple[subprocess.Popen[str], str]:
    """Start ``lmcache-mp serve`` on a free port; return it and its URL."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "lmcache_mp.engine.http.server",
            "--port",
            "0",
            "--store",
            store,
            "--chunk-size",
            str(chunk_size),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()

    def read_stdout() -> None:
        for line in proc.stdout or ():
            lines.put(line)

    threading.Thread(target=read_stdout, daemon=True).start()
    try:
        first = lines.get(timeout=STARTUP_TIMEOUT)
    except queue.Empty:
        stop_server(proc)
        raise RuntimeError("lmcache-mp serve printed no URL in time") from None
    if not first.startswith(_LISTENING):
        stop_server(proc)
        raise RuntimeError(f"lmcache-mp serve did not start: {first.strip()!r}")
    return proc, first[len(_LISTENING) :].strip()


def stop_server(proc: subprocess.Popen[str]) -> None:
    """Stop the server as Ctrl-C would; kill it if it does not exit."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def first_model(url: str) -> str:
    """The id of the first model ``GET /v1/models`` lists."""
    with urllib.request.urlopen(url.rstrip("/") + "/v1/models", timeout=10) as resp:
        return str(json.load(resp)["data"][0]["id"])


def main(argv: list[str]) -> None:
    """Run the three phases and print their reports."""
    args = _args(argv)
    store = args.store or f"shm:///lmcache-mp-example-{secrets.token_hex(6)}"
    proc = None
    url = args.url
    ctx = connect(store, chunk_size=args.chunk_size)
    try:
        if url is None:
            proc, url = start_server(store, args.chunk_size)
        print(f"server: {url}  store: {store}")
        engine = post_completion(url, args.model or first_model(url))
        rng = np.random.default_rng(0)
        prompts = [
            rng.integers(1, args.vocab_size, args.prompt_tokens).tolist()
            for _ in range(args.streams)
        ]
        with lmc_batch.LMCacheBatchedStream(
            "process", max_workers=args.workers
        ) as batch:
            for toks in prompts:
                batch.add(lmc_stream.create_request(ctx, engine, toks))
            batch.prefill({"temperature": 1.0}).emit()
            drop = make_edit(
                "random",
                keep=args.keep,
                keep_first=args.keep_first,
                keep_last=args.keep_last,
            )
            batch.modify(drop).emit()
            batch.decode({"max_tokens": args.max_tokens}).emit()
    finally:
        if proc is not None:
            stop_server(proc)
        if args.store is None:
            ctx.destroy()
        else:
            ctx.close()


# The guard matters: worker processes started with "spawn" import this file.
if __name__ == "__main__":
    main(sys.argv[1:])
