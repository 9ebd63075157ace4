"""``lmcache-mp eval --generate G --every N``: what compressing the cache
every N tokens while generating keeps of the model's output, and what it
buys in decode speed.

The uncompressed greedy generation of G tokens after each document is the
reference (its next-token distributions scored teacher-forced, as the
prompt-only eval does). Each edit is then run two ways over a copy of the
prompts' uncompressed KV, under its own salt:

* **teacher-forced**: the reference's first N tokens are scored after the
  uncompressed cache, then the stream takes them in (their KV computed
  against its cache, as decoding would), is modified, and the next N are
  scored after the edited cache, and so on: top-1 agreement and KL per
  round and over the whole generation, each round's scores comparable
  with the reference's because the tokens are the same;
* **free-running**: ``batch.decode(compress=edit, every=N)`` on the eval's
  executor and again on threads, its greedy output set against the
  reference (longest common prefix, exact matches), its decode speed
  against the uncompressed generation's, and the rounds' modify time.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
from dataclasses import dataclass
from typing import Any

from lmcache_mp._harness.agreement import Reference, agreement
from lmcache_mp.batch import LMCacheBatchedStream
from lmcache_mp.edits import Edit
from lmcache_mp.eval._config import EvalConfig
from lmcache_mp.eval._table import page, write_json

__all__ = [
    "GENERATE_SCHEMA",
    "GenerateResult",
    "GenerateRow",
    "Speed",
    "common_prefix",
    "end_speed",
    "free_running",
    "generate_row",
    "last_round",
    "teacher_forced",
    "window",
]

#: The ``schema`` of :meth:`GenerateResult.to_dict`.
GENERATE_SCHEMA = "lmcache-mp-eval-generate/1"
_GREEDY = {"temperature": 0.0, "ignore_eos": True}


@dataclass(frozen=True)
class Speed:
    """One free-running generation of every document's stream.

    Args:
        wall_s: Wall time of the whole generation, rounds' modifies
            included.
        modify_s: Of it, the rounds' modify phases.
        tokens_per_s: Generated tokens of all streams / the decode phases'
            wall time.
        end_tokens_per_s: Mean over streams of one stream's decode speed
            over its last round (``1 / mean TPOT`` of its last ``every``
            tokens): the speed against the cache at its largest.
        kv_tokens: Mean KV tokens the streams decoded against at the end.
    """

    wall_s: float
    modify_s: float
    tokens_per_s: float
    end_tokens_per_s: float
    kv_tokens: float


@dataclass(frozen=True)
class GenerateRow:
    """One edit at one size, compressing while generating (``edit="none"``:
    the uncompressed generation).

    Args:
        edit: The edit's name.
        size: ``"budget B"`` or ``"keep K"``.
        top1: Teacher-forced top-1 agreement with the reference over every
            generated position of every document.
        kl: Mean ``KL(p_ref || p_edit)`` over the same positions, nats.
        round_top1: The agreement of each round's tokens.
        round_kl: The KL of each round's tokens.
        common_prefix: Mean over documents of the free-running greedy
            output's longest common prefix with the reference, in tokens.
        exact: Fraction of documents whose free-running output is the
            reference's.
        speed: The free-running generation on the eval's executor (or in
            kvpress's loop, one prompt at a time).
        thread_modify_s: Its rounds' modify time on threads.
        by: ``"lmcache_mp"``, or ``"kvpress"`` and the press's name
            (``--compare kvpress``).
    """

    edit: str
    size: str
    top1: float
    kl: float
    round_top1: list[float]
    round_kl: list[float]
    common_prefix: float
    exact: float
    speed: Speed
    thread_modify_s: float | None = None
    by: str = "lmcache_mp"


def generate_row(
    edit: str,
    size: str,
    rounds: list[dict[str, float]],
    outputs: list[list[int]],
    reference: Reference,
    speed: Speed,
    thread_modify_s: float | None = None,
    by: str = "lmcache_mp",
) -> GenerateRow:
    """One run's row, from its rounds' agreement and its free-running outputs.

    Args:
        edit: The edit's name (``"none"``: uncompressed).
        size: ``"budget B"``, ``"keep K"`` or ``"-"``.
        rounds: Each round's ``top1``, ``kl`` and ``positions``.
        outputs: Each prompt's free-running greedy output.
        reference: The uncompressed generation.
        speed: The free-running generation's speed.
        thread_modify_s: Its rounds' modify time on threads.
        by: Who compressed (see :class:`GenerateRow`).

    Returns:
        The row: overall agreement weighted by each round's positions.
    """
    positions = sum(r["positions"] for r in rounds)
    prefixes = [
        common_prefix(o, r) for o, r in zip(outputs, reference.tokens, strict=True)
    ]
    exact = [p == len(r) for p, r in zip(prefixes, reference.tokens, strict=True)]
    return GenerateRow(
        edit,
        size,
        sum(r["top1"] * r["positions"] for r in rounds) / positions,
        sum(r["kl"] * r["positions"] for r in rounds) / positions,
        [r["top1"] for r in rounds],
        [r["kl"] for r in rounds],
        statistics.fmean(prefixes),
        statistics.fmean(exact),
        speed,
        thread_modify_s,
        by,
    )


def last_round(total: int, every: int) -> int:
    """Tokens of the last round of ``total`` generated ``every`` at a time."""
    return total - (total - 1) // every * every


def end_speed(gaps: list[float], last: int) -> float:
    """One stream's decode speed over its last round: ``1 /`` the mean gap
    between that round's ``last`` tokens (its TPOT), 0 without a gap.

    Args:
        gaps: The gaps between consecutive generated tokens, in seconds.
        last: Tokens of the last round (:func:`last_round`).
    """
    tail = gaps[len(gaps) - max(1, last - 1) :]
    return 1 / statistics.fmean(tail) if tail else 0.0


def window(reference: Reference, begin: int, every: int) -> Reference:
    """The reference's tokens ``begin .. begin + every - 1``: one round."""
    return Reference(
        [t[begin : begin + every] for t in reference.tokens],
        [lp[begin : begin + every] for lp in reference.logprobs],
    )


