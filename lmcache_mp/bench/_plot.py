"""The benchmark's figure (``--plot``), drawn with matplotlib if installed."""

from __future__ import annotations

import math
import os
from typing import Any

from lmcache_mp._harness.options import require_matplotlib

__all__ = ["write_plot"]


def _median(fig: dict[str, Any] | None) -> float:
    return float("nan") if fig is None else float(fig["median"])


def _errors(fig: dict[str, Any] | None) -> tuple[float, float]:
    if fig is None:
        return 0.0, 0.0
    return fig["median"] - fig["min"], fig["max"] - fig["median"]


def _modify_bars(ax: Any, points: list[dict[str, Any]]) -> None:
    """Modify wall time, one group of bars per edit, one bar per executor."""
    edits = list(dict.fromkeys(p["edit"] for p in points))
    executors = list(dict.fromkeys(e for p in points for e in p["executors"]))
    width = 0.8 / len(executors)
    by_edit = {p["edit"]: p for p in points}
    for i, name in enumerate(executors):
        figs = [by_edit[e]["executors"].get(name, {}).get("phases") for e in edits]
        walls = [None if f is None else f["modify"]["wall_s"] for f in figs]
        low, high = zip(*(_errors(w) for w in walls), strict=True)
        ax.bar(
            [j + (i - (len(executors) - 1) / 2) * width for j in range(len(edits))],
            [_median(w) for w in walls],
            width,
            yerr=[low, high],
            capsize=3,
            label=name,
        )
    ax.set_xticks(range(len(edits)), edits)
    ax.set_xlabel("edit")
    ax.set_ylabel("modify wall time (s)")
    ax.set_title("modify phase by executor")
    ax.legend()


def _ideal(point: dict[str, Any], sweep: str) -> int:
    """The ideal speedup at a point: min(cores, streams[, workers])."""
    bound = int(point["ideal_parallelism"])
    return min(bound, point["sweep_value"]) if sweep == "workers" else bound


def _speedup_curve(ax: Any, points: list[dict[str, Any]], sweep: str) -> None:
    """Modify speedup over the serial time against the swept value."""
    top = 1.0
    for edit in dict.fromkeys(p["edit"] for p in points):
        series = [p for p in points if p["edit"] == edit]
        xs = [p["sweep_value"] for p in series]
        for name in series[0]["executors"]:
            figs = [p["executors"][name]["phases"]["modify"] for p in series]
            ys = [_median(f["serial_s"]) / _median(f["wall_s"]) for f in figs]
            top = max([top, *(y for y in ys if not math.isnan(y))])
            ax.plot(xs, ys, marker="o", label=f"{name} ({edit})")
    ideal = sorted({(p["sweep_value"], _ideal(p, sweep)) for p in points})
    ax.plot(
        [x for x, _ in ideal],
        [y for _, y in ideal],
        linestyle="--",
        color="gray",
        label="ideal",
    )
    ax.set_xlabel(sweep)
    ax.set_ylabel("modify speedup over serial time")
    ax.set_title(f"modify scaling with {sweep}")
    ax.set_ylim(0, max(top, *(y for _, y in ideal)) * 1.1)
    if sweep != "workers":
        ax.set_xscale("log", base=2)
    ax.legend()


def write_plot(result: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """Draw the benchmark's figure to an image file (PNG, SVG, PDF...).

    Without a sweep: the modify wall time per executor (one group per
    edit), with min-max error bars over repeats. With a sweep: also the
    modify speedup curve against the ideal line, per executor and edit.

    Args:
        result: The benchmark's JSON-ready result.
        path: The image file; its extension picks the format.

    Raises:
        ImportError: If matplotlib is not installed (names the extra).
        OSError: If the file cannot be written.
    """
    require_matplotlib()
    # The object API with the Agg canvas: no pyplot state, no GUI backend.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    points: list[dict[str, Any]] = result["points"]
    sweep = result["config"]["sweep"]
    fig = Figure(figsize=(12 if sweep else 6, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    if sweep:
        bars, curve = fig.subplots(1, 2)
        base = {p["edit"]: p for p in points}
        _modify_bars(bars, list(base.values()))
        bars.set_title(f"modify phase by executor ({sweep} = largest)")
        _speedup_curve(curve, points, sweep)
    else:
        _modify_bars(fig.subplots(), points)
    fig.savefig(os.fspath(path))
