"""An edit without its GIL hint, for the bench's ``auto-unhinted`` runs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lmcache_mp.edits import Edit

__all__ = ["Unhinted"]


@dataclass(frozen=True)
class Unhinted:
    """Calls ``edit`` unchanged, but carries no ``gil_bound``/``releases_gil``
    hint, so that ``executor="auto"`` measures it as it would a user's fn.

    Args:
        edit: The ready-made edit to run.
    """

    edit: Edit

    def __call__(self, kv: Any, tokens: Any) -> Any:
        """Return ``edit(kv, tokens)``."""
        return self.edit(kv, tokens)
