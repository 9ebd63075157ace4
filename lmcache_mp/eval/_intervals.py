"""Bootstrap confidence intervals for the eval's per-sample figures."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["Interval", "bootstrap", "samples_for"]

#: Resamples of a bootstrap: the percentiles of a 95% interval then move by
#: well under a tenth of its width from one seed to another.
RESAMPLES = 10_000


@dataclass(frozen=True)
class Interval:
    """A mean over samples, with its confidence interval.

    Args:
        mean: The mean.
        low: The interval's lower end.
        high: Its upper end.
        n: Samples it is over.
        level: Its confidence level.
    """

    mean: float
    low: float
    high: float
    n: int
    level: float = 0.95

    def __str__(self) -> str:
        """``mean [low, high]``, three decimals."""
        return f"{self.mean:.3f} [{self.low:.3f}, {self.high:.3f}]"

    def to_dict(self) -> dict[str, float | int]:
        """The fields as JSON-ready data."""
        return {
            "mean": self.mean,
            "low": self.low,
            "high": self.high,
            "n": self.n,
            "level": self.level,
        }


def bootstrap(
    values: Sequence[float],
    baseline: Sequence[float] | None = None,
    *,
    level: float = 0.95,
    resamples: int = RESAMPLES,
    seed: int = 0,
) -> Interval:
    """The percentile bootstrap interval of a mean (Efron, 1979).

    The samples are drawn with replacement ``resamples`` times; the
    interval's ends are the ``(1 - level) / 2`` and ``(1 + level) / 2``
    quantiles of the resampled means. With ``baseline``, the pairs are
    resampled together and the interval is of the mean difference
    ``values - baseline`` (a paired comparison: each sample's own
    difficulty cancels).

    Args:
        values: One figure per sample (e.g. 1/0 for right/wrong).
        baseline: The same samples' figures under the reference, or
            ``None``.
        level: Confidence level, in ``(0, 1)``.
        resamples: Bootstrap resamples.
        seed: Seed of the resampling.

    Returns:
        The mean (or mean difference) and its interval.

    Raises:
        ValueError: If ``values`` is empty, ``baseline`` has another
            length, or ``level`` or ``resamples`` is out of range.
    """
    data = np.asarray(values, dtype=np.float64)
    if data.ndim != 1 or data.size == 0:
        raise ValueError(f"bootstrap needs a non-empty 1-D sample, got {data.shape}")
    if baseline is not None:
        base = np.asarray(baseline, dtype=np.float64)
        if base.shape != data.shape:
            raise ValueError(
                f"bootstrap: baseline has {base.size} samples, values {data.size}"
            )
        data = data - base
    if not 0.0 < level < 1.0:
        raise ValueError(f"bootstrap: level must be in (0, 1), got {level!r}")
    if isinstance(resamples, bool) or not isinstance(resamples, int) or resamples < 1:
        raise ValueError(f"bootstrap: resamples must be an int >= 1, got {resamples!r}")
    rng = np.random.default_rng(seed)
    means = np.empty(resamples, dtype=np.float64)
    # In blocks, so that a large sample does not draw every index at once.
    block = max(1, (1 << 22) // data.size)
    for start in range(0, resamples, block):
        rows = min(block, resamples - start)
        picks = rng.integers(0, data.size, size=(rows, data.size))
        means[start : start + rows] = data[picks].mean(axis=1)
    tail = (1.0 - level) / 2.0
    low, high = np.quantile(means, [tail, 1.0 - tail])
    return Interval(float(data.mean()), float(low), float(high), int(data.size), level)


def samples_for(half_width: float, level: float = 0.95) -> int:
    """Samples that give an accuracy's interval at most ``half_width`` on
    each side at ``level``, whatever the accuracy (the worst case, 0.5,
    under the normal approximation: ``z^2 / (4 h^2)``).

    Args:
        half_width: Half the interval's width, in ``(0, 0.5]``.
        level: Confidence level, in ``(0, 1)``.

    Returns:
        The number of samples.
    """
    z = statistics.NormalDist().inv_cdf((1.0 + level) / 2.0)
    return math.ceil(z * z / (4.0 * half_width * half_width))
