"""The ``lmcache-mp`` command: ``bench``, ``eval``, ``serve`` and ``stores``.

``lmcache-mp bench`` compares the executors (see :mod:`lmcache_mp.bench`);
``lmcache-mp eval`` measures what the edits keep of a model's output
(see :mod:`lmcache_mp.eval`);
``lmcache-mp serve`` runs the embedded toy engine, or a trained model
(``--model``), behind an OpenAI-compatible HTTP server (see
:mod:`lmcache_mp.engine.http.server`); ``lmcache-mp stores`` lists this
user's shared-memory stores, reaps what dead processes left, and removes a
named store. Also runnable as ``python -m lmcache_mp``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

import tabulate

from lmcache_mp.bench import add_bench_parser, run_bench_command
from lmcache_mp.engine.http.server import add_serve_parser, run_serve_command
from lmcache_mp.errors import KVConfigError, KVStoreError
from lmcache_mp.eval import add_eval_parser, run_eval_command
from lmcache_mp.kv import list_stores, reap_stores, remove_store

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
    _add_stores_parser(subparsers)
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
    if args.command == "stores":
        return _run_stores_command(args)
    try:
        if args.command == "eval":
            return run_eval_command(args.eval_parser, args)
        return run_bench_command(bench, args)
    except BrokenPipeError:
        # Output piped into a reader that left (``| head``): not an error
        # worth a traceback; stop writing to the closed pipe.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _add_stores_parser(subparsers: Any) -> None:
    root = argparse.ArgumentParser(add_help=False)
    root.add_argument(
        "--root",
        metavar="DIR",
        help="list the file:// stores under DIR (default: this user's "
        "shm:/// stores and pool directories)",
    )
    stores = subparsers.add_parser(
        "stores",
        parents=[root],
        help="list, reap or remove this user's shared-memory stores",
        description="List this user's shared-memory stores; --reap removes "
        "what dead processes left (temporary stores, pool directories, "
        "pins), a dry run unless --yes.",
    )
    stores.add_argument(
        "--reap", action="store_true", help="find what dead processes left"
    )
    stores.add_argument(
        "--yes", action="store_true", help="with --reap: remove it (else a dry run)"
    )
    actions = stores.add_subparsers(dest="stores_command", metavar="ACTION")
    rm = actions.add_parser(
        "rm",
        parents=[root],
        help="destroy a named store",
        description=(
            "Destroy a named store (shm:///NAME, or a directory under --root)."
        ),
    )
    rm.add_argument("name", metavar="NAME")


def _run_stores_command(args: argparse.Namespace) -> int:
    try:
        if args.stores_command == "rm":
            print(f"removed {remove_store(args.name, args.root)}")
            return 0
        if args.reap:
            found = reap_stores(args.root, act=args.yes)
            verb = "removed" if args.yes else "would remove"
            for line in found:
                print(f"{verb} {line}")
            if not found:
                print("nothing to reap")
            elif not args.yes:
                print("(a dry run: --yes removes them)")
            return 0
        rows = [
            [
                s.name,
                "temporary" if s.temporary else "named",
                s.bytes,
                s.chunks,
                "-" if s.owner_pid is None else s.owner_pid,
                "-"
                if s.owner_alive is None
                else ("alive" if s.owner_alive else "dead"),
                s.pinned_bytes,
                ", ".join(s.pinned_by) or "-",
                s.stale_pins,
            ]
            for s in list_stores(args.root)
        ]
    except (KVConfigError, KVStoreError, OSError) as exc:
        print(f"lmcache-mp stores: error: {exc}", file=sys.stderr)
        return 1
    headers = [
        "name",
        "kind",
        "bytes",
        "chunks",
        "owner",
        "owner is",
        "pinned bytes",
        "pinned by",
        "stale pins",
    ]
    print(tabulate.tabulate(rows, headers=headers) if rows else "no stores")
    return 0


if __name__ == "__main__":
    sys.exit(main())
