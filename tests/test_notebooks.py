"""Specification of "code written for either upstream API runs unchanged": a notebook written for upstream 0.5.6 and the seed's script
run on lmcache_mp's process pool with only their import lines changed, and
give what the thread executor (upstream's design) gives."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = Path(__file__).resolve().parent / "notebooks"

#: Upstream's modules, and the deployment's (an LMCache server and a vLLM
#: engine upstream), to what a notebook imports instead on lmcache_mp.
IMPORTS = {
    "lmcache.sdk.batch": "lmcache_mp.batch",
    "lmcache.sdk.request": "lmcache_mp.request",
    "lmcache.sdk.stream": "lmcache_mp.stream",
    "lmcache.sdk.cache_kind": "lmcache_mp.cache_kind",
    "deployment": "tests.notebooks.embedded",
}


def _on_lmcache_mp(source: str) -> str:
    """The notebook with its import lines pointed at lmcache_mp; no other
    line changes."""
    lines = []
    for line in source.splitlines():
        if line.startswith(("import ", "from ")):
            for upstream, ours in IMPORTS.items():
                line = line.replace(f" {upstream} ", f" {ours} ")
        lines.append(line)
    return "\n".join(lines) + "\n"


def _run(source: str) -> dict[str, Any]:
    # As a notebook cell runs: no file, so workers never re-import it.
    done = subprocess.run(
        [sys.executable, "-c", source],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return result


@pytest.mark.parametrize("notebook", ["upstream_0_5_6", "seed"])
def test_a_notebook_for_upstream_runs_with_only_its_imports_changed(
    notebook: str,
) -> None:
    """Only import lines differ from the upstream notebook, and on the default process pool it gives the thread executor's tokens, outputs, KV sums and counts."""
    upstream = (NOTEBOOKS / f"{notebook}.py").read_text()
    ours = _on_lmcache_mp(upstream)
    changed = [
        (a, b)
        for a, b in zip(upstream.splitlines(), ours.splitlines(), strict=True)
        if a != b
    ]
    assert changed and all(a.startswith(("import ", "from ")) for a, _ in changed)
    assert "LMCacheBatchedStream()" in ours  # the default: the process pool
    on_pool = _run(ours)
    on_threads = _run(
        ours.replace("LMCacheBatchedStream()", 'LMCacheBatchedStream("thread")')
    )
    assert on_pool == on_threads
    # Each stream kept half of its 64 cached tokens, then decoded 8 more.
    assert all(len(out) == 1 + 8 for out in on_pool["outputs"])
    assert on_pool["output_tokens"] == 4 * 8
    assert all(len(tokens) == 32 + 1 + 8 for tokens in on_pool["tokens"])
