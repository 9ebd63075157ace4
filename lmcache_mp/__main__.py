"""The ``lmcache-mp`` command: ``bench``, ``eval`` and ``serve``.

``lmcache-mp bench`` compares the executors (see :mod:`lmcache_mp.bench`);
``lmcache-mp eval`` measures what the edits keep of a model's output
(see :mod:`lmcache_mp.eval`);
``lmcache-mp serve`` runs the embedded toy engine, or a trained model
(``--model``), behind an OpenAI-compatible HTTP server (see
:mod:`lmcache_mp.engine.http.server`). Also runnable as ``python -m lmcache_mp``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from lmcache_mp.bench import add_bench_parser, run_bench_command
from lmcache_mp.engine.http.server import add_serve_parser, run_serve_command
from lmcache_mp.eval import add_eval_parser, run_eval_command

__all__ = ["build_parser", "main"]


def build_parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """Build the top-level parser.

    Returns:
        The top-level parser and its ``bench`` subparser.
    """
    parser = argparse.ArgumentParser(
        prog="lmcache-mp",
        description="LMCache's Batched Stream SDK on a persistent process pool.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    bench = add_bench_parser(subparsers)
    # The eval's parser rides in its namespace, as build_parser returns the
    # bench's.
    evaluate = add_eval_parser(subparsers)
    evaluate.set_defaults(eval_parser=evaluate)
    add_serve_parser(subparsers)
    return parser, bench


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line.

    Args:
        argv: The arguments after the program name (default:
            ``sys.argv[1:]``).

    Returns:
        The exit status. Usage errors exit with status 2 (argparse).
    """
    parser, bench = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.command == "serve":
        return run_serve_command(args)
    try:
        if args.command == "eval":
            return run_eval_command(args.eval_parser, args)
        return run_bench_command(bench, args)
    except BrokenPipeError:
        # Output piped into a reader that left (``| head``): not an error
        # worth a traceback; stop writing to the closed pipe.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
