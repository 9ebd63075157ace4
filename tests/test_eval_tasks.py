"""RULER-style tasks generated from a seed, their checkers, and the bootstrap
intervals the eval gives its figures."""

from __future__ import annotations

import collections
import itertools
import math
import re
from typing import Any

import numpy as np
import pytest

from lmcache_mp.__main__ import build_parser
from lmcache_mp._harness.prompts import DOCUMENTS, FILLER
from lmcache_mp.batch import LMCacheBatchedStream
from lmcache_mp.eval import EvalConfig, TasksResult, evaluate
from lmcache_mp.eval._cli import eval_config_from_args
from lmcache_mp.eval._intervals import bootstrap, samples_for
from lmcache_mp.eval._tasks import TASKS, Task, make_tasks


def words(text: str) -> list[int]:
    """A stand-in tokenizer: one id per whitespace-separated word."""
    return [len(w) for w in text.split()]


# --- checkers on hand-written answers --------------------------------------------

NUMBER = Task("niah_single", "", ("4817263",), 0)
WORDS = Task("vt", "", ("QWERT", "ASDFG"), 0)
UUID = Task("niah_single_3", "", ("0a6e25c8-2d41-4f3b-9c6a-7e5d3b1f0c24",), 0)


@pytest.mark.parametrize(
    ("task", "answer", "score"),
    [
        (NUMBER, " 4817263.", 1.0),
        (NUMBER, " 4817264.", 0.0),
        (NUMBER, " the number you asked for is 4817263, I am sure", 1.0),
        (NUMBER, "".join([" 48", "172", "63", "."]), 1.0),
        (NUMBER, " 48172635", 0.0),
        (NUMBER, " 48 17263", 0.0),
        (WORDS, " QWERT, ASDFG", 1.0),
        (WORDS, " qwert and then asdfg and ZXCVB", 1.0),
        (WORDS, " QWERT only", 0.5),
        (WORDS, " QWERTY, ASDFGH", 0.0),
        (WORDS, "", 0.0),
        (UUID, ": 0A6E25C8-2d41-4f3b-9c6a-7e5d3b1f0c24.", 1.0),
        (UUID, "".join([" 0a", "6e25", "c8-", "2d41-4f3b-9c", "6a-7e5d3b1f0c24"]), 1.0),
        (UUID, " 0a6e25c8-2d41-4f3b-9c6a-7e5d3b1f0c25", 0.0),
        (UUID, " 0a6e25c8-2d41-4f3b-9c6a", 0.0),
    ],
    ids=[
        "number-right",
        "number-wrong",
        "number-among-words",
        "number-split-across-tokens",
        "number-inside-a-longer-one",
        "number-split-by-a-space",
        "words-right",
        "words-any-case-extra-words",
        "words-half",
        "words-inside-longer-ones",
        "empty",
        "uuid-any-case",
        "uuid-split-across-tokens",
        "uuid-last-digit-wrong",
        "uuid-cut-short",
    ],
)
def test_the_checker_scores_the_share_of_answers_stated(
    task: Task, answer: str, score: float
) -> None:
    """An answer scores the share of expected numbers or words it states,
    each as a whole number or word (case aside), whatever else it says
    and however the tokens that made it were cut."""
    assert task.score(answer) == score


# --- generation --------------------------------------------------------------------


@pytest.mark.parametrize("name", TASKS)
def test_generation_is_deterministic_per_seed(name: str) -> None:
    """The same seed gives the same prompts and answers; another seed
    gives others; the samples of one call differ from each other."""
    first = make_tasks(name, words, 300, 3, seed=5)
    assert first == make_tasks(name, words, 300, 3, seed=5)
    assert first != make_tasks(name, words, 300, 3, seed=6)
    assert len({t.text for t in first}) == 3


