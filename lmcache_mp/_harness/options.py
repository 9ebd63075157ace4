"""Command-line option types and config checks that ``lmcache-mp bench``
and ``lmcache-mp eval`` share."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence
from typing import Any

__all__ = [
    "PLOT_EXTRA_HINT",
    "TOY",
    "add_int",
    "check_count",
    "check_path",
    "fraction",
    "int_at_least",
    "name_list",
    "require_matplotlib",
]

#: The embedded toy engine's name, in both commands' ``--engine``.
TOY = "toy"

#: How to install what ``--plot`` needs.
PLOT_EXTRA_HINT = "pip install 'lmcache-mp[plot]'"


def require_matplotlib() -> None:
    """Raise unless matplotlib can be imported.

    Raises:
        ImportError: If it cannot; the message names the extra to install.
    """
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise ImportError(
            f"plotting needs matplotlib, which is not installed: {PLOT_EXTRA_HINT}"
        ) from exc


def int_at_least(least: int) -> Callable[[str], int]:
    """An argparse type: an integer at least ``least``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected an integer >= {least}, got {text!r}"
            ) from None
        if value < least:
            raise argparse.ArgumentTypeError(
                f"expected an integer >= {least}, got {value}"
            )
        return value

    return parse


def fraction(text: str) -> float:
    """An argparse type: a fraction in (0, 1].

    Raises:
        argparse.ArgumentTypeError: If ``text`` is not one.
    """
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a fraction in (0, 1], got {text!r}"
        ) from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], got {text}")
    return value


def name_list(what: str, known: Sequence[str]) -> Callable[[str], tuple[str, ...]]:
    """A parser of comma-separated names, each one of ``known``, no repeats."""

    def parse(text: str) -> tuple[str, ...]:
        names = tuple(part.strip() for part in text.split(",") if part.strip())
        if not names:
            raise argparse.ArgumentTypeError(
                f"expected one or more {what}s separated by commas, got {text!r}"
            )
        for name in names:
            if name not in known:
                raise argparse.ArgumentTypeError(
                    f"unknown {what} {name!r} (choose from {', '.join(known)})"
                )
        if len(set(names)) != len(names):
            raise argparse.ArgumentTypeError(f"a {what} is named twice in {text!r}")
        return names

    return parse


def add_int(
    group: argparse._ActionsContainer,
    flag: str,
    least: int,
    default: int | None,
    text: str,
) -> None:
    """Add an integer option ``flag`` (at least ``least``) to ``group``, its
    help ``text`` followed by the default (``None``: the option is off
    unless given, and its help says no default)."""
    group.add_argument(
        flag,
        type=int_at_least(least),
        default=default,
        metavar="N",
        help=text if default is None else f"{text} (default: {default})",
    )


def check_path(parser: argparse.ArgumentParser, flag: str, path: str | None) -> None:
    """Exit with a usage error unless ``path``'s folder exists (``None``: no
    path given)."""
    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        parser.error(f"{flag} {path}: the folder {folder} does not exist")


def check_count(owner: str, name: str, value: Any) -> None:
    """Check that ``owner.name`` (a config's field) is an int >= 1.

    Raises:
        ValueError: If it is not, naming the field and the value.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{owner}.{name} must be an int >= 1, got {value!r}")
