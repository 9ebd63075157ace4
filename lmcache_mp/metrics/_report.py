"""The :class:`Metrics` report, its handlers and :func:`summarize`."""

from __future__ import annotations

import abc
import math
import os
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import IO, Any

from lmcache_mp._util.paths import atomic_write_text
from lmcache_mp.metrics._formatters import (
    JSONFormatter,
    MarkdownFormatter,
    MetricsFormatter,
    TerminalFormatter,
    available_formats,
    get_formatter,
    register_formatter,
)
from lmcache_mp.metrics._section import Section, report_dict

__all__ = [
    "FileHandler",
    "JSONFormatter",
    "MarkdownFormatter",
    "Metrics",
    "MetricsFormatter",
    "MetricsHandler",
    "Section",
    "StreamHandler",
    "TerminalFormatter",
    "available_formats",
    "get_formatter",
    "register_formatter",
    "summarize",
]


class MetricsHandler(abc.ABC):
    """Sends a rendered report somewhere when it is emitted.

    Args:
        formatter: Renders the report for this handler.
    """

    def __init__(self, formatter: MetricsFormatter) -> None:
        self.formatter = formatter

    @abc.abstractmethod
    def emit(self, title: str, sections: Sequence[Section]) -> None:
        """Render and deliver a report.

        Args:
            title: The report's title.
            sections: Its sections.
        """


class StreamHandler(MetricsHandler):
    """Writes the report, then a newline, to a text stream.

    Args:
        formatter: Defaults to a :class:`TerminalFormatter`.
        stream: Defaults to ``sys.stdout`` as it is at each emit (so that
            redirection and capture work, and the handler pickles).
    """

    def __init__(
        self, formatter: MetricsFormatter | None = None, stream: IO[str] | None = None
    ) -> None:
        super().__init__(formatter or TerminalFormatter())
        self.stream = stream

    def emit(self, title: str, sections: Sequence[Section]) -> None:
        """Write the rendered report to the stream and flush it."""
        stream = self.stream if self.stream is not None else sys.stdout
        stream.write(self.formatter.format(title, sections) + "\n")
        stream.flush()


class FileHandler(MetricsHandler):
    """Writes the report to a file, replacing it atomically.

    Args:
        path: The file to write; its directory must exist.
        formatter: Defaults to a :class:`JSONFormatter`.
    """

    def __init__(
        self, path: str | os.PathLike[str], formatter: MetricsFormatter | None = None
    ) -> None:
        super().__init__(formatter or JSONFormatter())
        self.path = Path(path)

    def emit(self, title: str, sections: Sequence[Section]) -> None:
        """Write the rendered report to a temp file, then rename it over the file."""
        atomic_write_text(self.path, self.formatter.format(title, sections) + "\n")