@pytest.mark.parametrize("name", TASKS)
@pytest.mark.parametrize("length", [300, 1000])
def test_a_prompt_fills_its_length_without_passing_it(name: str, length: int) -> None:
    """Each prompt has at most ``length`` tokens, and one more piece of
    haystack would pass it (it is within a tenth of the length)."""
    for task in make_tasks(name, words, length, 2):
        assert task.tokens == len(words(task.text)) <= length
        assert task.tokens > 0.9 * length


@pytest.mark.parametrize("name", [t for t in TASKS if t.startswith("niah")])
def test_the_needles_hold_the_answers(name: str) -> None:
    """Every expected number is in the haystack as its key's needle, the
    question names the keys asked (every key for the multi-query task),
    and the distractors' numbers are not answers."""
    task = make_tasks(name, words, 500, 1, seed=2)[0]
    named = re.findall(r"special magic \w+ for (.+?) mentioned", task.text)[-1]
    asked = set(re.split(r", | and ", named))
    found = re.findall(r"(?:numbers|uuids) for (\S+) is: ([\w-]+)\.", task.text)
    assert len(found) == (1 if name.startswith("niah_single") else 4)
    assert len(asked) == (4 if name == "niah_multiquery" else 1)
    assert {v for k, v in found if k in asked} == set(task.answers)
    assert task.score(" " + " ".join(task.answers)) == 1.0


@pytest.mark.parametrize(
    ("name", "prose", "value"),
    [
        ("niah_single", False, r"\d{7}"),
        ("niah_single_2", True, r"\d{7}"),
        ("niah_single_3", True, r"[0-9a-f]{8}(?:-[0-9a-f]{4}){3}-[0-9a-f]{12}"),
    ],
)
def test_single_needle_tasks_differ_in_haystack_and_value(
    name: str, prose: bool, value: str
) -> None:
    """RULER's three single-needle forms: a 7-digit number in repeated
    filler, the same in prose (the documents' sentences), and a UUID in
    prose."""
    task = make_tasks(name, words, 600, 1, seed=1)[0]
    assert re.fullmatch(value, task.answers[0])
    assert (FILLER in task.text) is not prose
    first_sentence = DOCUMENTS[0].split(". ")[0]
    assert (first_sentence in task.text) is prose


@pytest.mark.parametrize("name", TASKS)
def test_a_prompt_ends_with_its_question(name: str) -> None:
    """Each prompt's text ends with its question, which starts after the
    haystack on a new line and states none of the answers."""
    for task in make_tasks(name, words, 256, 3):
        assert task.question.startswith("\n") and task.text.endswith(task.question)
        assert len(task.question) < len(task.text) // 2
        assert not any(answer in task.question for answer in task.answers)


def test_variable_tracking_chains_its_answers_in_order() -> None:
    """vt's answers are the chain's variables: the first is assigned the
    number, each next one the previous one, in the order they appear."""
    task = make_tasks("vt", words, 600, 1, seed=3)[0]
    value = re.findall(r"assigned the value (\d+)", task.text)[-1]
    assignments = re.findall(r"VAR (\w+) = (VAR \w+|\d+)\.", task.text)
    assert assignments[0] == (task.answers[0], value)
    for (a, _), (_, source) in itertools.pairwise(assignments):
        assert source == f"VAR {a}"
    assert [a for a, _ in assignments] == list(task.answers)


def test_common_words_are_the_most_frequent_of_the_list() -> None:
    """cwe's ten answers are the ten words the list repeats most, each
    more often than any other word."""
    task = make_tasks("cwe", words, 1000, 1, seed=4)[0]
    listed = re.findall(r"\d+\. (\w+)", task.text)
    counts = collections.Counter(listed)
    top = {w for w, _ in counts.most_common(len(task.answers))}
    assert top == set(task.answers)
    rest = max(c for w, c in counts.items() if w not in task.answers)
    assert min(counts[w] for w in task.answers) > rest