def common_prefix(output: list[int], reference: list[int]) -> int:
    """Tokens at the start of ``output`` that equal ``reference``'s."""
    count = 0
    for got, want in zip(output, reference, strict=False):
        if got != want:
            break
        count += 1
    return count


def free_running(
    batch: LMCacheBatchedStream,
    ids: list[str],
    config: EvalConfig,
    edit: Edit | None,
) -> tuple[list[list[int]], Speed]:
    """Generate ``config.generate`` tokens on every stream, compressing
    with ``edit`` every ``config.every`` tokens (``None``: uncompressed, in
    one decode phase).

    Args:
        batch: The batch holding the streams, prefilled or with their KV
            stored.
        ids: The streams.
        config: The eval (``generate`` and ``every`` set).
        edit: The compression, or ``None``.

    Returns:
        Each stream's greedy output, and the generation's speed.

    Raises:
        LMCacheBatchedStreamError: If a stream's decode or round failed.
    """
    total, every = config.generate_tokens, config.every_tokens
    params = {**_GREEDY, "max_tokens": total}
    if edit is None:
        metrics = batch.decode(params, stream_ids=ids)
        modify_s = 0.0
    else:
        # numpy: the ready-made edits compute in numpy (a 0.5.6 stream's
        # default, torch, would time the conversion).
        metrics = batch.decode(
            params, stream_ids=ids, compress=edit, every=every, array="numpy"
        )
        modify_s = float(metrics["compression"]["modify_s"])
    decode_s = float(metrics["results"]["duration"])
    last = last_round(total, every)
    ends, kv = [], []
    for sid in ids:
        perf = batch.perf_metrics[sid]
        ends.append(end_speed(perf.tpot, last))
        rounds = [r[sid] for r in batch.round_metrics if sid in r] if edit else []
        # What the last token attended to: the cache the last round left
        # (or the prompt) and the tokens decoded since.
        base = rounds[-1].tokens_after if rounds else perf.input_tokens
        kv.append(base + last - 1 if rounds else base + total - 1)
    outputs = [_output(batch, sid) for sid in ids]
    generated = sum(len(o) for o in outputs)
    return outputs, Speed(
        wall_s=decode_s + modify_s,
        modify_s=modify_s,
        tokens_per_s=generated / decode_s if decode_s > 0 else 0.0,
        end_tokens_per_s=statistics.fmean(ends),
        kv_tokens=statistics.fmean(kv),
    )


def teacher_forced(
    batch: LMCacheBatchedStream,
    ids: list[str],
    config: EvalConfig,
    edit: Edit,
    engine: Any,
    reference: Reference,
    salt: str,
) -> list[dict[str, float]]:
    """Score the reference generation round by round, compressing every
    ``config.every`` of its tokens.

    Round ``r`` scores reference tokens ``r*N .. (r+1)*N-1`` after the
    stream's cache (the first round's uncompressed); then the stream takes
    those tokens in, their KV computed against that cache, and is modified
    by ``edit`` before the next round.

    Args:
        batch: The batch holding the streams, their KV stored.
        ids: The streams, in the reference's order.
        config: The eval (``generate`` and ``every`` set).
        edit: The compression.
        engine: The model's ``post_completion``, with ``score``.
        reference: The uncompressed generation of each stream's prompt.
        salt: The streams' cache salt.

    Returns:
        Each round's ``top1``, ``kl`` and ``positions``.

    Raises:
        LMCacheBatchedStreamError: If a round's modify failed.
        LMCacheStreamError: If taking the tokens in failed.
    """
    every = config.every_tokens
    rounds = []
    for begin in range(0, config.generate_tokens, every):
        if begin:
            batch.modify(edit, stream_ids=ids, array="numpy")
        part = window(reference, begin, every)
        contexts = [_context(batch, sid) for sid in ids]
        rounds.append(agreement(engine, contexts, part, salt))
        if begin + every < config.generate_tokens:
            for sid, tokens, context in zip(ids, part.tokens, contexts, strict=True):
                stream: Any = batch.streams[sid]
                # The engine computes the window's KV after the cache and
                # stores it; the token it samples is not the reference's,
                # so the stream backs the context and window alone.
                stream.generate({**_GREEDY, "max_tokens": 1}, suffix_tokens=tokens)
                stream.tokens = context + tokens
    return rounds


