"""Optional dependencies, imported when first needed."""

from __future__ import annotations

from typing import Any

__all__ = ["import_extra"]


def import_extra(module: str, extra: str) -> Any:
    """Import an optional engine, naming the extra that installs it.

    Raises:
        ImportError: If the module is not installed.
    """
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"executor {extra!r} needs {module!r}: pip install 'lmcache-mp[{extra}]'"
        ) from exc