def test_frequent_words_are_the_three_most_frequent_coded_words() -> None:
    """fwe's three answers are its coded text's three most frequent words,
    apart from the fourth."""
    task = make_tasks("fwe", words, 1000, 1, seed=4)[0]
    body = task.text.split("\n")[1].split(" ....")[0].split()
    counts = collections.Counter(body).most_common(4)
    assert tuple(w for w, _ in counts[:3]) == task.answers
    assert counts[2][1] > counts[3][1]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("ruler", words, 300, 1), "unknown task 'ruler'"),
        (("vt", words, 0, 1), "length must be an int >= 1"),
        (("vt", words, 300, 0), "samples must be an int >= 1"),
        (("niah_single", words, 20, 1), "do not fit its instructions"),
    ],
    ids=["unknown", "zero-length", "no-samples", "too-short"],
)
def test_bad_task_arguments_are_refused(args: tuple[object, ...], needle: str) -> None:
    """An unknown task, a non-positive length or count, or a length the
    question alone passes raise ValueError naming the problem."""
    with pytest.raises(ValueError, match=needle):
        make_tasks(*args)  # type: ignore[arg-type]


# --- bootstrap intervals -----------------------------------------------------------


def test_an_accuracys_interval_matches_the_normal_approximation() -> None:
    """For 400 right/wrong samples the 95% bootstrap interval is the
    normal one, p ± 1.96 sqrt(p(1-p)/n), to within 0.01 at each end."""
    sample = np.random.default_rng(1).integers(0, 2, 400)
    p = sample.mean()
    half = 1.959964 * math.sqrt(p * (1 - p) / sample.size)
    interval = bootstrap(sample)
    assert interval.mean == p and interval.n == 400
    assert abs(interval.low - (p - half)) < 0.01
    assert abs(interval.high - (p + half)) < 0.01


def test_a_small_samples_interval_matches_the_exact_bootstrap() -> None:
    """For 5 samples, whose 5^5 resamples can all be listed, the interval's
    ends are the exact bootstrap distribution's quantiles (to one step of
    its atoms)."""
    sample = [0.1, 0.4, 0.45, 0.9, 1.7]
    means = sorted(
        sum(pick) / 5 for pick in itertools.product(sample, repeat=len(sample))
    )
    low, high = np.quantile(means, [0.025, 0.975])
    interval = bootstrap(sample, resamples=200_000)
    step = 1.6 / 5
    assert abs(interval.low - low) < step / 4
    assert abs(interval.high - high) < step / 4


def test_a_paired_interval_is_of_the_differences() -> None:
    """With a baseline the interval is of the per-sample differences, as
    if they were given; a constant difference has no spread."""
    rng = np.random.default_rng(2)
    base = rng.random(50)
    values = base + rng.normal(0.1, 0.05, 50)
    assert bootstrap(values, base) == bootstrap(values - base)
    shifted = bootstrap(base + 0.25, base)
    assert math.isclose(shifted.low, 0.25) and math.isclose(shifted.high, 0.25)


def test_enough_samples_for_five_points_at_95_percent() -> None:
    """±5 points at 95% on any accuracy needs 385 samples (1.96² / 4 /
    0.05²); ±10 points, 97."""
    assert samples_for(0.05) == 385
    assert samples_for(0.10) == 97


@pytest.mark.parametrize(
    ("args", "kwargs", "needle"),
    [
        (([],), {}, "non-empty"),
        (([1.0, 2.0], [1.0]), {}, "baseline has 1 samples"),
        (([1.0],), {"level": 1.0}, "level must be in"),
        (([1.0],), {"resamples": 0}, "resamples must be"),
    ],
    ids=["empty", "unpaired", "level", "resamples"],
)
def test_bad_bootstrap_arguments_are_refused(
    args: tuple[object, ...], kwargs: dict[str, object], needle: str
) -> None:
    """An empty sample, a baseline of another length, a level outside (0,
    1) or no resamples raise ValueError naming it."""
    with pytest.raises(ValueError, match=needle):
        bootstrap(*args, **kwargs)  # type: ignore[arg-type]


# --- the eval over the tasks -------------------------------------------------------

