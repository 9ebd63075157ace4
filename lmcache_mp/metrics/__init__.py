"""The metrics report every batch phase returns, as in ``lmcache.cli.metrics``.

A :class:`Metrics` holds a title and ordered :class:`Section` s of
``(key, label, value)`` entries. Formatters turn it into text (``terminal``,
``json``, ``markdown``); handlers send that text somewhere (a stream, a file)
when :meth:`Metrics.emit` is called. :func:`summarize` reduces a list of
per-stream figures to a mean and percentiles for the batch reports.
"""

from lmcache_mp.metrics._report import (
    FileHandler,
    JSONFormatter,
    MarkdownFormatter,
    Metrics,
    MetricsFormatter,
    MetricsHandler,
    Section,
    StreamHandler,
    TerminalFormatter,
    available_formats,
    get_formatter,
    register_formatter,
    summarize,
)

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
