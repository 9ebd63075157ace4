"""What ``lmcache-mp eval`` runs: its configuration."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from lmcache_mp._harness.options import check_count
from lmcache_mp.edits import EDITS, KIND_EDITS
from lmcache_mp.eval._intervals import samples_for
from lmcache_mp.eval._tasks import TASKS

__all__ = ["COMPARE", "EVAL_EDITS", "EVAL_EXECUTORS", "EvalConfig"]

#: The edits ``lmcache-mp eval`` compares by default: the published
#: methods, every one sized by ``keep``.
EVAL_EDITS = (
    "random",
    "window",
    "streamingllm",
    "knorm",
    "keydiff",
    "tova",
    "snapkv",
    "h2o",
    "rkv",
    "expected_attention",
)
#: Other implementations ``compare`` may name.
COMPARE = ("kvpress",)
#: Executors the modify phase may run on (the eval's own process runs the
#: scoring; distributed executors are the bench's).
EVAL_EXECUTORS = ("process", "thread", "serial", "auto")


@dataclass(frozen=True)
class EvalConfig:
    """An eval: which edits at which budgets, on which prompts and model.

    Args:
        edits: Edit names (of ``lmcache_mp.edits.EDITS`` or ``KIND_EDITS``),
            each built with ``keep=`` and the model's ``attention``, its
            other parameters (``rerotate`` included) at their defaults.
        keeps: Fractions of the prompt's tokens each edit keeps.
        continuation: Tokens of the uncompressed greedy continuation that
            every edit is scored on (teacher-forced).
        prompts: Documents to continue, and as many passkey haystacks.
        executor: What runs the modify phase (and the decodes); the same
            edit's modify is also timed on threads.
        engine: ``"smollm2-135m"`` (or another model ``HFEngine`` loads) or
            ``"toy"``.
        workers: Worker processes (default: physical cores).
        chunk_size: Tokens per KV store chunk.
        haystack_lines: Filler lines of each passkey haystack (16 is about
            450 SmolLM2 tokens).
        answer_tokens: Tokens greedily decoded as a passkey answer.
        seed: Seed of the passkeys.
        rerotate: Build every edit with this ``rerotate``: ``False``,
            ``True``, ``"compact"`` or ``"shift"`` (``None``: each edit's
            documented default; only ``streamingllm`` rerotates by default,
            and an edit that does not leaves its kept keys at their old
            positions while decoding continues at the kept count, as vLLM +
            LMCache would).
        server: An OpenAI-compatible server's base URL: the streams' prefill
            and decode, and the teacher-forced scoring, go to it through
            the OpenAI client; ``engine`` is then loaded here only for its
            tokenizer, vocabulary size and attention config, and must be
            the served model. The server must read and write ``store``
            (``lmcache-mp serve --store`` the same URL, ``--chunk-size``
            the same size): the edits read the KV it prefilled there, and
            the queries it recorded for those that need them
            (``--record-queries``).
        store: The KV store URL; needed with ``server`` (default: a
            temporary store, removed at the end). A given store is left
            as it is, with the eval's KV in it.
        generate: Score compression while generating instead: each
            document's uncompressed greedy generation of this many tokens
            is the reference, and each edit compresses the cache every
            ``every`` tokens of it (see ``lmcache_mp.eval._generate``); no
            passkey then.
        every: Tokens between two compressions, with ``generate``.
        budget: With ``generate``, every edit keeps at most this many
            tokens each round (instead of each ``keeps`` fraction of the
            tokens it is given).
        prompt_tokens: With ``generate``, each document cut to exactly
            this many tokens (default: the documents as they are).
        tasks: Score RULER-style tasks instead (names of
            :data:`~lmcache_mp.eval._tasks.TASKS`; see
            ``lmcache_mp.eval._ruler``): accuracy per task and length,
            with intervals; no documents or passkey then.
        lengths: With ``tasks``, the prompt lengths, in the model's tokens.
        samples: With ``tasks``, prompts per task and length (``None``:
            enough for a 95% interval of at most 5 points each side).
        min_accuracy: With ``tasks``, the uncompressed accuracy a cell
            needs for the edits to run on it.
        compress_question: With ``tasks``, whether the question is part of
            what the edits compress (the whole prompt is prefilled, then
            modified). ``False``: each stream is prefilled with the context
            alone and the question is sent after the modify, as kvpress's
            pipeline and RULER's leaderboards run a context and a question
            (question-agnostic compression).
        compare: Other implementations to run beside the edits, on the
            documents and passkeys or on the tasks: ``("kvpress",)`` runs
            NVIDIA kvpress's counterpart of each edit that has one
            (``lmcache_mp.eval._kvpress``) on the same model, prompts and
            keeps, and its uncompressed model.

    Raises:
        ValueError: If an edit is unknown or named twice, a keep is not in
            ``(0, 1]``, a count is not a positive int, or ``server`` comes
            without ``store``.
    """

    edits: tuple[str, ...] = EVAL_EDITS
    keeps: tuple[float, ...] = (0.25, 0.5)
    continuation: int = 32
    prompts: int = 6
    executor: str = "process"
    engine: str = "smollm2-135m"
    workers: int | None = None
    chunk_size: int = 16
    haystack_lines: int = 16
    answer_tokens: int = 8
    seed: int = 0
    rerotate: bool | str | None = None
    server: str | None = None
    store: str | None = None
    generate: int | None = None
    every: int | None = None
    budget: int | None = None
    prompt_tokens: int | None = None
    tasks: tuple[str, ...] = ()
    lengths: tuple[int, ...] = (1024,)
    samples: int | None = None
    min_accuracy: float = 0.8
    compress_question: bool = True
    compare: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "edits", tuple(self.edits))
        object.__setattr__(self, "keeps", tuple(float(k) for k in self.keeps))
        known = {*EDITS, *KIND_EDITS}
        for name in self.edits:
            if name not in known:
                raise ValueError(
                    f"EvalConfig.edits: unknown edit {name!r}; known edits: "
                    f"{', '.join(sorted(known))}"
                )
        if not self.edits or len(set(self.edits)) != len(self.edits):
            raise ValueError(
                f"EvalConfig.edits must name distinct edits, got {self.edits!r}"
            )
        if not self.keeps or not all(
            math.isfinite(k) and 0 < k <= 1 for k in self.keeps
        ):
            raise ValueError(
                f"EvalConfig.keeps must be fractions in (0, 1], got {self.keeps!r}"
            )
        if self.executor not in EVAL_EXECUTORS:
            raise ValueError(
                f"EvalConfig.executor is {self.executor!r}; choose from "
                f"{', '.join(EVAL_EXECUTORS)}"
            )
        for name in ("continuation", "prompts", "chunk_size", "answer_tokens"):
            check_count("EvalConfig", name, getattr(self, name))
        if self.haystack_lines < 0:
            raise ValueError(
                f"EvalConfig.haystack_lines must be >= 0, got {self.haystack_lines}"
            )
        if self.workers is not None:
            check_count("EvalConfig", "workers", self.workers)
        self._check_generate()
        self._check_tasks()
        self._check_compare()
        if self.server is not None and self.store is None:
            raise ValueError(
                "EvalConfig.server needs EvalConfig.store: the URL of the "
                "store the server reads and writes (lmcache-mp serve --store)"
            )

    def _check_generate(self) -> None:
        """The generation options: together, and positive."""
        options = ("every", "budget", "prompt_tokens")
        if self.generate is None:
            given = [name for name in options if getattr(self, name) is not None]
            if given:
                raise ValueError(
                    f"EvalConfig.{given[0]} needs EvalConfig.generate: it "
                    "sizes compression while generating"
                )
            return
        check_count("EvalConfig", "generate", self.generate)
        if self.every is None:
            raise ValueError(
                "EvalConfig.generate needs EvalConfig.every: the tokens "
                "between two compressions"
            )
        for name in options:
            if getattr(self, name) is not None:
                check_count("EvalConfig", name, getattr(self, name))
        if self.server is not None:
            raise ValueError(
                "EvalConfig.generate runs on the embedded engines; a served "
                "model is scored on prompts only (leave out server)"
            )

    def _names(self, field: str, what: str, known: tuple[str, ...]) -> None:
        """Make ``field`` a tuple; raise if a name in it is not ``known``."""
        names = tuple(getattr(self, field))
        object.__setattr__(self, field, names)
        for name in names:
            if name not in known:
                raise ValueError(
                    f"EvalConfig.{field}: unknown {what} {name!r}; choose from "
                    f"{', '.join(known)}"
                )

    def _check_tasks(self) -> None:
        """The task options: known names, positive lengths and counts."""
        self._names("tasks", "task", TASKS)
        object.__setattr__(self, "lengths", tuple(self.lengths))
        if len(set(self.tasks)) != len(self.tasks):
            raise ValueError(f"EvalConfig.tasks names one twice: {self.tasks!r}")
        if not self.lengths:
            raise ValueError("EvalConfig.lengths is empty")
        for length in self.lengths:
            check_count("EvalConfig", "lengths", length)
        if self.samples is not None:
            check_count("EvalConfig", "samples", self.samples)
        if not 0.0 <= self.min_accuracy <= 1.0:
            raise ValueError(
                f"EvalConfig.min_accuracy must be in [0, 1], got {self.min_accuracy!r}"
            )
        if not self.compress_question and not self.tasks:
            raise ValueError(
                "EvalConfig.compress_question=False needs EvalConfig.tasks: "
                "only a task's prompt has a question apart from its context"
            )
        if self.tasks and (self.generate is not None or self.server is not None):
            raise ValueError(
                "EvalConfig.tasks runs on the embedded engines and prompts "
                "only: leave out generate and server"
            )

    def _check_compare(self) -> None:
        """The implementations to compare, and that they can run."""
        self._names("compare", "implementation", COMPARE)
        if self.compare and (self.server is not None or self.engine == "toy"):
            raise ValueError(
                "EvalConfig.compare runs with a trained model, in this "
                "process: leave out server, and give a model (not the toy "
                "engine)"
            )
        if self.compare and self.generate is not None and self.budget is None:
            raise ValueError(
                "EvalConfig.compare with generate needs EvalConfig.budget: "
                "kvpress's DecodingPress compresses to a token count "
                "(target_size), not a fraction"
            )

    @property
    def sample_count(self) -> int:
        """``samples``, or enough for a 95% interval of at most 5 points
        each side on any accuracy."""
        return samples_for(0.05) if self.samples is None else self.samples

    @property
    def generate_tokens(self) -> int:
        """``generate``, which a generation eval has (else 0)."""
        return self.generate or 0

    @property
    def every_tokens(self) -> int:
        """``every``, which a generation eval has (else 0)."""
        return self.every or 0

    @property
    def sizes(self) -> list[tuple[str, dict[str, Any]]]:
        """Each size an edit runs at: its label and its parameter."""
        if self.budget is not None:
            return [(f"budget {self.budget}", {"budget": self.budget})]
        return [(f"keep {k:g}", {"keep": k}) for k in self.keeps]

    @property
    def needs_queries(self) -> bool:
        """Whether an edit scores the KV with the prompt's queries."""
        return any(name in KIND_EDITS for name in self.edits)

    def to_dict(self) -> dict[str, Any]:
        """The fields, JSON-ready (tuples as lists)."""
        return {
            k: list(v) if isinstance(v, tuple) else v
            for k, v in dataclasses.asdict(self).items()
        }
