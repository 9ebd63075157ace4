"""``lmcache-mp eval``: what each edit keeps of a model's output, at each
budget, beside its modify time.

The uncompressed batch runs once: each document's greedy continuation is
the reference, scored teacher-forced (``engine.score``) for its next-token
distributions; each passkey haystack's greedy answer is checked. Then every
edit at every keep runs on fresh streams over a copy of the uncompressed
KV (and queries) under its own cache salt: two edits keeping the same
tokens would otherwise share one stored KV, and copying spares a prefill
per edit. Its documents are scored teacher-forced on the reference
continuation after the edited KV, its haystacks decoded greedily.
"""

from __future__ import annotations

import dataclasses
import datetime
import time
from typing import Any

import numpy as np

from lmcache_mp import request
from lmcache_mp._harness.agreement import (
    Reference,
    agreement,
    agreement_of,
    top1_agreement,
)
from lmcache_mp._harness.progress import ProgressLine
from lmcache_mp._harness.prompts import (
    Passkey,
    document_prompts,
    document_tokens,
    passkey_prompts,
)
from lmcache_mp._util.paths import shm_root
from lmcache_mp.batch import LMCacheBatchedStream
from lmcache_mp.cache_kind import LMCacheSDKCacheKind
from lmcache_mp.edits import KIND_EDITS, Edit, make_edit
from lmcache_mp.eval._config import EvalConfig
from lmcache_mp.eval._engine import EvalEngine, open_engine, served_engine
from lmcache_mp.eval._generate import (
    GenerateResult,
    GenerateRow,
    Speed,
    free_running,
    generate_row,
    teacher_forced,
    window,
)
from lmcache_mp.eval._intervals import bootstrap
from lmcache_mp.eval._kvpress import (
    PRESSES,
    counterpart,
    decoding_press,
    kvpress_answers,
    kvpress_generation,
    kvpress_scores,
)
from lmcache_mp.eval._ruler import ANSWER_TOKENS, TaskRow, TasksResult
from lmcache_mp.eval._table import EvalResult, EvalRow
from lmcache_mp.eval._tasks import Task, make_tasks
from lmcache_mp.kv import KVStore, connect, default_capacity

__all__ = ["EDIT_PARAMS", "evaluate"]

_GREEDY = {"temperature": 0.0, "ignore_eos": True}
#: Parameters the eval gives an edit besides ``keep`` and ``attention``:
#: random's defaults protect 256 tokens at each end, the whole of the eval's
#: prompts, so here it is a uniformly random subset (kvpress's RandomPress).
EDIT_PARAMS: dict[str, dict[str, Any]] = {"random": {"keep_first": 0, "keep_last": 0}}


def _copy(ctx: KVStore, prompt: list[int], salt: str) -> None:
    """Store the uncompressed cached prefix of ``prompt`` under ``salt``."""
    cached = ctx.retrieve(prompt, "")
    if cached is not None:
        ctx.store(cached, prompt[: cached.shape[2]], salt)