#: Two short cells on the toy model, two edits at keep 0.5 and 1.
TOY_TASKS = {
    "engine": "toy",
    "tasks": ("niah_single", "vt"),
    "lengths": (160,),
    "samples": 3,
    "edits": ("knorm", "snapkv"),
    "keeps": (0.5, 1.0),
    "executor": "serial",
}


@pytest.fixture(scope="module")
def scored() -> TasksResult:
    """Every cell scored (min_accuracy 0: the toy model solves none)."""
    result = evaluate(EvalConfig(min_accuracy=0.0, **TOY_TASKS))
    assert isinstance(result, TasksResult)
    return result


def test_every_edit_and_keep_runs_on_every_scored_cell(scored: TasksResult) -> None:
    """Each cell's uncompressed row comes first, then one row per edit and
    keep on it, each over the cell's samples."""
    cells = [(r.task, r.length) for r in scored.rows if r.edit == "none"]
    assert cells == [("niah_single", 160), ("vt", 160)]
    edited = [(r.edit, r.keep, r.task) for r in scored.rows if r.edit != "none"]
    assert len(edited) == 2 * 2 * 2
    assert all(len(r.scores) == r.accuracy.n == 3 for r in scored.rows)
    assert not scored.dropped


def test_keeping_every_token_answers_as_the_uncompressed_model(
    scored: TasksResult,
) -> None:
    """At keep 1 an edit's answers score as the uncompressed model's,
    sample for sample, and its paired change is exactly 0; at keep 0.5
    about half the prompt is kept."""
    base = {r.task: r.scores for r in scored.rows if r.edit == "none"}
    for row in scored.rows:
        if row.keep == 1.0:
            assert row.scores == base[row.task]
            assert row.change is not None
            assert (row.change.low, row.change.high) == (0.0, 0.0)
        elif row.keep == 0.5:
            assert 0.4 < row.kept < 0.7


