"""``lmcache-mp eval``: its arguments, and running it from them."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable

from lmcache_mp._harness.options import (
    add_int,
    check_path,
    fraction,
    int_at_least,
    name_list,
    require_matplotlib,
)
from lmcache_mp.edits import EDITS, KIND_EDITS
from lmcache_mp.errors import LMCacheError
from lmcache_mp.eval._config import COMPARE, EVAL_EDITS, EVAL_EXECUTORS, EvalConfig
from lmcache_mp.eval._evaluate import evaluate
from lmcache_mp.eval._table import EvalResult
from lmcache_mp.eval._tasks import TASKS

__all__ = ["add_eval_parser", "eval_config_from_args", "run_eval_command"]

_DEFAULTS = EvalConfig()


def _fractions(text: str) -> tuple[float, ...]:
    """Comma-separated fractions in (0, 1]."""
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(
            f"expected fractions in (0, 1] separated by commas, got {text!r}"
        )
    return tuple(fraction(part) for part in parts)


def _counts(text: str) -> tuple[int, ...]:
    """Comma-separated ints >= 1."""
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(
            f"expected integers >= 1 separated by commas, got {text!r}"
        )
    return tuple(int_at_least(1)(part) for part in parts)


def _rerotate_mode(text: str) -> str:
    if text not in ("compact", "shift"):
        raise argparse.ArgumentTypeError(f"expected 'compact' or 'shift', got {text!r}")
    return text


def _fraction_or_zero(text: str) -> float:
    """A fraction in [0, 1]."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1], got {text!r}")
    return value


