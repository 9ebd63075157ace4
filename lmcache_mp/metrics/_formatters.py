"""Formatters: how a report is rendered (terminal table, JSON, markdown)."""

from __future__ import annotations

import abc
import inspect
import json
import math
import textwrap
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from tabulate import tabulate

from lmcache_mp.metrics._section import Section, jsonable, report_dict

__all__ = [
    "JSONFormatter",
    "MarkdownFormatter",
    "MetricsFormatter",
    "TerminalFormatter",
    "available_formats",
    "get_formatter",
    "register_formatter",
]


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
    value = jsonable(value)
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
        if isinstance(width, bool) or not isinstance(width, int):
            raise ValueError(f"width must be an int >= {self.MIN_WIDTH}, got {width!r}")
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
        return json.dumps(report_dict(title, sections), indent=self.indent, default=str)


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
