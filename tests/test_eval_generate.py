"""``lmcache-mp eval --generate G --every N``: each edit compresses the
cache every N tokens of the uncompressed greedy generation, scored
teacher-forced along it and free-running against it, with decode speed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmcache_mp.__main__ import main
from lmcache_mp.eval import GENERATE_SCHEMA, EvalConfig, GenerateResult, evaluate

GENERATE, EVERY, BUDGET = 40, 16, 64
TOY = {"engine": "toy", "prompts": 3, "chunk_size": 16, "workers": 2}


@pytest.fixture(scope="module")
def generated() -> GenerateResult:
    """window and snapkv at a 64-token budget, and window at a budget no
    stream reaches, on the toy model with the process pool."""
    result = evaluate(
        EvalConfig(
            edits=("window", "snapkv"),
            generate=GENERATE,
            every=EVERY,
            budget=BUDGET,
            **TOY,
        )
    )
    assert isinstance(result, GenerateResult)
    return result


def test_the_first_round_is_scored_before_any_compression(
    generated: GenerateResult,
) -> None:
    """Every edit's first round scores the reference's first N tokens after
    the uncompressed cache: the reference itself."""
    for row in generated.rows[1:]:
        assert row.round_top1[0] == 1.0
        assert row.round_kl[0] == pytest.approx(0.0, abs=1e-6)


def test_there_is_a_round_per_every_tokens(generated: GenerateResult) -> None:
    """The generation's tokens are scored in ceil(G / N) rounds."""
    for row in generated.rows:
        assert len(row.round_top1) == len(row.round_kl) == -(-GENERATE // EVERY)


def test_compressing_changes_what_the_model_predicts(
    generated: GenerateResult,
) -> None:
    """Cut to 64 tokens of ~270, the later rounds' distributions move away
    from the reference's, and so does the free-running output."""
    for row in generated.rows[1:]:
        assert row.kl > 0.01
        assert row.round_kl[-1] > row.round_kl[0]
        assert row.common_prefix < GENERATE


def test_the_budget_bounds_the_cache_at_the_end(generated: GenerateResult) -> None:
    """The last token of a compressed generation attends to at most the
    budget and the tokens decoded since the last round; the uncompressed
    one to the prompt and the whole generation."""
    none, *edits = generated.rows
    assert none.speed.kv_tokens == pytest.approx(generated.prompt_tokens + GENERATE - 1)
    last = GENERATE - (GENERATE - 1) // EVERY * EVERY
    for row in edits:
        assert row.speed.kv_tokens <= BUDGET + last - 1
        assert row.speed.modify_s > 0
        assert row.thread_modify_s is not None and row.thread_modify_s > 0


def test_an_edit_keeping_everything_keeps_the_generation() -> None:
    """A budget no stream reaches changes nothing: agreement 1, KL 0, and
    the free-running output is the reference, token for token."""
    result = evaluate(
        EvalConfig(edits=("window",), generate=24, every=8, budget=100_000, **TOY)
    )
    assert isinstance(result, GenerateResult)
    row = result.rows[1]
    assert row.top1 == 1.0
    assert row.kl == pytest.approx(0.0, abs=1e-6)
    assert row.exact == 1.0
    assert row.common_prefix == 24


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"every": 8}, "every needs EvalConfig.generate"),
        ({"budget": 8}, "budget needs EvalConfig.generate"),
        ({"generate": 8}, "generate needs EvalConfig.every"),
        ({"generate": 8, "every": 0}, "every must be an int >= 1"),
        (
            {"generate": 8, "every": 4, "server": "http://x", "store": "shm:///x"},
            "generate runs on the embedded engines",
        ),
    ],
)
def test_bad_generation_options_are_refused(
    fields: dict[str, object], message: str
) -> None:
    """Generation options without --generate, --generate without --every, a
    zero count or a server are refused, naming the problem."""
    with pytest.raises(ValueError, match=message):
        EvalConfig(**fields)  # type: ignore[arg-type]


def test_the_cli_prints_the_table_and_writes_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``eval --generate --every --budget --json`` prints a row per edit and
    writes the rounds' figures."""
    path = tmp_path / "generate.json"
    argv = ["eval", "--engine", "toy", "--prompts", "2", "--edits", "window"]
    argv += ["--generate", "16", "--every", "8", "--budget", "32", "--json", str(path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "eval --generate 16 --every 8" in out
    assert "budget 32" in out
    data = json.loads(path.read_text())
    assert data["schema"] == GENERATE_SCHEMA
    assert [r["edit"] for r in data["rows"]] == ["none", "window"]
    assert len(data["rows"][1]["round_top1"]) == 2


def test_plot_with_generate_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--plot draws keeps; with --generate it exits with status 2."""
    argv = ["eval", "--engine", "toy", "--generate", "8", "--every", "4"]
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--plot", str(tmp_path / "p.png")])
    assert exit_info.value.code == 2
    assert "not with --generate" in capsys.readouterr().err