def add_eval_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Add the ``eval`` subcommand and its options.

    Args:
        subparsers: The top-level parser's subparsers.

    Returns:
        The ``eval`` parser.
    """
    d = _DEFAULTS
    known = sorted({*EDITS, *KIND_EDITS})
    edits: Callable[[str], tuple[str, ...]] = name_list("edit", known)
    p = subparsers.add_parser(
        "eval",
        help="what each edit keeps of a model's output, at each budget",
        description=(
            "Run the uncompressed batch once, then each edit at each keep on "
            "a copy of its KV, and print per edit and keep: teacher-forced "
            "top-1 agreement and KL divergence against the uncompressed "
            "greedy continuation, passkey retrieval accuracy, and the modify "
            "wall time on the executor and on threads."
        ),
    )
    p.add_argument(
        "--edits",
        "--edit",
        dest="edits",
        type=edits,
        default=d.edits,
        metavar="NAMES",
        help=f"comma-separated (default: {','.join(EVAL_EDITS)})",
    )
    p.add_argument(
        "--keep",
        type=_fractions,
        default=d.keeps,
        metavar="FRACTIONS",
        help="comma-separated fractions of the prompt's tokens to keep "
        f"(default: {','.join(f'{k:g}' for k in d.keeps)})",
    )
    add_int(p, "--continuation", 1, d.continuation, "tokens scored after each document")
    add_int(p, "--prompts", 1, d.prompts, "documents, and as many passkey haystacks")
    p.add_argument(
        "--executor",
        choices=EVAL_EXECUTORS,
        default=d.executor,
        help=f"what runs modify (default: {d.executor}); also timed on threads",
    )
    p.add_argument(
        "--engine",
        default=d.engine,
        metavar="MODEL",
        help=f"smollm2-135m, a local model or GGUF, or toy (default: {d.engine})",
    )
    p.add_argument(
        "--workers",
        type=int_at_least(1),
        default=None,
        metavar="N",
        help="worker processes (default: physical cores)",
    )
    add_int(p, "--chunk-size", 1, d.chunk_size, "tokens per KV store chunk")
    p.add_argument(
        "--haystack-lines",
        type=int_at_least(0),
        default=d.haystack_lines,
        metavar="N",
        help=f"filler lines per passkey haystack (default: {d.haystack_lines})",
    )
    rerotate = p.add_mutually_exclusive_group()
    rerotate.add_argument(
        "--rerotate",
        nargs="?",
        const=True,
        default=None,
        type=_rerotate_mode,
        metavar="MODE",
        help="move every edit's kept keys: 'compact' (the mode given no MODE) "
        "to positions 0..kept-1, or 'shift' every key by -(T - kept), keeping "
        "each key's distance to what follows (default: each edit's own "
        "default; streamingllm's is compact)",
    )
    rerotate.add_argument(
        "--no-rerotate",
        dest="rerotate",
        action="store_const",
        const=False,
        help="leave every edit's kept keys at their original positions",
    )
    p.add_argument(
        "--seed", type=int_at_least(0), default=d.seed, help="seed of the passkeys"
    )
    p.add_argument(
        "--server",
        metavar="URL",
        help="run prefill, decode and scoring on this OpenAI-compatible server "
        "(lmcache-mp serve --store the --store URL, --record-queries for "
        "snapkv, tova, h2o, rkv); --engine names the served model, loaded "
        "here for its tokenizer",
    )
    p.add_argument(
        "--store",
        metavar="URL",
        help="the KV store, e.g. shm:///NAME: the server's with --server "
        "(default: a temporary one)",
    )
    add_int(
        p,
        "--generate",
        1,
        None,
        "score compression while generating: each document's greedy "
        "generation of N tokens is the reference (needs --every; no passkey)",
    )
    add_int(p, "--every", 1, None, "with --generate: compress every N tokens")
    add_int(
        p,
        "--budget",
        1,
        None,
        "with --generate: every edit keeps at most N tokens each round "
        "(instead of --keep's fractions)",
    )
    add_int(
        p, "--prompt-tokens", 1, None, "with --generate: cut each document to N tokens"
    )
    tasks = p.add_argument_group("RULER-style tasks (instead of the documents)")
    tasks.add_argument(
        "--tasks",
        type=name_list("task", TASKS),
        default=(),
        metavar="NAMES",
        help=f"comma-separated, of {','.join(TASKS)}: accuracy per task and "
        "length, with 95%% intervals",
    )
    tasks.add_argument(
        "--length",
        type=_counts,
        default=d.lengths,
        metavar="TOKENS",
        help="with --tasks: comma-separated prompt lengths in the model's "
        f"tokens (default: {','.join(map(str, d.lengths))})",
    )
    add_int(
        tasks,
        "--samples",
        1,
        None,
        "with --tasks: prompts per task and length (default: enough for a 95%% "
        "interval of 5 points each side)",
    )
    tasks.add_argument(
        "--min-accuracy",
        type=_fraction_or_zero,
        default=d.min_accuracy,
        metavar="FRACTION",
        help="with --tasks: the uncompressed accuracy a cell needs for the "
        f"edits to run on it (default: {d.min_accuracy:g})",
    )
    tasks.add_argument(
        "--compress-question",
        action=argparse.BooleanOptionalAction,
        default=d.compress_question,
        help="with --tasks: compress the question with the context (the "
        "default), or send it after the modify (--no-compress-question, as "
        "kvpress's pipeline does)",
    )
    p.add_argument(
        "--compare",
        type=name_list("implementation", COMPARE),
        default=(),
        metavar="NAMES",
        help="also run kvpress's counterpart of each edit (and its "
        "uncompressed model) on the same documents and passkeys, or tasks, "
        "and keeps; with --generate, its DecodingPress at --budget (needs "
        "'compare')",
    )
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    p.add_argument(
        "--plot", metavar="PATH", help="draw quality against keep (needs 'plot')"
    )
    return p


def eval_config_from_args(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> EvalConfig:
    """Build the config; a bad combination is a usage error (exit 2).

    Args:
        parser: The ``eval`` parser (for ``parser.error``).
        args: Its parsed arguments.

    Returns:
        The config.
    """
    check_path(parser, "--json", args.json)
    check_path(parser, "--plot", args.plot)
    if args.plot is not None and (args.generate is not None or args.tasks):
        parser.error(
            "--plot draws quality against keep; not with --generate or --tasks"
        )
    if args.plot is not None:
        try:
            require_matplotlib()
        except ImportError as exc:
            parser.error(f"--plot: {exc}")
    try:
        return EvalConfig(
            edits=args.edits,
            keeps=args.keep,
            continuation=args.continuation,
            prompts=args.prompts,
            executor=args.executor,
            engine=args.engine,
            workers=args.workers,
            chunk_size=args.chunk_size,
            haystack_lines=args.haystack_lines,
            seed=args.seed,
            rerotate=args.rerotate,
            server=args.server,
            store=args.store,
            generate=args.generate,
            every=args.every,
            budget=args.budget,
            prompt_tokens=args.prompt_tokens,
            tasks=args.tasks,
            lengths=args.length,
            samples=args.samples,
            min_accuracy=args.min_accuracy,
            compress_question=args.compress_question,
            compare=args.compare,
        )
    except ValueError as exc:
        parser.error(f"invalid configuration: {exc}")


def run_eval_command(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Run ``lmcache-mp eval`` with parsed arguments.

    Args:
        parser: The ``eval`` parser.
        args: Its parsed arguments.

    Returns:
        The exit status: 0, or 1 when the model or a phase failed.
    """
    config = eval_config_from_args(parser, args)
    try:
        result = evaluate(config)
    except LMCacheError as exc:
        print(f"lmcache-mp eval: error: {exc}", file=sys.stderr)
        return 1
    print(result.format())
    if args.json is not None:
        result.write_json(args.json)
        print(f"\nJSON written to {args.json}")
    if args.plot is not None and isinstance(result, EvalResult):
        result.write_plot(args.plot)
        print(f"plot written to {args.plot}")
    return 0
