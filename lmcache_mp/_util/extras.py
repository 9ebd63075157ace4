"""Optional dependencies, imported when first needed."""

from __future__ import annotations

from typing import Any

__all__ = ["import_extra"]


def import_extra(module: str, extra: str) -> Any:
    """Import an optional dependency, naming the extra that installs it.

    Raises:
        ImportError: If the module is not installed.
    """
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"{module!r} is not installed: pip install 'lmcache-mp[{extra}]'"
        ) from exc