class Metrics:
    """A titled report of sections of metrics.

    Args:
        title: The report's title.
    """

    def __init__(self, title: str) -> None:
        self._title = title
        self._default = Section("", "")
        self._sections: dict[str, Section] = {}
        self._handlers: list[MetricsHandler] = []

    def title(self, new_title: str | None = None) -> str:
        """Set the title, when given, and return the current one.

        Args:
            new_title: The new title; ``None`` leaves it unchanged.

        Returns:
            The title after the call.
        """
        if new_title is not None:
            self._title = new_title
        return self._title

    def add_handler(self, handler: MetricsHandler) -> None:
        """Register a handler that :meth:`emit` will call.

        Args:
            handler: The handler.
        """
        self._handlers.append(handler)

    @property
    def handlers(self) -> tuple[MetricsHandler, ...]:
        """The registered handlers, in order."""
        return tuple(self._handlers)

    def add_section(self, key: str, label: str) -> Section:
        """Append a named section.

        Args:
            key: The section's key in :meth:`to_dict`; non-empty, unique and
                distinct from the keys of the unnamed section's entries.
            label: The section's heading.

        Returns:
            The new, empty section.

        Raises:
            ValueError: If ``key`` is empty or already used.
        """
        if not key:
            raise ValueError("a section key must be a non-empty string")
        if key in self._sections or key in self._default:
            raise ValueError(f"report {self._title!r} already has a key {key!r}")
        section = Section(key, label)
        self._sections[key] = section
        return section

    def __getitem__(self, key: str) -> Section:
        try:
            return self._sections[key]
        except KeyError:
            raise KeyError(f"report {self._title!r} has no section {key!r}") from None

    def __contains__(self, key: object) -> bool:
        return key in self._sections

    def add(self, key: str, label: str, value: Any) -> None:
        """Add an entry to the unnamed section, shown before the named ones.

        Args:
            key: The entry's key, at the top level of :meth:`to_dict`.
            label: The entry's human-readable name.
            value: The value.

        Raises:
            ValueError: If ``key`` is already an entry or a section key.
        """
        if key in self._sections:
            raise ValueError(f"report {self._title!r} already has a section {key!r}")
        self._default.add(key, label, value)

    @property
    def sections(self) -> tuple[Section, ...]:
        """The sections in display order; the unnamed one first, if non-empty."""
        named = tuple(self._sections.values())
        return (self._default, *named) if self._default.entries else named

    def emit(self) -> None:
        """Call every handler, in order, with the report.

        Without handlers, prints the terminal rendering to ``sys.stdout``.
        """
        for handler in self._handlers or [StreamHandler()]:
            handler.emit(self._title, self.sections)

    def to_dict(self) -> dict[str, Any]:
        """Return the report as plain, JSON-serialisable data.

        Returns:
            ``{"title": title, "metrics": {...}}`` where ``metrics`` holds
            the unnamed section's entries at the top level, then each named
            section as ``{section_key: {key: value}}``, all in order.
        """
        return report_dict(self._title, self.sections)

    def to_json(self, path: str | os.PathLike[str]) -> None:
        """Write the JSON form of the report to ``path`` atomically.

        Args:
            path: The file to write; its directory must exist.

        Raises:
            OSError: If the file cannot be written.
        """
        FileHandler(path, JSONFormatter()).emit(self._title, self.sections)

    def format(self, fmt: str = "terminal", width: int = 80) -> str:
        """Render the report with a registered formatter.

        Args:
            fmt: The format name (see :func:`available_formats`).
            width: The line width, for formats that take one.

        Returns:
            The rendered text.

        Raises:
            ValueError: If ``fmt`` is unknown or ``width`` is invalid.
        """
        return get_formatter(fmt, width=width).format(self._title, self.sections)

    def __str__(self) -> str:
        return self.format()

    def __repr__(self) -> str:
        keys = [section.key for section in self.sections]
        return f"Metrics(title={self._title!r}, sections={keys!r})"


def summarize(
    values: Iterable[float], percentiles: Iterable[float] = (50, 90, 99)
) -> dict[str, float]:
    """Return the mean and percentiles of ``values``.

    Percentiles use linear interpolation between closest ranks (numpy's
    default ``"linear"`` method): the p-th percentile of n sorted values
    sits at fractional index ``p / 100 * (n - 1)``.

    Args:
        values: The figures; numpy scalars and arrays are accepted.
        percentiles: The percentiles to report, each in ``[0, 100]``.

    Returns:
        ``{"mean": ..., "p50": ..., ...}`` with one ``p<percentile>`` key per
        requested percentile (``p99.9`` for 99.9); all ``0.0`` when
        ``values`` is empty.

    Raises:
        ValueError: If a percentile is outside ``[0, 100]`` or a value is NaN.
    """
    ordered = sorted(float(value) for value in values)
    if any(math.isnan(value) for value in ordered):
        raise ValueError("cannot summarize NaN values")
    points = [float(p) for p in percentiles]
    for point in points:
        if not 0.0 <= point <= 100.0:
            raise ValueError(f"percentile {point:g} is outside [0, 100]")
    result = {"mean": math.fsum(ordered) / len(ordered) if ordered else 0.0}
    for point in points:
        result[f"p{point:g}"] = _percentile(ordered, point)
    return result


def _percentile(ordered: list[float], point: float) -> float:
    if not ordered:
        return 0.0
    rank = point / 100.0 * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)
