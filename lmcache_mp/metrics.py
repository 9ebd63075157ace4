"""The metrics report every batch phase returns, as in ``lmcache.cli.metrics``.

A :class:`Metrics` holds a title and ordered :class:`Section` s of
``(key, label, value)`` entries. Formatters turn it into text (``terminal``,
``json``, ``markdown``); handlers send that text somewhere (a stream, a file)
when :meth:`Metrics.emit` is called. :func:`summarize` reduces a list of
per-stream figures to a mean and percentiles for the batch reports.
"""

from __future__ import annotations

import abc
import inspect
import json
import math
import os
import sys
import tempfile
import textwrap
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import IO, Any, TypeVar

import numpy as np
from tabulate import tabulate

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

_MISSING: Any = object()


class Section:
    """An ordered group of ``(key, label, value)`` entries in a report.

    A section whose key is ``""`` is the report's unnamed default section:
    its entries sit at the top level of :meth:`Metrics.to_dict`.

    Args:
        key: The section's key in :meth:`Metrics.to_dict`.
        label: The heading shown by the text formatters.

    Attributes:
        key: The section's key.
        label: The section's heading.
        entries: The ``(key, label, value)`` entries, in insertion order.
    """

    def __init__(self, key: str, label: str) -> None:
        self.key = key
        self.label = label
        self.entries: list[tuple[str, str, Any]] = []

    def add(self, key: str, label: str, value: Any) -> None:
        """Append an entry.

        Args:
            key: The entry's key, unique within the section.
            label: The entry's human-readable name.
            value: The value: a number, string, ``None``, list or mapping.

        Raises:
            ValueError: If the section already has an entry ``key``.
        """
        if key in self:
            raise ValueError(f"section {self.key!r} already has an entry {key!r}")
        self.entries.append((key, label, value))

    def get(self, key: str, default: Any = _MISSING) -> Any:
        """Return the value of entry ``key``.

        Args:
            key: The entry's key.
            default: Returned when there is no such entry; without it, a
                missing entry raises.

        Returns:
            The entry's value, or ``default``.

        Raises:
            KeyError: If there is no entry ``key`` and no ``default`` was given.
        """
        for entry_key, _, value in self.entries:
            if entry_key == key:
                return value
        if default is _MISSING:
            raise KeyError(f"no entry {key!r} in section {self.key!r}")
        return default

    def __getitem__(self, key: str) -> Any:
        return self.get(key)

    def __contains__(self, key: object) -> bool:
        return any(entry[0] == key for entry in self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def to_dict(self) -> dict[str, Any]:
        """Return the entries as ``{key: value}``, JSON-serialisable.

        Returns:
            The entries in order; numpy scalars and arrays become Python
            numbers and lists, tuples become lists.
        """
        return {key: _jsonable(value) for key, _, value in self.entries}

    def __repr__(self) -> str:
        return f"Section(key={self.key!r}, label={self.label!r}, entries={len(self)})"


def _jsonable(value: Any) -> Any:
    """Return ``value`` with numpy and tuple values made plain JSON types."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return [_jsonable(item) for item in value]
    if isinstance(value, dict):
        return {str(key): _jsonable(item) for key, item in value.items()}
    return value


def _report_dict(title: str, sections: Sequence[Section]) -> dict[str, Any]:
    metrics: dict[str, Any] = {}
    for section in sections:
        if section.key:
            metrics[section.key] = section.to_dict()
        else:
            metrics.update(section.to_dict())
    return {"title": title, "metrics": metrics}


def _atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` to ``path`` so that readers see the old or new file only.

    The file is created with mode 0600 (``mkstemp``'s), like the rest of
    the files this package writes.
    """
    target = Path(path)
    fd, tmp = tempfile.mkstemp(
        dir=target.parent, prefix=f".{target.name}.", suffix=".tmp"
    )
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class MetricsFormatter(abc.ABC):
    """Turns a report's title and sections into text."""

    @abc.abstractmethod
    def format(self, title: str, sections: Sequence[Section]) -> str:
        """Render a report.

        Args:
            title: The report's title.
            sections: Its sections, the unnamed default one (key ``""``)
                first when present.

        Returns:
            The rendered text, without a trailing newline.
        """


_FormatterT = TypeVar("_FormatterT", bound=type[MetricsFormatter])
_FORMATTERS: dict[str, type[MetricsFormatter]] = {}


def register_formatter(name: str) -> Callable[[_FormatterT], _FormatterT]:
    """Return a class decorator registering a formatter under ``name``.

    Args:
        name: The name :func:`get_formatter` and :meth:`Metrics.format` take.

    Returns:
        The decorator; it returns the class unchanged.

    Raises:
        ValueError: When the decorator is applied, if another class is
            already registered under ``name``.
    """

    def decorator(cls: _FormatterT) -> _FormatterT:
        registered = _FORMATTERS.get(name)
        if registered is not None and registered is not cls:
            raise ValueError(
                f"format {name!r} is already registered to {registered.__name__}"
            )
        _FORMATTERS[name] = cls
        return cls

    return decorator


def available_formats() -> tuple[str, ...]:
    """Return the registered format names, sorted.

    Returns:
        The names :func:`get_formatter` accepts.
    """
    return tuple(sorted(_FORMATTERS))


def get_formatter(name: str, **kwargs: Any) -> MetricsFormatter:
    """Build the formatter registered under ``name``.

    Args:
        name: A registered format name, e.g. ``"terminal"``.
        **kwargs: Options; only those the formatter's constructor accepts
            are passed (so ``width`` can be given to any format).

    Returns:
        A new formatter.

    Raises:
        ValueError: If no formatter is registered under ``name``; the
            message lists the available names.
    """
    cls = _FORMATTERS.get(name)
    if cls is None:
        available = ", ".join(available_formats())
        raise ValueError(f"unknown format {name!r}; available: {available}")
    params = inspect.signature(cls).parameters.values()
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        accepted = {p.name for p in params}
        kwargs = {key: value for key, value in kwargs.items() if key in accepted}
    return cls(**kwargs)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _format_number(value: float) -> str:
    if isinstance(value, int):
        return f"{value:,}"
    # 4 significant digits, but large finite figures (throughputs) keep
    # their integer part and two decimals.
    if math.isfinite(value) and 1e3 <= abs(value) < 1e15:
        return f"{value:,.2f}"
    return f"{value:.4g}"


def _format_value(value: Any) -> str:
    """Render one value for the text formatters."""
    value = _jsonable(value)
    if value is None:
        return "N/A"
    if _is_number(value):
        return _format_number(value)
    if isinstance(value, list):
        if not value:
            return "N/A (n=0)"
        if all(_is_number(item) for item in value):
            numbers = [float(item) for item in value]
            return (
                f"n={len(numbers)}, mean {_format_number(sum(numbers) / len(numbers))},"
                f" min {_format_number(min(numbers))},"
                f" max {_format_number(max(numbers))}"
            )
        return ", ".join(_format_value(item) for item in value)
    if isinstance(value, dict):
        return ", ".join(f"{key}={_format_value(item)}" for key, item in value.items())
    return str(value)


def _shorten(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(width - 3, 0)] + "..."


def _banner(text: str, width: int, fill: str) -> str:
    if not text:
        return fill * width
    return f" {_shorten(text, width - 2)} ".center(width, fill)


def _wrap(text: str, width: int) -> str:
    lines = textwrap.wrap(text, width=width, break_on_hyphens=False)
    return "\n".join(lines)


@register_formatter("terminal")
class TerminalFormatter(MetricsFormatter):
    """Plain-text tables for a terminal, no line wider than ``width``.

    Numbers show 4 significant digits, except finite values from 1,000 up
    which show a thousands separator and two decimals (``12,345.68``);
    integers show a thousands separator; ``None`` shows ``N/A``; a list of
    numbers shows its count, mean, min and max. Long labels and values wrap.

    Args:
        width: The width of every line, in characters; at least 20.

    Raises:
        ValueError: If ``width`` is below 20.
    """

    MIN_WIDTH = 20
    _INDENT = "  "
    _SEPARATOR = 2  # tabulate's "plain" format puts two spaces between columns

    def __init__(self, width: int = 80) -> None:
        if width < self.MIN_WIDTH:
            raise ValueError(f"width must be at least {self.MIN_WIDTH}, got {width}")
        self.width = width

    def format(self, title: str, sections: Sequence[Section]) -> str:
        """Render a title banner, then a heading and a table per section."""
        lines = [_banner(title, self.width, "=")]
        for section in sections:
            if section.key or section.label:
                lines.append(_banner(section.label or section.key, self.width, "-"))
            if section.entries:
                lines.extend(self._table(section))
        lines.append("=" * self.width)
        return "\n".join(lines)

    def _table(self, section: Section) -> list[str]:
        labels = [label for _, label, _ in section.entries]
        values = [_format_value(value) for _, _, value in section.entries]
        room = self.width - len(self._INDENT) - self._SEPARATOR
        label_width = max(len(label) for label in labels)
        value_width = max(len(value) for value in values)
        # Labels keep their width up to half the room; values take the rest.
        label_cap = max(min(label_width, max(room - value_width, room // 2)), 1)
        value_cap = max(room - label_cap, 1)
        rows = [
            [_wrap(label, label_cap), _wrap(value, value_cap)]
            for label, value in zip(labels, values, strict=True)
        ]
        table = tabulate(
            rows, tablefmt="plain", colalign=("left", "right"), disable_numparse=True
        )
        return [self._INDENT + line for line in table.splitlines()]


@register_formatter("json")
class JSONFormatter(MetricsFormatter):
    """The :meth:`Metrics.to_dict` shape as JSON text.

    Values JSON cannot represent are written as their ``str()``.

    Args:
        indent: Indentation of the JSON text; ``None`` for one line.
    """

    def __init__(self, indent: int | None = 2) -> None:
        self.indent = indent

    def format(self, title: str, sections: Sequence[Section]) -> str:
        """Render ``{"title": ..., "metrics": {...}}`` as JSON text."""
        return json.dumps(
            _report_dict(title, sections), indent=self.indent, default=str
        )


def _markdown_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


@register_formatter("markdown")
class MarkdownFormatter(MetricsFormatter):
    """GitHub-flavoured markdown: a heading and a table per section."""

    def format(self, title: str, sections: Sequence[Section]) -> str:
        """Render ``## title``, then per section ``### label`` and a table."""
        lines = [f"## {title}"]
        for section in sections:
            if section.key or section.label:
                lines += ["", f"### {section.label or section.key}"]
            if section.entries:
                lines += ["", "| Metric | Value |", "| --- | ---: |"]
                for _, label, value in section.entries:
                    cells = (
                        _markdown_cell(label),
                        _markdown_cell(_format_value(value)),
                    )
                    lines.append("| {} | {} |".format(*cells))
        return "\n".join(lines)


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
        _atomic_write_text(self.path, self.formatter.format(title, sections) + "\n")


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
        return _report_dict(self._title, self.sections)

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
