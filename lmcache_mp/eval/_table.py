"""``lmcache-mp eval``'s result: the table, the JSON and the plot."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any

from tabulate import tabulate

from lmcache_mp._harness.options import require_matplotlib
from lmcache_mp._util.paths import atomic_write_text
from lmcache_mp.eval._config import EvalConfig

__all__ = ["EVAL_SCHEMA", "EvalResult", "EvalRow", "page", "write_json"]

#: The ``schema`` of :meth:`EvalResult.to_dict`.
EVAL_SCHEMA = "lmcache-mp-eval/1"


@dataclass(frozen=True)
class EvalRow:
    """One edit at one keep (``edit="none"``: the uncompressed run).

    Args:
        edit: The edit's name.
        keep: The ``keep`` it was built with.
        kept: Mean fraction of each prompt's tokens it kept (its protected
            tokens may add to ``keep``).
        agreement: Teacher-forced top-1 agreement with the reference
            continuation, over every position of every document.
        kl: Mean ``KL(p_ref || p_edit)`` of the next-token distributions
            over the same positions, in nats.
        passkey: Fraction of the haystacks whose greedy answer states the key.
        modify_s: Modify wall time on the eval's executor, in seconds; for
            kvpress, its contexts' prefills with the press inside them.
        thread_modify_s: The same edit's modify wall time on threads.
        by: ``"lmcache_mp"``, or ``"kvpress"`` and the press's class name
            for a row of ``compare`` (its ``edit`` the lmcache_mp edit it
            is set beside).
    """

    edit: str
    keep: float
    kept: float
    agreement: float
    kl: float
    passkey: float
    modify_s: float | None = None
    thread_modify_s: float | None = None
    by: str = "lmcache_mp"


def page(title: str, headers: list[str], table: list[list[str]], note: str) -> str:
    """A result as printed: its title, its table, what the columns mean."""
    body = tabulate(table, headers=headers, disable_numparse=True)
    return "\n".join([title, "", body, "", note])


def write_json(path: str | os.PathLike[str], data: dict[str, Any]) -> None:
    """Write ``data`` as indented JSON, replacing ``path`` atomically.

    Raises:
        OSError: If the file cannot be written.
    """
    atomic_write_text(path, json.dumps(data, indent=2) + "\n")


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


@dataclass(frozen=True)
class EvalResult:
    """What ``lmcache-mp eval`` measured.

    Args:
        config: The eval.
        rows: The uncompressed run, then each edit at each keep.
        prompt_tokens: Mean prompt tokens, ``{"documents": ..,
            "passkey": ..}``.
        duration_s: Wall time of the whole eval (model load included).
        created_utc: When it started (ISO 8601).
    """

    config: EvalConfig
    rows: list[EvalRow]
    prompt_tokens: dict[str, float]
    duration_s: float
    created_utc: str

    def format(self) -> str:
        """The table as printed: one line per edit and keep.

        Returns:
            The title, the table and what its columns mean.
        """
        cfg = self.config
        executor = cfg.executor
        headers = [
            "edit",
            "keep",
            "kept",
            "top-1 agree",
            "KL (nats)",
            "passkey",
            f"modify {executor} (s)",
            "modify thread (s)",
        ]
        table = [
            [
                r.edit,
                f"{r.keep:g}",
                f"{r.kept:.2f}",
                f"{r.agreement:.3f}",
                f"{r.kl:.3f}",
                f"{r.passkey:.2f}",
                _seconds(r.modify_s),
                _seconds(r.thread_modify_s),
            ]
            for r in self.rows
        ]
        if executor == "thread":
            # One run on threads: its time is both columns.
            headers.pop()
            table = [row[:-1] for row in table]
        if cfg.compare:
            headers.insert(2, "by")
            for row, r in zip(table, self.rows, strict=True):
                row.insert(2, r.by)
        tokens = self.prompt_tokens
        title = (
            f"lmcache-mp eval: {cfg.engine}, {cfg.prompts} documents "
            f"(~{tokens['documents']:.0f} tokens) scored on their "
            f"{cfg.continuation}-token greedy continuation, {cfg.prompts} "
            f"passkey haystacks (~{tokens['passkey']:.0f} tokens); "
            f"{self.duration_s:.0f} s"
        )
        if cfg.rerotate is not None:
            title += f"; rerotate={cfg.rerotate} for every edit"
        note = (
            "top-1 agree / KL: teacher-forced over the uncompressed run's "
            "continuation (KL(p_ref || p_edit), llama.cpp's --kl-divergence); "
            "passkey: greedy answers stating the hidden number; kept: tokens "
            "kept / prompt tokens"
        )
        if cfg.compare:
            note += (
                "; kvpress rows: its press in the context's prefill (the "
                "prompt's chunk-aligned prefix, as the edits are given), "
                "original positions, their time that prefill's"
            )
        if cfg.server is not None:
            title += f"; served at {cfg.server}"
            # OpenAICompletions.score: the server lists its top tokens only.
            note += (
                "; through the server, KL is taken over its top-20 tokens per "
                "position, the rest of the mass spread evenly (top-1 exact)"
            )
        return page(title, headers, table, note)

    def to_dict(self) -> dict[str, Any]:
        """The result, JSON-ready::

        {"schema": "lmcache-mp-eval/1", "created_utc": str,
         "duration_s": float, "config": {EvalConfig fields},
         "prompt_tokens": {"documents": float, "passkey": float},
         "rows": [{"edit", "keep", "kept", "agreement", "kl",
                   "passkey", "modify_s", "thread_modify_s", "by"}, ...]}
        """
        return {
            "schema": EVAL_SCHEMA,
            "created_utc": self.created_utc,
            "duration_s": self.duration_s,
            "config": self.config.to_dict(),
            "prompt_tokens": dict(self.prompt_tokens),
            "rows": [dataclasses.asdict(r) for r in self.rows],
        }

    def write_json(self, path: str | os.PathLike[str]) -> None:
        """Write :meth:`to_dict` as indented JSON (replaced atomically).

        Raises:
            OSError: If the file cannot be written.
        """
        write_json(path, self.to_dict())

    def write_plot(self, path: str | os.PathLike[str]) -> None:
        """Draw quality against keep, one line per edit: top-1 agreement,
        KL and passkey accuracy side by side; the uncompressed run at keep 1.

        Raises:
            ImportError: If matplotlib is not installed (names the extra).
            OSError: If the file cannot be written.
        """
        require_matplotlib()
        # The object API with the Agg canvas: no pyplot state, no GUI backend.
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        fig = Figure(figsize=(15, 4.5), layout="constrained")
        FigureCanvasAgg(fig)
        axes = fig.subplots(1, 3)
        base = self.rows[0]
        panels = (
            ("agreement", "teacher-forced top-1 agreement"),
            ("kl", "KL(p_ref || p_edit), nats"),
            ("passkey", "passkey accuracy"),
        )
        for ax, (field, label) in zip(axes, panels, strict=True):
            # One line per edit, and one per press beside it.
            for edit, by in dict.fromkeys(
                (r.edit, r.by) for r in self.rows if r.edit != "none"
            ):
                series = sorted(
                    (r.keep, getattr(r, field))
                    for r in self.rows
                    if (r.edit, r.by) == (edit, by)
                )
                label = edit if by == "lmcache_mp" else by
                ax.plot(*zip(*series, strict=True), marker="o", label=label)
            ax.axhline(getattr(base, field), color="gray", linestyle="--", label="none")
            ax.set_xlabel("keep (fraction of prompt tokens)")
            ax.set_ylabel(label)
        axes[0].legend(fontsize="small")
        fig.suptitle(f"lmcache-mp eval on {self.config.engine}")
        fig.savefig(os.fspath(path))
