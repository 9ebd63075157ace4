"""``lmcache-mp eval --compare kvpress``: NVIDIA kvpress's
presses on the same model, prompts and keeps, set beside the matching
lmcache_mp edits."""

from __future__ import annotations

from typing import Any

import pytest
from kvpress import KnormPress, RandomPress, SnapKVPress, TOVAPress
from kvpress.attention_patch import patch_attention_functions

from lmcache_mp.__main__ import build_parser
from lmcache_mp.engine._hf_attention import register
from lmcache_mp.eval import (
    EvalConfig,
    EvalResult,
    GenerateResult,
    TasksResult,
    evaluate,
)
from lmcache_mp.eval._cli import eval_config_from_args
from lmcache_mp.eval._kvpress import (
    PRESSES,
    context_length,
    counterpart,
    make_press,
)

KEEP = 0.5


def compare_on_smollm2(**fields: Any) -> EvalResult | GenerateResult | TasksResult:
    """The eval on SmolLM2 at half the prompt with kvpress beside it.
    kvpress wraps every attention function registered when it patches
    them, as it does when the CLI imports it after the model is loaded.
    The streams run on threads, over the model kvpress runs (a process
    pool would load a copy in each worker; the SmolLM2 eval on the pool
    is tested in test_eval_generate.py)."""
    register()
    patch_attention_functions()
    return evaluate(
        EvalConfig(
            keeps=(KEEP,),
            engine="smollm2-135m",
            compare=("kvpress",),
            executor="thread",
            workers=2,
            **fields,
        )
    )


@pytest.fixture(scope="module")
def compared() -> TasksResult:
    """One task at one length, knorm and snapkv at half the prompt, with
    kvpress's KnormPress and SnapKVPress beside them, on SmolLM2."""
    result = compare_on_smollm2(
        edits=("knorm", "snapkv"),
        tasks=("niah_single",),
        lengths=(256,),
        samples=6,
        min_accuracy=0.0,
    )
    assert isinstance(result, TasksResult)
    return result


def test_kvpress_uncompressed_answers_equal_lmcache_mps(compared: TasksResult) -> None:
    """On the same prompts, kvpress's uncompressed model (the context's
    prefill, then the rest of the prompt at its positions) answers as the
    eval's own uncompressed streams do, sample for sample."""
    none = [r for r in compared.rows if r.edit == "none"]
    assert [r.by for r in none] == ["lmcache_mp", "kvpress"]
    assert none[1].scores == none[0].scores
    assert none[1].kept == 1.0


def test_each_press_is_set_beside_its_edit(compared: TasksResult) -> None:
    """Rows come in order: the uncompressed pair, then each edit followed
    by its kvpress counterpart, with the press named."""
    assert [(r.edit, r.by) for r in compared.rows] == [
        ("none", "lmcache_mp"),
        ("none", "kvpress"),
        ("knorm", "lmcache_mp"),
        ("knorm", "kvpress KnormPress"),
        ("snapkv", "lmcache_mp"),
        ("snapkv", "kvpress SnapKVPress"),
    ]
    text = compared.format()
    assert "kvpress SnapKVPress" in text
    assert "kvpress rows: its press in the context's prefill" in text


def test_a_press_keeps_what_its_edit_keeps(compared: TasksResult) -> None:
    """At the same keep, a press leaves about the share of the prompt its
    edit leaves (the same context, one subset per head or per stream), and
    its change is paired with kvpress's own uncompressed scores."""
    rows = {(r.edit, r.by.split()[0]): r for r in compared.rows}
    for edit in ("knorm", "snapkv"):
        ours, theirs = rows[edit, "lmcache_mp"], rows[edit, "kvpress"]
        assert theirs.kept < 0.75
        assert theirs.kept == pytest.approx(ours.kept, abs=0.05)
        assert theirs.change is not None
        assert theirs.accuracy.n == ours.accuracy.n == 6
        assert theirs.modify_s is not None and theirs.modify_s > 0


@pytest.fixture(scope="module")
def documents() -> EvalResult:
    """The document eval (teacher-forced agreement and KL, passkeys) with
    knorm at half the prompt and KnormPress beside it, on SmolLM2."""
    result = compare_on_smollm2(edits=("knorm",), prompts=2, continuation=8)
    assert isinstance(result, EvalResult)
    return result


def test_kvpress_uncompressed_scores_equal_the_reference(documents: EvalResult) -> None:
    """Teacher-forced after kvpress's uncompressed prefill, the reference
    continuation scores as after the eval's own cache: the same top-1
    agreement, a KL of zero up to rounding, the same passkey answers."""
    ours, theirs = documents.rows[:2]
    assert (ours.by, theirs.by) == ("lmcache_mp", "kvpress")
    assert theirs.agreement == ours.agreement
    assert theirs.kl == pytest.approx(0.0, abs=1e-4)
    assert theirs.passkey == ours.passkey
    assert theirs.kept == 1.0


