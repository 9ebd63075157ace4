"""Specification of the examples that compare edits: they run
on lmcache_mp with upstream 0.5.6's names, at the budget they say."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        f"example_{name}", EXAMPLES / f"{name}.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def snapkv() -> ModuleType:
    """examples/snapkv.py, imported."""
    return _example("snapkv")


def test_snapkv_example_cuts_every_edit_to_one_budget(snapkv: ModuleType) -> None:
    """random, window and snapkv each keep round(keep * T) tokens of every stream."""
    setup = snapkv.Setup(
        streams=2, prompt_tokens=128, keep=0.25, max_tokens=4, executor="thread"
    )
    rows = snapkv.compare(setup)
    assert [r[0] for r in rows] == ["random", "window", "snapkv"]
    assert {r[1] for r in rows} == {2 * 32}
    assert all(0 <= r[2] <= r[4] == 8 and 0 <= r[3] <= r[2] for r in rows)


def test_snapkv_example_agrees_fully_when_nothing_is_dropped(
    snapkv: ModuleType,
) -> None:
    """At keep 1.0 every edit keeps the whole prompt, so every decoded token equals the undropped run's."""
    setup = snapkv.Setup(
        streams=2, prompt_tokens=128, keep=1.0, max_tokens=4, executor="serial"
    )
    assert all(r[2] == r[3] == r[4] == 8 for r in snapkv.compare(setup))


def test_agreement_counts_positions_and_the_leading_run(snapkv: ModuleType) -> None:
    """Equal positions are counted everywhere; leading ones only before the first difference."""
    assert snapkv.agreement([[1, 2, 3, 4]], [[1, 9, 3, 4]]) == (3, 1)
    assert snapkv.agreement([[1, 2], [5, 6]], [[1, 2], [0, 6]]) == (3, 2)
