"""``lmcache-mp eval --tasks``: RULER-style accuracy per task and length,
with confidence intervals.

Each task x length cell's prompts (:mod:`lmcache_mp.eval._tasks`) are
answered greedily by the uncompressed model first; only the cells it
solves at least ``min_accuracy`` of the time are then run with every edit
at every keep (an edit cannot be judged on a task the model cannot do),
each over a copy of the uncompressed KV under its own salt, as the
document eval runs them. Every accuracy comes with its 95% bootstrap
interval over the samples, and each edit's change against the
uncompressed model with the paired interval (the same prompts).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from lmcache_mp.eval._config import EvalConfig
from lmcache_mp.eval._intervals import Interval
from lmcache_mp.eval._table import page, write_json

__all__ = ["ANSWER_TOKENS", "TASKS_SCHEMA", "TaskRow", "TasksResult"]

#: The ``schema`` of :meth:`TasksResult.to_dict`.
TASKS_SCHEMA = "lmcache-mp-eval-tasks/1"
#: Tokens decoded as each task's answer: enough for what it asks (one
#: 7-digit number or UUID; four, of one key or of four; five variable names;
#: ten or three words).
ANSWER_TOKENS = {
    "niah_single": 12,
    "niah_single_2": 12,
    "niah_single_3": 40,
    "niah_multikey": 12,
    "niah_multivalue": 48,
    "niah_multiquery": 64,
    "vt": 32,
    "cwe": 64,
    "fwe": 24,
}


@dataclass(frozen=True)
class TaskRow:
    """One edit at one keep on one task x length cell (``edit="none"``: the
    uncompressed model).

    Args:
        task: The task's name.
        length: Most tokens of its prompts.
        edit: The edit's name.
        keep: The ``keep`` it was built with (``None`` for ``none``).
        scores: Each sample's score, the share of its answers stated.
        accuracy: Their mean, with its interval.
        change: For an edit, the mean change of the score against the
            uncompressed model on the same samples, with its paired
            interval.
        kept: Mean fraction of each prompt's tokens kept.
        modify_s: Modify wall time of the cell's streams, in seconds; for
            kvpress, its contexts' prefills with the press inside them.
        by: ``"lmcache_mp"``, or ``"kvpress"`` and the press's class name
            for a row of ``compare`` (its ``edit`` the lmcache_mp edit it
            is set beside).
        answer_s: Wall time of answering the cell's prompts, in seconds:
            the decode phase (for the uncompressed row, the prompts'
            prefill with it); for kvpress, each prompt's tail and answer.
    """

    task: str
    length: int
    edit: str
    keep: float | None
    scores: list[float]
    accuracy: Interval
    change: Interval | None = None
    kept: float = 1.0
    modify_s: float | None = None
    by: str = "lmcache_mp"
    answer_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """The row, JSON-ready (the per-sample scores included)."""
        data = dataclasses.asdict(self)
        data["accuracy"] = self.accuracy.to_dict()
        data["change"] = None if self.change is None else self.change.to_dict()
        return data


@dataclass(frozen=True)
class TasksResult:
    """What ``lmcache-mp eval --tasks`` measured.

    Args:
        config: The eval.
        rows: Each scored cell's rows: its uncompressed row, then every
            edit's.
        dropped: The uncompressed rows of the cells the model does not
            solve ``min_accuracy`` of the time, which no edit ran on.
        tokens: Mean prompt tokens per ``"task@length"``.
        duration_s: Wall time of the whole eval (model load included).
        created_utc: When it started (ISO 8601).
    """

    config: EvalConfig
    rows: list[TaskRow]
    dropped: list[TaskRow]
    tokens: dict[str, float]
    duration_s: float
    created_utc: str

    def format(self) -> str:
        """The table as printed: one line per cell, edit and keep.

        Returns:
            The title, the table, the dropped cells and what the columns
            mean.
        """
        cfg = self.config
        headers = ["task", "length", "edit", "keep", "by", "kept"]
        headers += ["accuracy [95% CI]"]
        headers += ["change vs none [95% CI]", "n", f"modify {cfg.executor} (s)"]
        table = [
            [
                r.task,
                f"{self.tokens[f'{r.task}@{r.length}']:.0f}",
                r.edit,
                "-" if r.keep is None else f"{r.keep:g}",
                r.by,
                f"{r.kept:.2f}",
                str(r.accuracy),
                "-"
                if r.change is None
                else f"{r.change.mean:+.3f} "
                f"[{r.change.low:+.3f}, {r.change.high:+.3f}]",
                str(r.accuracy.n),
                "-" if r.modify_s is None else f"{r.modify_s:.2f}",
            ]
            for r in self.rows
        ]
        title = (
            f"lmcache-mp eval --tasks: {cfg.engine}, {cfg.sample_count} samples "
            f"per task and length, {cfg.executor} executor; "
            f"{self.duration_s:.0f} s"
        )
        note = (
            "accuracy: mean share of each prompt's answers its greedy answer "
            "states, with its 95% bootstrap interval over the n samples; "
            "change: against the uncompressed model on the same samples "
            "(paired interval); length: mean prompt tokens"
        )
        if cfg.compare:
            note += (
                "; kvpress rows: its press in the context's prefill (the "
                "prompt's chunk-aligned prefix, as the edits are given), "
                "original positions, their time that prefill's; change "
                "against kvpress's own uncompressed row"
            )
        dropped = [
            f"not scored: {r.task} at {r.length} tokens, where the uncompressed "
            f"model's accuracy is {r.accuracy} (below {cfg.min_accuracy:g})"
            for r in self.dropped
        ]
        text = page(title, headers, table, note)
        return "\n".join([text, *dropped, self._time_spent()])

    def _time_spent(self) -> str:
        """Where the wall time went, summed over the rows."""
        rows = [*self.rows, *self.dropped]
        plain = [r for r in rows if r.by == "lmcache_mp"]
        pressed = [r for r in rows if r.by != "lmcache_mp"]
        parts = {
            "the uncompressed prefill and answers": sum(
                r.answer_s for r in plain if r.edit == "none"
            ),
            "the edits' modify": sum(r.modify_s or 0.0 for r in plain),
            "their answers": sum(r.answer_s for r in plain if r.edit != "none"),
        }
        if pressed:
            parts["kvpress's prefills"] = sum(r.modify_s or 0.0 for r in pressed)
            parts["its answers"] = sum(r.answer_s for r in pressed)
        parts["the rest (model load, KV copies)"] = self.duration_s - sum(
            parts.values()
        )
        spent = "; ".join(f"{what} {s:.0f} s" for what, s in parts.items())
        return f"time: {self.duration_s:.0f} s in all: {spent}"

    def to_dict(self) -> dict[str, Any]:
        """The result, JSON-ready::

        {"schema": "lmcache-mp-eval-tasks/1", "created_utc": str,
         "duration_s": float, "config": {EvalConfig fields},
         "tokens": {"task@length": float},
         "rows": [{TaskRow fields, scores per sample}], "dropped": [...]}
        """
        return {
            "schema": TASKS_SCHEMA,
            "created_utc": self.created_utc,
            "duration_s": self.duration_s,
            "config": self.config.to_dict(),
            "tokens": self.tokens,
            "rows": [r.to_dict() for r in self.rows],
            "dropped": [r.to_dict() for r in self.dropped],
        }

    def write_json(self, path: str | os.PathLike[str]) -> None:
        """Write :meth:`to_dict` as JSON, replacing ``path`` atomically."""
        write_json(path, self.to_dict())
