"""The real-model figures of docs/models.md: SmolLM2-135M on a
2-worker process pool, prefill tokens/s, decode ms/token, and the PSS of the
parent and its workers with the model loaded, against their RSS and the
weights' size. One run, printed as measured::

    python scripts/hf_engine.py
    python scripts/hf_engine.py --streams 8 --prompt-tokens 1024 --workers 2
"""

from __future__ import annotations

import argparse

from tabulate import tabulate

from lmcache_mp.bench._model_run import model_figures

MIB = 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    f = model_figures(
        args.model,
        streams=args.streams,
        prompt_tokens=args.prompt_tokens,
        max_tokens=args.max_tokens,
        workers=args.workers,
    )
    rows = [
        ("model", f.model),
        ("streams x prompt tokens", f"{f.streams} x {f.prompt_tokens}"),
        ("workers", f.workers),
        ("prefill (tokens/s)", f"{f.prefill_tput:,.0f}"),
        ("decode (ms/token, p50)", f"{f.decode_ms_per_token:.1f}"),
        ("weights (MiB)", f"{f.weights_bytes / MIB:,.0f}"),
        ("PSS, parent + workers (MiB)", f"{f.pss_bytes / MIB:,.0f}"),
        ("RSS, parent + workers (MiB)", f"{f.rss_bytes / MIB:,.0f}"),
    ]
    print(tabulate(rows, tablefmt="simple"))


if __name__ == "__main__":
    main()