def _output(batch: LMCacheBatchedStream, sid: str) -> list[int]:
    """The stream's generated tokens."""
    stream: Any = batch.streams[sid]
    return list(stream.output_tokens)


def _context(batch: LMCacheBatchedStream, sid: str) -> list[int]:
    """What the stream sends next: its tokens, then its pending suffix."""
    stream: Any = batch.streams[sid]
    return list(stream.tokens) + list(stream.suffix_tokens)


@dataclass(frozen=True)
class GenerateResult:
    """What ``lmcache-mp eval --generate`` measured.

    Args:
        config: The eval.
        rows: The uncompressed generation, then each edit at each size.
        prompt_tokens: Mean prompt tokens of the documents.
        duration_s: Wall time of the whole eval (model load included).
        created_utc: When it started (ISO 8601).
    """

    config: EvalConfig
    rows: list[GenerateRow]
    prompt_tokens: float
    duration_s: float
    created_utc: str

    def format(self) -> str:
        """The table as printed: one line per edit and size.

        Returns:
            The title, the table and what its columns mean.
        """
        cfg = self.config
        # Speeds against the uncompressed run of the same implementation.
        bases = {_family(r.by): r.speed for r in self.rows if r.edit == "none"}
        headers = [
            "edit",
            "size",
            "top-1 agree",
            "KL (nats)",
            "common prefix",
            "exact",
            "KV at end",
            "end tok/s",
            "x none",
            "wall s",
            "x none",
            f"modify {cfg.executor} (s)",
            "modify thread (s)",
        ]
        table = [
            [
                r.edit,
                r.size,
                f"{r.top1:.3f}",
                f"{r.kl:.3f}",
                f"{r.common_prefix:.1f}",
                f"{r.exact:.2f}",
                f"{r.speed.kv_tokens:.0f}",
                f"{r.speed.end_tokens_per_s:.1f}",
                _ratio(r.speed.end_tokens_per_s, bases[_family(r.by)].end_tokens_per_s),
                f"{r.speed.wall_s:.2f}",
                _ratio(bases[_family(r.by)].wall_s, r.speed.wall_s),
                f"{r.speed.modify_s:.2f}",
                "-" if r.thread_modify_s is None else f"{r.thread_modify_s:.2f}",
            ]
            for r in self.rows
        ]
        if cfg.compare:
            headers.insert(2, "by")
            for row, r in zip(table, self.rows, strict=True):
                row.insert(2, r.by)
        title = (
            f"lmcache-mp eval --generate {cfg.generate_tokens} --every "
            f"{cfg.every_tokens}: {cfg.engine}, {cfg.prompts} documents "
            f"(~{self.prompt_tokens:.0f} tokens), {cfg.executor} executor; "
            f"{self.duration_s:.0f} s"
        )
        note = (
            "top-1 agree / KL: teacher-forced along the uncompressed greedy "
            "generation, compressing every --every of its tokens (per round "
            "in --json); common prefix / exact: the free-running greedy "
            "output against it; KV at end: tokens the last one attended to; "
            "end tok/s: one stream's decode speed over the last round; x "
            "none: against the uncompressed generation (above 1: faster); "
            "wall s: decode and the rounds' modifies"
        )
        if cfg.compare:
            note += (
                "; kvpress: a DecodingPress around the edit's press, one "
                "prompt at a time, compressing at the end of every --every-th "
                "decoding step (so the next token is predicted before it); x "
                "none against kvpress's own uncompressed run"
            )
        return page(title, headers, table, note)

    def to_dict(self) -> dict[str, Any]:
        """The result, JSON-ready::

        {"schema": "lmcache-mp-eval-generate/1", "created_utc": str,
         "duration_s": float, "config": {EvalConfig fields},
         "prompt_tokens": float,
         "rows": [{"edit", "size", "top1", "kl", "round_top1",
                   "round_kl", "common_prefix", "exact",
                   "speed": {Speed fields}, "thread_modify_s", "by"}, ...]}
        """
        return {
            "schema": GENERATE_SCHEMA,
            "created_utc": self.created_utc,
            "duration_s": self.duration_s,
            "config": self.config.to_dict(),
            "prompt_tokens": self.prompt_tokens,
            "rows": [dataclasses.asdict(r) for r in self.rows],
        }

    def write_json(self, path: str | os.PathLike[str]) -> None:
        """Write :meth:`to_dict` as indented JSON (replaced atomically).

        Raises:
            OSError: If the file cannot be written.
        """
        write_json(path, self.to_dict())


def _family(by: str) -> str:
    """The implementation a row's ``by`` names: ``"lmcache_mp"`` or ``"kvpress"``."""
    return by.split()[0]


def _ratio(value: float, base: float) -> str:
    return f"{value / base:.2f}x" if base > 0 else "-"
