"""A report's section: ordered ``(key, label, value)`` entries."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["Section", "jsonable", "report_dict"]

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
        return {key: jsonable(value) for key, _, value in self.entries}

    def __repr__(self) -> str:
        return f"Section(key={self.key!r}, label={self.label!r}, entries={len(self)})"


def jsonable(value: Any) -> Any:
    """Return ``value`` with numpy and tuple values made plain JSON types."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return [jsonable(item) for item in value]
    if isinstance(value, dict):
        return {str(key): jsonable(item) for key, item in value.items()}
    return value


def report_dict(title: str, sections: Sequence[Section]) -> dict[str, Any]:
    metrics: dict[str, Any] = {}
    for section in sections:
        if section.key:
            metrics[section.key] = section.to_dict()
        else:
            metrics.update(section.to_dict())
    return {"title": title, "metrics": metrics}