class _Eval:
    """One eval's state: its engine, streams and the uncompressed run."""

    def __init__(
        self,
        config: EvalConfig,
        model: EvalEngine,
        contexts: list[KVStore],
        batch: LMCacheBatchedStream,
        threads: LMCacheBatchedStream,
    ) -> None:
        self.config = config
        self.model = model
        self.contexts = contexts
        self.batch = batch
        self.threads = threads
        self.documents = [model.encode(t) for t in document_prompts(config.prompts)]
        self.passkeys: list[Passkey] = passkey_prompts(
            config.prompts, config.haystack_lines, config.seed
        )
        self.haystacks = [model.encode(p.text) for p in self.passkeys]
        #: Each task prompt's question tokens, by its text, where the
        #: question is sent after the modify (``compress_question=False``).
        self._questions: dict[str, list[int]] = {}
        self.reference = Reference([], [])
        self.streams: dict[str, request.LMCacheRequestStream] = {}

    def _add(
        self,
        batch: LMCacheBatchedStream,
        prompts: list[list[int]],
        salt: str,
        kinds: int,
    ) -> list[str]:
        """Add a stream per prompt (over the first ``kinds`` contexts)."""
        ids = []
        for prompt in prompts:
            stream = request.create_request(
                self.contexts[:kinds], self.model.engine, prompt, salt
            )
            batch.add(stream)
            self.streams[stream.request_stream_id] = stream
            ids.append(stream.request_stream_id)
        return ids

    def _drop(self, batch: LMCacheBatchedStream, ids: list[str]) -> None:
        """Take scored streams out of ``batch``: their KV is no longer
        pinned, and the store may evict it (every edit's copies would
        otherwise stay pinned until the eval ends)."""
        for sid in ids:
            batch.remove(sid)
            del self.streams[sid]

    def _passkey(self, ids: list[str]) -> float:
        """Decode the haystacks' answers; the fraction that state the key."""
        self.batch.decode(
            {**_GREEDY, "max_tokens": self.config.answer_tokens}, stream_ids=ids
        )
        return self._found(
            [self.model.decode(self.streams[sid].output_tokens) for sid in ids]
        )

    def _found(self, answers: list[str]) -> float:
        """The fraction of the haystacks' answers that state the key."""
        found = zip(self.passkeys, answers, strict=True)
        return float(np.mean([p.found_in(a) for p, a in found]))

    def uncompressed(self) -> EvalRow:
        """Run the uncompressed batch; its row (keep 1)."""
        docs = self._add(self.batch, self.documents, "", len(self.contexts))
        keys = self._add(self.batch, self.haystacks, "", len(self.contexts))
        self.batch.decode(
            {**_GREEDY, "max_tokens": self.config.continuation}, stream_ids=docs
        )
        passkey = self._passkey(keys)
        for sid, prompt in zip(docs, self.documents, strict=True):
            ref = list(self.streams[sid].output_tokens)
            self.reference.tokens.append(ref)
            self.reference.logprobs.append(self.model.engine.score(prompt, ref, ""))
        hits = np.concatenate(
            [
                top1_agreement(lp, ref)
                for lp, ref in zip(
                    self.reference.logprobs, self.reference.tokens, strict=True
                )
            ]
        )
        return EvalRow("none", 1.0, 1.0, float(hits.mean()), 0.0, passkey)

    def variant(self, name: str, keep: float) -> EvalRow:
        """Run one edit at one keep; its row."""
        edit = self._edit(name, {"keep": keep})
        kinds = len(self.contexts) if name in KIND_EDITS else 1
        salt = f"{name}@{keep}"
        prompts = self.documents + self.haystacks
        docs, keys = self._fresh(self.batch, salt, kinds)
        modify_s = self._modify(self.batch, edit, docs + keys)
        contexts = [self._context(sid) for sid in docs + keys]
        kept = np.mean(
            [len(c) / len(p) for c, p in zip(contexts, prompts, strict=True)]
        )
        passkey = self._passkey(keys)
        # The documents' streams come first.
        agreed = agreement(
            self.model.engine, contexts[: len(docs)], self.reference, salt
        )
        self._drop(self.batch, docs + keys)
        thread_s = modify_s
        if self.batch.executor.name != "thread":
            t_docs, t_keys = self._fresh(self.threads, f"{salt}/thread", kinds)
            thread_s = self._modify(self.threads, edit, t_docs + t_keys)
            self._drop(self.threads, t_docs + t_keys)
        return EvalRow(
            name,
            keep,
            float(kept),
            agreed["top1"],
            agreed["kl"],
            passkey,
            modify_s,
            thread_s,
        )

    def kvpress(self, name: str | None, keep: float | None) -> EvalRow:
        """kvpress's counterpart of edit ``name`` at ``keep`` (``None``: its
        uncompressed model) on the documents and haystacks; its row."""
        cfg = self.config
        press, by = counterpart(name, keep)
        engine = self.model.engine
        scored = kvpress_scores(
            engine, self.documents, self.reference.tokens, press, cfg.chunk_size
        )
        answered = kvpress_answers(
            engine,
            self.haystacks,
            [[] for _ in self.haystacks],
            press,
            cfg.answer_tokens,
            cfg.chunk_size,
        )
        agreed = agreement_of(self.reference, scored.logprobs)
        docs, keys = len(self.documents), len(self.haystacks)
        return EvalRow(
            name or "none",
            1.0 if keep is None else keep,
            (scored.kept * docs + answered.kept * keys) / (docs + keys),
            agreed["top1"],
            agreed["kl"],
            self._found(answered.answers),
            scored.prefill_s + answered.prefill_s,
            by=by,
        )

    def _context(self, sid: str) -> list[int]:
        """What the stream sends next: its tokens, then its pending suffix
        (the prompt's tail past the last full chunk, which modify left
        uncached)."""
        stream = self.streams[sid]
        return list(stream.tokens) + list(stream.suffix_tokens)

    def _fresh(
        self, batch: LMCacheBatchedStream, salt: str, kinds: int
    ) -> tuple[list[str], list[str]]:
        """New streams of the documents and the haystacks under ``salt``,
        needing no prefill (:meth:`_copies`)."""
        return (
            self._copies(batch, self.documents, salt, kinds),
            self._copies(batch, self.haystacks, salt, kinds),
        )

    def _copies(
        self,
        batch: LMCacheBatchedStream,
        prompts: list[list[int]],
        salt: str,
        kinds: int,
    ) -> list[str]:
        """New streams of ``prompts`` under ``salt``, their uncompressed KV
        (and queries) copied there, so that they need no prefill."""
        for prompt in prompts:
            for ctx in self.contexts[:kinds]:
                _copy(ctx, prompt, salt)
        return self._add(batch, prompts, salt, kinds)

    def generation(self) -> tuple[list[GenerateRow], list[list[int]]]:
        """Run the uncompressed generation, then each edit at each size
        compressing while generating; the rows, and the prompts."""
        cfg = self.config
        prompts = self.documents
        if cfg.prompt_tokens is not None:
            prompts = document_tokens(self.model.encode, cfg.prompts, cfg.prompt_tokens)
        kinds = len(self.contexts)
        self.batch.prefill(
            _GREEDY, stream_ids=self._add(self.batch, prompts, "", kinds)
        )
        ids = self._copies(self.batch, prompts, "none", kinds)
        outputs, speed = free_running(self.batch, ids, cfg, None)
        self._drop(self.batch, ids)
        engine = self.model.engine
        reference = Reference(
            outputs,
            [engine.score(p, o, "") for p, o in zip(prompts, outputs, strict=True)],
        )
        scored = [
            top1_agreement(lp, o)
            for lp, o in zip(reference.logprobs, outputs, strict=True)
        ]
        top1 = float(np.concatenate(scored).mean())
        rounds = range(0, cfg.generate_tokens, cfg.every_tokens)
        rows = [
            GenerateRow(
                "none",
                "-",
                top1,
                0.0,
                [top1] * len(rounds),
                [0.0] * len(rounds),
                float(cfg.generate_tokens),
                1.0,
                speed,
            )
        ]
        if cfg.compare:
            with ProgressLine("[eval] kvpress uncompressed generation"):
                rows.append(self._kvpress_generating(None, prompts, reference))
        for name in cfg.edits:
            for size, param in cfg.sizes:
                with ProgressLine(f"[eval] {name} {size} while generating"):
                    rows.append(self._generating(name, size, param, prompts, reference))
                if cfg.compare and name in PRESSES:
                    with ProgressLine(f"[eval] DecodingPress({PRESSES[name]})"):
                        rows.append(self._kvpress_generating(name, prompts, reference))
        return rows, prompts

    def _kvpress_generating(
        self, name: str | None, prompts: list[list[int]], reference: Reference
    ) -> GenerateRow:
        """kvpress's counterpart of edit ``name`` (``None``: its uncompressed
        model) compressing while generating, at the eval's budget; its row."""
        cfg = self.config
        every, budget = cfg.every_tokens, cfg.budget or 0
        press, by = (
            (None, "kvpress") if name is None else decoding_press(name, budget, every)
        )
        run = kvpress_generation(
            self.model.engine, prompts, reference.tokens, press, every
        )
        rounds = [
            agreement_of(
                window(reference, begin, every),
                [lp[begin : begin + every] for lp in run.logprobs],
            )
            for begin in range(0, cfg.generate_tokens, every)
        ]
        generated = cfg.generate_tokens * len(prompts)
        speed = Speed(
            run.wall_s,
            0.0,
            generated / run.wall_s if run.wall_s > 0 else 0.0,
            run.end_tokens_per_s,
            run.kv_tokens,
        )
        size = "-" if name is None else f"budget {budget}"
        return generate_row(
            name or "none", size, rounds, run.outputs, reference, speed, by=by
        )

    def _generating(
        self,
        name: str,
        size: str,
        param: dict[str, Any],
        prompts: list[list[int]],
        reference: Reference,
    ) -> GenerateRow:
        """One edit at one size, compressing while generating; its row."""
        cfg = self.config
        edit = self._edit(name, param)
        kinds = len(self.contexts) if name in KIND_EDITS else 1
        salt = f"{name}@{size}"
        ids = self._copies(self.batch, prompts, salt, kinds)
        rounds = teacher_forced(
            self.batch, ids, cfg, edit, self.model.engine, reference, salt
        )
        self._drop(self.batch, ids)
        ids = self._copies(self.batch, prompts, f"{salt}/free", kinds)
        outputs, speed = free_running(self.batch, ids, cfg, edit)
        self._drop(self.batch, ids)
        thread_s = speed.modify_s
        if self.batch.executor.name != "thread":
            ids = self._copies(self.threads, prompts, f"{salt}/thread", kinds)
            thread_s = free_running(self.threads, ids, cfg, edit)[1].modify_s
            self._drop(self.threads, ids)
        return generate_row(
            name, f"{size}", rounds, outputs, reference, speed, thread_s
        )

    def tasks(self) -> tuple[list[TaskRow], list[TaskRow], dict[str, float]]:
        """Answer every task x length cell uncompressed, then, where the
        model solves it, with each edit at each keep; the scored rows, the
        dropped cells' rows, and each cell's mean prompt tokens.

        One cell at a time: its uncompressed streams leave the batch
        before the next cell's prefill, so the store holds one cell's KV
        (and queries) and the copies of one edit at a time, however many
        cells the eval has."""
        cfg = self.config
        rows, dropped, tokens = [], [], {}
        for name in cfg.tasks:
            for length in cfg.lengths:
                with ProgressLine(f"[eval] {name} at {length} tokens, uncompressed"):
                    tasks = make_tasks(
                        name, self.model.encode, length, cfg.sample_count, cfg.seed
                    )
                    prompts = [self._prompt(t) for t in tasks]
                    ids = self._add(self.batch, prompts, "", len(self.contexts))
                    scores, answer_s = self._answers(ids, tasks)
                tokens[f"{name}@{length}"] = float(np.mean([t.tokens for t in tasks]))
                base = TaskRow(
                    name,
                    length,
                    "none",
                    None,
                    scores,
                    bootstrap(scores),
                    answer_s=answer_s,
                )
                if base.accuracy.mean < cfg.min_accuracy:
                    dropped.append(base)
                else:
                    rows.extend(self._cell(base, tasks, prompts))
                self._drop(self.batch, ids)
        return rows, dropped, tokens

    def _cell(
        self, base: TaskRow, tasks: list[Task], prompts: list[list[int]]
    ) -> list[TaskRow]:
        """A solved cell's rows: its uncompressed row (and kvpress's), then
        each edit at each keep (each followed by its press), every edit on
        copies of the cell's uncompressed KV."""
        cfg = self.config
        rows = [base]
        # kvpress's own uncompressed row: its presses' change is measured
        # against it.
        kv_base = base
        if cfg.compare:
            kv_base = self._kvpress(base, tasks, prompts, None, None)
            rows.append(kv_base)
        for edit_name in cfg.edits:
            kinds = len(self.contexts) if edit_name in KIND_EDITS else 1
            for keep in cfg.keeps:
                edit = self._edit(edit_name, {"keep": keep})
                label = f"{edit_name} keep {keep:g} on {base.task}@{base.length}"
                with ProgressLine(f"[eval] {label}"):
                    salt = f"{edit_name}@{keep}/{base.task}@{base.length}"
                    ids = self._copies(self.batch, prompts, salt, kinds)
                    modify_s = self._modify(self.batch, edit, ids)
                    kept = np.mean(
                        [
                            len(self._context(sid)) / len(p)
                            for sid, p in zip(ids, prompts, strict=True)
                        ]
                    )
                    scores, answer_s = self._answers(ids, tasks)
                    self._drop(self.batch, ids)
                rows.append(
                    TaskRow(
                        base.task,
                        base.length,
                        edit_name,
                        keep,
                        scores,
                        bootstrap(scores),
                        bootstrap(scores, base.scores),
                        float(kept),
                        modify_s,
                        answer_s=answer_s,
                    )
                )
                if cfg.compare and edit_name in PRESSES:
                    rows.append(self._kvpress(kv_base, tasks, prompts, edit_name, keep))
        return rows

    def _kvpress(
        self,
        base: TaskRow,
        tasks: list[Task],
        prompts: list[list[int]],
        edit: str | None,
        keep: float | None,
    ) -> TaskRow:
        """kvpress's counterpart of ``edit`` at ``keep`` on a cell (``None``:
        its uncompressed model); its row, ``change`` against ``base``."""
        press, by = counterpart(edit, keep)
        with ProgressLine(f"[eval] {by} on {base.task}@{base.length}"):
            run = kvpress_answers(
                self.model.engine,
                prompts,
                [self._question(t) for t in tasks],
                press,
                ANSWER_TOKENS[base.task],
                self.config.chunk_size,
            )
        scores = [t.score(a) for t, a in zip(tasks, run.answers, strict=True)]
        return TaskRow(
            base.task,
            base.length,
            edit or "none",
            keep,
            scores,
            bootstrap(scores),
            None if edit is None else bootstrap(scores, base.scores),
            run.kept,
            run.prefill_s,
            by,
            run.answer_s,
        )

    def _prompt(self, task: Task) -> list[int]:
        """What a task's stream is prefilled with: its whole prompt, or
        without ``compress_question`` its context alone, the question's
        tokens kept (by the prompt's text) for :meth:`_answers` to send."""
        whole = self.model.encode(task.text)
        if self.config.compress_question:
            return whole
        context = self.model.encode(task.text[: len(task.text) - len(task.question)])
        # The question's tokens as they are in the whole prompt, where the
        # context's tokens are its prefix (a tokenizer merges nothing across
        # the line break the question starts with); else on their own.
        if whole[: len(context)] == context:
            question = whole[len(context) :]
        else:
            question = self.model.encode(task.question)
        self._questions[task.text] = question
        return context

    def _question(self, task: Task) -> list[int]:
        """The tokens sent after the modify: none unless the question is
        left out of what the edits compress."""
        return self._questions.get(task.text, [])

    def _answers(self, ids: list[str], tasks: list[Task]) -> tuple[list[float], float]:
        """Decode each stream's greedy answer, the question sent first
        where the streams hold the context alone; each task's score of it,
        and the decode phase's wall time in seconds."""
        for sid, task in zip(ids, tasks, strict=True):
            self.streams[sid].state.suffix.extend(self._question(task))
        begin = time.perf_counter()
        self.batch.decode(
            {**_GREEDY, "max_tokens": ANSWER_TOKENS[tasks[0].name]}, stream_ids=ids
        )
        answer_s = time.perf_counter() - begin
        scores = [
            task.score(self.model.decode(self.streams[sid].output_tokens))
            for sid, task in zip(ids, tasks, strict=True)
        ]
        return scores, answer_s

    def _edit(self, name: str, param: dict[str, Any]) -> Edit:
        """The edit ``name`` sized by ``param``, with the eval's options."""
        params = {**EDIT_PARAMS.get(name, {}), **param}
        if self.config.rerotate is not None:
            params["rerotate"] = self.config.rerotate
        return make_edit(name, attention=self.model.attention, **params)

    @staticmethod
    def _modify(batch: LMCacheBatchedStream, edit: Edit, ids: list[str]) -> float:
        """Modify the streams; the phase's wall time in seconds."""
        begin = time.perf_counter()
        # numpy: the ready-made edits compute in numpy (a 0.5.6 stream's
        # default, torch, would time the conversion).
        batch.modify(edit, stream_ids=ids, array="numpy")
        return time.perf_counter() - begin