def test_a_press_is_scored_beside_its_edit_on_the_documents(
    documents: EvalResult,
) -> None:
    """The press's row follows its edit's, keeps about as much, is timed,
    and its compression shows in the KL; the table names it."""
    assert [(r.edit, r.by) for r in documents.rows] == [
        ("none", "lmcache_mp"),
        ("none", "kvpress"),
        ("knorm", "lmcache_mp"),
        ("knorm", "kvpress KnormPress"),
    ]
    ours, theirs = documents.rows[2:]
    assert theirs.kept == pytest.approx(ours.kept, abs=0.05) and theirs.kept < 0.75
    assert theirs.kl > 1e-3
    assert theirs.modify_s is not None and theirs.modify_s > 0
    assert "kvpress KnormPress" in documents.format()


BUDGET = 96


@pytest.fixture(scope="module")
def generated() -> GenerateResult:
    """Compression while generating (16 tokens after 160-token documents,
    every 8, budget 96) with knorm and kvpress's DecodingPress around
    KnormPress, on SmolLM2."""
    result = compare_on_smollm2(
        edits=("knorm",),
        prompts=2,
        prompt_tokens=160,
        generate=16,
        every=8,
        budget=BUDGET,
    )
    assert isinstance(result, GenerateResult)
    return result


def test_kvpress_uncompressed_generation_is_the_reference(
    generated: GenerateResult,
) -> None:
    """One token per forward, kvpress's uncompressed model generates the
    eval's reference and scores it as the eval does: exact outputs, the
    same top-1 agreement, a KL of zero up to rounding."""
    ours, theirs = generated.rows[:2]
    assert (ours.by, theirs.by) == ("lmcache_mp", "kvpress")
    assert theirs.exact == 1.0 and theirs.common_prefix == 16
    assert theirs.top1 == ours.top1
    assert theirs.kl == pytest.approx(0.0, abs=1e-4)


def test_a_decoding_press_is_set_beside_its_edit(generated: GenerateResult) -> None:
    """DecodingPress(KnormPress) follows knorm at the same budget: it ends
    with about as many cached tokens (the budget and the last round's),
    its compression shows in the KL, and the table names it."""
    assert [(r.edit, r.size, r.by) for r in generated.rows] == [
        ("none", "-", "lmcache_mp"),
        ("none", "-", "kvpress"),
        ("knorm", f"budget {BUDGET}", "lmcache_mp"),
        ("knorm", f"budget {BUDGET}", "kvpress DecodingPress(KnormPress)"),
    ]
    ours, theirs = generated.rows[2:]
    assert BUDGET < theirs.speed.kv_tokens <= BUDGET + 8
    assert abs(theirs.speed.kv_tokens - ours.speed.kv_tokens) <= 2
    assert theirs.kl > 1e-3 and len(theirs.round_kl) == 2
    assert "DecodingPress(KnormPress)" in generated.format()


def test_presses_are_built_from_keep() -> None:
    """A press drops ``1 - keep`` of the context; RandomPress takes the
    seed; every press named has an lmcache_mp edit beside it."""
    knorm = make_press("knorm", 0.25)
    assert isinstance(knorm, KnormPress)
    assert knorm.compression_ratio == pytest.approx(0.75)
    random_press = make_press("random", 0.5, seed=3)
    assert isinstance(random_press, RandomPress) and random_press.seed == 3
    assert isinstance(make_press("snapkv", 0.5), SnapKVPress)
    assert set(PRESSES) <= set(EvalConfig().edits)


def test_a_rows_press_and_label_come_from_the_edit() -> None:
    """An edit's counterpart is its press labelled "kvpress <Press>"; no edit
    is kvpress's uncompressed model, labelled "kvpress"."""
    press, label = counterpart("tova", 0.5)
    assert isinstance(press, TOVAPress) and label == "kvpress TOVAPress"
    assert press.compression_ratio == pytest.approx(0.5)
    assert counterpart(None, None) == (None, "kvpress")


@pytest.mark.parametrize(
    ("tokens", "chunk", "context"),
    [(100, 16, 96), (96, 16, 95), (17, 16, 16), (10, 16, 1), (2, 16, 1)],
)
def test_the_context_is_what_an_edit_is_given(
    tokens: int, chunk: int, context: int
) -> None:
    """The compressed context is the prompt's chunk-aligned prefix, short
    of the last token, which is always computed; a prompt with no full
    chunk gives one token (an edit is given none)."""
    assert context_length(tokens, chunk) == context


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"compare": ("vllm",)}, "unknown implementation 'vllm'"),
        (
            {"compare": ("kvpress",), "tasks": ("vt",), "engine": "toy"},
            "compare runs with a trained model",
        ),
        (
            {"compare": ("kvpress",), "engine": "toy"},
            "compare runs with a trained model",
        ),
        (
            {"compare": ("kvpress",), "generate": 64, "every": 32},
            "compare with generate needs EvalConfig.budget",
        ),
    ],
)
def test_bad_compare_options_are_refused(
    fields: dict[str, object], message: str
) -> None:
    """An unknown implementation, compare on the toy engine, or compare
    while generating without a budget (DecodingPress keeps a token count)
    is refused, naming the problem."""
    with pytest.raises(ValueError, match=message):
        EvalConfig(**fields)  # type: ignore[arg-type]


def test_the_cli_takes_compare() -> None:
    """``--compare kvpress`` with ``--tasks`` reaches the config."""
    parser, _ = build_parser()
    args = parser.parse_args(["eval", "--tasks", "vt", "--compare", "kvpress"])
    assert eval_config_from_args(args.eval_parser, args).compare == ("kvpress",)