def test_cells_the_model_cannot_do_are_dropped_and_named(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Below min_accuracy a cell gets no edit rows; the table names it,
    with the uncompressed accuracy that dropped it."""
    config = EvalConfig(**{**TOY_TASKS, "tasks": ("vt",), "edits": ("knorm",)})
    result = evaluate(config)
    assert isinstance(result, TasksResult)
    assert result.rows == []
    assert [(r.task, r.length) for r in result.dropped] == [("vt", 160)]
    assert "not scored: vt at 160 tokens" in result.format()


def test_the_table_says_where_the_time_went(scored: TasksResult) -> None:
    """Every row times its answers, every edit its modify; the last line
    splits the eval's wall time into them and the rest, which sum to it."""
    assert all(r.answer_s > 0 for r in scored.rows)
    assert all(r.modify_s is not None for r in scored.rows if r.edit != "none")
    line = scored.format().splitlines()[-1]
    total, *parts = (float(x) for x in re.findall(r"(-?\d+) s\b", line))
    assert line.startswith("time: ") and len(parts) == 4
    assert abs(sum(parts) - total) <= len(parts)
    assert parts[-1] >= 0
    answers = sum(r.answer_s for r in scored.rows if r.edit != "none")
    assert f"their answers {answers:.0f} s" in line


def test_the_json_keeps_every_samples_score(scored: TasksResult) -> None:
    """The JSON has its schema, and each row its per-sample scores and
    intervals, so that two runs can be compared sample by sample."""
    data = scored.to_dict()
    assert data["schema"] == "lmcache-mp-eval-tasks/1"
    row = data["rows"][-1]
    assert len(row["scores"]) == 3
    assert set(row["accuracy"]) == {"mean", "low", "high", "n", "level"}
    assert row["change"]["n"] == 3


def test_task_flags_set_their_fields() -> None:
    """--tasks, --length, --samples and --min-accuracy land in the config;
    without --samples it takes enough for 5 points each side."""
    parser, _ = build_parser()
    args = parser.parse_args(
        ["eval", "--tasks", "vt,cwe", "--length", "1024,2048", "--samples", "60"]
    )
    config = eval_config_from_args(args.eval_parser, args)
    assert (config.tasks, config.lengths, config.samples) == (
        ("vt", "cwe"),
        (1024, 2048),
        60,
    )
    assert EvalConfig(tasks=("vt",)).sample_count == 385


def test_an_uncompressed_question_is_sent_after_the_modify() -> None:
    """With compress_question=False the streams hold the context alone and
    are sent the question after the modify: uncompressed, they answer as
    streams prefilled with the whole prompt (the same tokens reach the
    model), and an edit keeping every token changes nothing."""
    fields = {**TOY_TASKS, "edits": ("knorm",), "min_accuracy": 0.0}
    whole = evaluate(EvalConfig(**fields))
    apart = evaluate(EvalConfig(compress_question=False, **fields))
    assert isinstance(whole, TasksResult) and isinstance(apart, TasksResult)
    assert [r.scores for r in apart.rows if r.edit == "none"] == [
        r.scores for r in whole.rows if r.edit == "none"
    ]
    assert whole.tokens == apart.tokens
    for row in apart.rows:
        if row.keep == 1.0:
            assert row.change is not None
            assert (row.change.low, row.change.high) == (0.0, 0.0)


def test_a_question_apart_needs_tasks() -> None:
    """compress_question=False without tasks raises ValueError: only a
    task's prompt has a question apart from its context."""
    with pytest.raises(ValueError, match="compress_question=False needs"):
        EvalConfig(compress_question=False)


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"tasks": ("ruler",)}, "unknown task 'ruler'"),
        ({"tasks": ("vt", "vt")}, "names one twice"),
        ({"tasks": ("vt",), "lengths": ()}, "lengths is empty"),
        ({"tasks": ("vt",), "min_accuracy": 1.5}, "min_accuracy must be in"),
        ({"tasks": ("vt",), "generate": 8, "every": 4}, "leave out generate"),
    ],
    ids=["unknown", "twice", "no-length", "accuracy", "with-generate"],
)
def test_bad_task_options_are_refused(fields: dict[str, object], needle: str) -> None:
    """Unknown or repeated tasks, no length, an accuracy outside [0, 1], or
    tasks with a generation raise ValueError naming the problem."""
    with pytest.raises(ValueError, match=needle):
        EvalConfig(**fields)  # type: ignore[arg-type]


def test_cells_are_scored_one_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cell's uncompressed streams leave the batch (and its pins on their
    KV) before the next cell's are added, so that the store holds one
    cell's KV at a time; each cell's rows come together."""
    events: list[tuple[str, str]] = []
    add, remove = LMCacheBatchedStream.add, LMCacheBatchedStream.remove

    def spy_add(self: LMCacheBatchedStream, stream: Any) -> Any:
        if not stream.cache_salt:
            events.append(("add", stream.request_stream_id))
        return add(self, stream)

    def spy_remove(self: LMCacheBatchedStream, stream_id: str) -> Any:
        events.append(("remove", stream_id))
        return remove(self, stream_id)

    monkeypatch.setattr(LMCacheBatchedStream, "add", spy_add)
    monkeypatch.setattr(LMCacheBatchedStream, "remove", spy_remove)
    config = EvalConfig(
        **{
            **TOY_TASKS,
            "tasks": ("niah_single",),
            "lengths": (160, 176),
            "edits": ("snapkv",),
            "keeps": (1.0,),
        },
        min_accuracy=0.0,
    )
    result = evaluate(config)
    assert isinstance(result, TasksResult)
    assert [(r.length, r.edit) for r in result.rows] == [
        (160, "none"),
        (160, "snapkv"),
        (176, "none"),
        (176, "snapkv"),
    ]
    added = [i for i, (what, _) in enumerate(events) if what == "add"]
    assert len(added) == 2 * TOY_TASKS["samples"]
    second_cell = added[TOY_TASKS["samples"]]
    first_ids = {events[i][1] for i in added[: TOY_TASKS["samples"]]}
    removed_before = {sid for what, sid in events[:second_cell] if what == "remove"}
    assert first_ids <= removed_before