def evaluate(
    config: EvalConfig | None = None, **overrides: Any
) -> EvalResult | GenerateResult | TasksResult:
    """Measure what each edit at each keep keeps of the model's output.

    For ``config.prompts`` documents, the uncompressed run's greedy
    continuation of ``config.continuation`` tokens is the reference; each
    edit's row gives the teacher-forced top-1 agreement with it and the mean
    ``KL(p_ref || p_edit)`` of the next-token distributions over it; the
    passkey accuracy over as many haystacks (the greedy answer states the
    hidden 5-digit number); the modify wall time on ``config.executor`` and
    on threads. The first row, ``none``, is the uncompressed run (its
    agreement is the scorer's own against greedy decoding, 1.0 up to ties).
    With ``config.server``, prefill, decode and scoring run on that server
    through the OpenAI client (KL then over its top 20 tokens per position:
    :meth:`OpenAICompletions.score
    <lmcache_mp.engine.http.openai.OpenAICompletions.score>`).

    Args:
        config: The eval (default ``EvalConfig()``).
        **overrides: Fields replacing the config's, e.g. ``keeps=(0.5,)``.

    With ``config.generate``, it scores compression while generating
    instead (:mod:`lmcache_mp.eval._generate`); with ``config.tasks``,
    RULER-style tasks with intervals (:mod:`lmcache_mp.eval._ruler`).

    Returns:
        The result: table, JSON and plot (a :class:`GenerateResult` for
        ``config.generate``, a :class:`TasksResult` for ``config.tasks``,
        neither with a plot).

    Raises:
        ValueError: For an invalid config (see :class:`EvalConfig`).
        TypeError: If ``overrides`` names no field of the config.
        ModelLoadError: If the model cannot be loaded.
        LMCacheBatchedStreamError: If a phase failed on some stream.
        LMCacheStreamError: With ``server``: it cannot be reached, serves
            other than one model, or a scoring request fails
            (:class:`EngineHTTPError` for an HTTP error).
        KVConfigError: With ``server``: it reports another store, chunk
            size or vocabulary size than the eval's.
        CacheKindError: With ``server``: an edit reads queries the server
            does not record.
    """
    config = dataclasses.replace(config or EvalConfig(), **overrides)
    created = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    begin = time.perf_counter()
    # Without a given store, a temporary one: removed however the eval
    # ends, a kill included (the library's tracker removes it). Half the
    # default capacity in all: the eval's processes each hold a model
    # beside the store's pages, more than the default's reserve leaves
    # them; and each kind's namespace (KV, queries) keeps a capacity of its
    # own.
    kinds = 2 if config.needs_queries else 1
    capacity = None if config.store else default_capacity(shm_root()) // (2 * kinds)
    store = connect(config.store, chunk_size=config.chunk_size, capacity_bytes=capacity)
    contexts = [store]
    try:
        if config.needs_queries:
            contexts.append(store.for_kind(LMCacheSDKCacheKind.QUERY))
        model = open_engine(
            config.engine, store, contexts[1] if config.needs_queries else None
        )
        if config.server is not None:
            queries = [name for name in config.edits if name in KIND_EDITS]
            model = served_engine(model, config.server, store, queries)
        with (
            LMCacheBatchedStream(
                config.executor, max_workers=config.workers, preload=model.preload
            ) as batch,
            LMCacheBatchedStream("thread") as threads,
        ):
            run = _Eval(config, model, contexts, batch, threads)
            if config.tasks:
                scored, dropped, lengths = run.tasks()
                return TasksResult(
                    config,
                    scored,
                    dropped,
                    lengths,
                    time.perf_counter() - begin,
                    created,
                )
            if config.generate is not None:
                with ProgressLine("[eval] uncompressed generation"):
                    generated, prompts = run.generation()
                return GenerateResult(
                    config,
                    generated,
                    float(np.mean([len(p) for p in prompts])),
                    time.perf_counter() - begin,
                    created,
                )
            with ProgressLine("[eval] uncompressed"):
                rows = [run.uncompressed()]
            if config.compare:
                with ProgressLine("[eval] kvpress uncompressed"):
                    rows.append(run.kvpress(None, None))
            for name in config.edits:
                for keep in config.keeps:
                    with ProgressLine(f"[eval] {name} keep {keep:g}"):
                        rows.append(run.variant(name, keep))
                    if config.compare and name in PRESSES:
                        with ProgressLine(f"[eval] {PRESSES[name]} keep {keep:g}"):
                            rows.append(run.kvpress(name, keep))
            tokens = {
                "documents": float(np.mean([len(p) for p in run.documents])),
                "passkey": float(np.mean([len(p) for p in run.haystacks])),
            }
    finally:
        for ctx in contexts[1:]:
            ctx.close()
        if config.store is None:
            store.destroy()
        else:
            store.close()
    return EvalResult(config, rows, tokens, time.perf_counter() - begin, created)
