"""``lmcache-mp eval --generate G --every N``: each edit compresses the
cache every N tokens of the uncompressed greedy generation, scored
teacher-forced along it and free-running against it, with decode speed."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from lmcache_mp import connect
from lmcache_mp.__main__ import main
from lmcache_mp._harness.agreement import kl_divergence, top1_agreement
from lmcache_mp._harness.prompts import document_tokens
from lmcache_mp.engine import HFEngine
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


def _greedy_and_sliced_logprobs(
    hf: HFEngine, prompt: list[int], generate: int, every: int, budget: int
) -> tuple[list[int], np.ndarray, np.ndarray]:
    """By hand, with transformers alone: the uncompressed greedy generation,
    its log-probabilities over the second round's tokens, and theirs after
    the first round's KV (prompt + ``every`` generated tokens, computed
    against the whole cache) is cut to ``window``'s 4 sinks and most recent
    tokens, keys left at their positions, the last kept token recomputed
    (as every engine does with a cached prompt's last token)."""
    from transformers import DynamicCache

    model = hf.model

    def forward(tokens: list[int], start: int, cache: Any) -> Any:
        return hf.forward(tokens, start, cache).logits[0].float().log_softmax(-1)

    with torch.inference_mode():
        whole = DynamicCache(config=model.config)
        logprobs = forward(prompt, 0, whole)[-1]
        tokens: list[int] = []
        for step in range(generate):
            tokens.append(int(logprobs.argmax()))
            logprobs = forward(tokens[-1:], len(prompt) + step, whole)[-1]
        reference = forward(
            [*prompt, *tokens[:-1]], 0, DynamicCache(config=model.config)
        )
        first = DynamicCache(config=model.config)
        forward([*prompt, *tokens[:every]], 0, first)
        total = len(prompt) + every
        kept = [*range(4), *range(total - (budget - 4), total)]
        cut = DynamicCache(config=model.config)
        rows = torch.tensor(kept[:-1])
        for index, layer in enumerate(first.layers):
            cut.update(layer.keys[:, :, rows], layer.values[:, :, rows], index)
        last = [*prompt, *tokens][kept[-1]]
        edited = forward([last, *tokens[every : 2 * every - 1]], budget - 1, cut)
    second = slice(len(prompt) - 1 + every, len(prompt) - 1 + 2 * every)
    return tokens, reference[second].numpy(), edited.numpy()


def test_teacher_forced_rounds_equal_cutting_the_kv_by_hand() -> None:
    """On SmolLM2, the second round's top-1 agreement and KL are those of
    the reference's tokens scored after the first round's KV cut by hand
    with transformers: the rounds score what the edit left, at the
    positions an engine decodes at."""
    prompt_tokens, generate, every, budget = 96, 32, 16, 48
    result = evaluate(
        EvalConfig(
            edits=("window",),
            engine="smollm2-135m",
            prompts=1,
            prompt_tokens=prompt_tokens,
            generate=generate,
            every=every,
            budget=budget,
            chunk_size=16,
            workers=2,
        )
    )
    assert isinstance(result, GenerateResult)
    ctx = connect(chunk_size=16)
    try:
        hf = HFEngine.from_pretrained("smollm2-135m", ctx)
        encode = functools.partial(hf.encode, chat=False)
        prompt = document_tokens(encode, 1, prompt_tokens)[0]
        tokens, reference, edited = _greedy_and_sliced_logprobs(
            hf, prompt, generate, every, budget
        )
    finally:
        ctx.destroy()
    top1 = float(top1_agreement(edited, tokens[every : 2 * every]).mean())
    kl = float(kl_divergence(reference, edited).mean())
    row = result.rows[1]
    assert row.round_top1[1] == pytest.approx(top1)
    assert row.round_kl[1] == pytest.approx(kl, rel=1e-3, abs=1e-4)
    assert kl > 0.01
