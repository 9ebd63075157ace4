"""Load on ``lmcache-mp serve``: many concurrent completions on loopback.

Starts ``lmcache-mp serve`` (the toy engine, a temporary store) in a child
process, opens ``--requests`` connections at once, each sending one
completion request of ``--prompt-tokens`` token ids, and samples the
server's RSS meanwhile. Every request must be answered (200) or refused
(503 with ``Retry-After``); anything else counts as failed. Prints one JSON
document: the counts, whether the server is still alive and serving, its
peak RSS and the wall time::

    python scripts/serve_load.py --requests 1000 --prompt-tokens 64

Extra arguments after ``--`` go to ``lmcache-mp serve``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import resource
import subprocess
import sys
import threading
import time
from collections import Counter
from typing import Any

import psutil

_LISTENING = "lmcache-mp serve: listening on "


async def _one(port: int, body: bytes, timeout: float) -> str:
    """Send one request; return ``"200"``, ``"503"`` or what went wrong."""
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection("127.0.0.1", port), timeout
        )
    except (OSError, asyncio.TimeoutError) as exc:
        return f"connect: {type(exc).__name__}"
    try:
        head = (
            "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            "Content-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        ).encode()
        writer.write(head + body)
        await writer.drain()
        reply = await asyncio.wait_for(reader.read(), timeout)
    except (OSError, asyncio.TimeoutError) as exc:
        return f"request: {type(exc).__name__}"
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
    status = reply.split(b" ", 2)[1].decode() if reply.startswith(b"HTTP/") else ""
    if status == "503" and b"\r\nretry-after:" not in reply.lower():
        return "503 without Retry-After"
    return status or "no reply"


async def _all(port: int, bodies: list[bytes], timeout: float) -> Counter[str]:
    results = await asyncio.gather(*(_one(port, b, timeout) for b in bodies))
    return Counter(results)


def _sample_rss(pid: int, stop: threading.Event, peak: list[int]) -> None:
    proc = psutil.Process(pid)
    while not stop.wait(0.02):
        with contextlib.suppress(psutil.Error):
            peak[0] = max(peak[0], proc.memory_info().rss)


def run(
    requests: int, prompt_tokens: int, max_tokens: int, serve_args: list[str]
) -> dict[str, Any]:
    """Start a server, load it, stop it; return what was seen."""
    # One descriptor per connection on each side; the server inherits it.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = min(hard, max(soft, 2 * requests + 256))
    resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    cmd = [sys.executable, "-m", "lmcache_mp", "serve", "--port", "0", *serve_args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert server.stdout is not None
        line = server.stdout.readline()
        if not line.startswith(_LISTENING):
            raise RuntimeError(f"the server did not start: {line!r}")
        port = int(line.strip().rsplit(":", 1)[1])
        rng = random.Random(0)
        bodies = [
            json.dumps(
                {
                    "model": "lmcache-mp-embedded",
                    "prompt": [rng.randrange(1, 200) for _ in range(prompt_tokens)],
                    "max_tokens": max_tokens,
                }
            ).encode()
            for _ in range(requests)
        ]
        stop, peak = threading.Event(), [0]
        sampler = threading.Thread(target=_sample_rss, args=(server.pid, stop, peak))
        base = psutil.Process(server.pid).memory_info().rss
        sampler.start()
        start = time.perf_counter()
        try:
            counts = asyncio.run(_all(port, bodies, timeout=120.0))
        finally:
            stop.set()
            sampler.join(timeout=10)
        wall = time.perf_counter() - start
        alive = server.poll() is None
        healthy = alive and asyncio.run(_health(port))
        return {
            "requests": requests,
            "answered": counts.pop("200", 0),
            "refused": counts.pop("503", 0),
            "failed": dict(counts),
            "alive": alive,
            "healthy": healthy,
            "rss_start_mib": round(base / 2**20, 1),
            "peak_rss_mib": round(max(peak[0], base) / 2**20, 1),
            "seconds": round(wall, 2),
        }
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=30)


async def _health(port: int) -> bool:
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection("127.0.0.1", port), 10
        )
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        reply = await asyncio.wait_for(reader.read(), 10)
        writer.close()
    except (OSError, asyncio.TimeoutError):
        return False
    return reply.startswith(b"HTTP/1.1 200")


def main() -> None:
    """Parse the arguments, run, print the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=8)
    args, serve_args = parser.parse_known_args()
    if serve_args[:1] == ["--"]:
        serve_args = serve_args[1:]
    result = run(args.requests, args.prompt_tokens, args.max_tokens, serve_args)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
