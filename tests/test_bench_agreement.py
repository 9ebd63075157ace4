"""The bench on a trained model, and the edit's agreement with the
uncompressed run that every point on a scoring engine reports."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from lmcache_mp._harness.prompts import DOCUMENTS, document_tokens
from lmcache_mp.bench import BenchConfig, run_bench
from lmcache_mp.bench._table import format_point

#: The toy model, small enough that a run takes about a second.
TOY: dict[str, Any] = {
    "engine": "toy",
    "streams": 2,
    "prompt_tokens": 64,
    "layers": 2,
    "kv_heads": 2,
    "head_dim": 8,
    "max_tokens": 6,
    "chunk_size": 16,
}


@pytest.fixture(scope="module")
def toy_points() -> dict[str, dict[str, Any]]:
    """One serial run each of identity and window on the toy model, by edit."""
    config = BenchConfig(executors=("serial",), edits=("identity", "window"), **TOY)
    result = run_bench(config, progress=False)
    return {point["edit"]: point for point in result.to_dict()["points"]}


def test_an_edit_that_changes_nothing_agrees_fully(
    toy_points: dict[str, dict[str, Any]],
) -> None:
    """identity re-stores the same KV: every position's most likely token is
    the reference's and the distributions are the same (KL 0)."""
    measured = toy_points["identity"]["agreement"]
    assert measured["top1"] == 1.0
    assert measured["kl"] == pytest.approx(0.0, abs=1e-9)
    assert measured["positions"] == TOY["streams"] * TOY["max_tokens"]


def test_dropping_tokens_moves_the_distributions(
    toy_points: dict[str, dict[str, Any]],
) -> None:
    """window keeps half of the tokens: the next-token distributions after
    it differ from the uncompressed run's (KL > 0) and top-1 is a fraction."""
    measured = toy_points["window"]["agreement"]
    assert measured["kl"] > 1e-6
    assert 0.0 <= measured["top1"] <= 1.0


def test_the_table_prints_the_agreement(
    toy_points: dict[str, dict[str, Any]],
) -> None:
    """The point's text names the agreement, its figures and that the toy
    model's says little of a trained model's."""
    text = format_point(toy_points["window"])
    measured = toy_points["window"]["agreement"]
    assert f"top-1 {measured['top1']:.3f}" in text
    assert f"KL {measured['kl']:.3f} nats" in text
    assert "random weights" in text


def test_an_engine_that_cannot_score_reports_no_agreement() -> None:
    """The synthetic engine has no model to score with: no agreement."""
    config = BenchConfig(
        executors=("serial",), edits=("stride",), **{**TOY, "engine": "synthetic"}
    )
    point = run_bench(config, progress=False).to_dict()["points"][0]
    assert point["agreement"] is None
    assert "AGREEMENT" not in format_point(point)


def test_document_tokens_are_prose_of_the_asked_length() -> None:
    """Each prompt has exactly the asked tokens, starts at its own document
    (so prompts share no cached prefix) and runs on through the next ones."""

    def encode(text: str) -> list[int]:
        return [ord(c) for c in text]

    prompts = document_tokens(encode, 3, 1000)
    assert [len(p) for p in prompts] == [1000] * 3
    for i, prompt in enumerate(prompts):
        text = "".join(map(chr, prompt))
        assert text.startswith(DOCUMENTS[i])
        assert DOCUMENTS[i + 1][:50] in text


@pytest.fixture(scope="module")
def model_point() -> dict[str, Any]:
    """The bench's default engine, SmolLM2-135M, at a small size, on
    threads (tests/test_hf_engine.py checks the pool decodes as threads)."""
    config = BenchConfig(
        executors=("thread",), streams=2, prompt_tokens=96, max_tokens=8, chunk_size=32
    )
    result = run_bench(config, progress=False)
    return result.to_dict()["points"][0]


def test_the_default_engine_is_the_trained_model_with_its_kv_shape(
    model_point: dict[str, Any],
) -> None:
    """The run reports SmolLM2-135M's own KV shape (30 layers x 3 KV heads x
    64, float32), not the toy defaults, and prefills every prompt token."""
    cfg = model_point["config"]
    assert cfg["engine"] == "smollm2-135m"
    assert (cfg["layers"], cfg["kv_heads"], cfg["head_dim"], cfg["dtype"]) == (
        30,
        3,
        64,
        "float32",
    )
    prefill = model_point["executors"]["thread"]["phases"]["prefill"]
    assert prefill["input_tokens"]["median"] == 2 * 96


def test_the_trained_model_reports_the_edits_agreement(
    model_point: dict[str, Any],
) -> None:
    """pyscore drops half of the prompt: on the trained model the agreement
    is measured over every position, and the edit changed something."""
    measured = model_point["agreement"]
    assert measured["positions"] == 2 * 8
    assert 0.0 <= measured["top1"] <= 1.0
    assert measured["kl"] > 1e-4
    assert np.isfinite(measured["kl"])
    assert "AGREEMENT with the uncompressed run (smollm2-135m)" in format_point(
        model_point
    )


def test_without_the_model_extra_the_cli_names_the_toy_engine(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``lmcache-mp bench`` on the default model without transformers exits
    1 with the install hint and the way to run without it."""
    from lmcache_mp.__main__ import main

    def missing(self: BenchConfig) -> BenchConfig:
        raise ImportError("HFEngine needs transformers and torch: pip install ...")

    monkeypatch.setattr(BenchConfig, "with_model_dims", missing)
    assert main(["bench", "--streams=1", "--prompt-tokens=8"]) == 1
    err = capsys.readouterr().err
    assert "HFEngine needs transformers" in err and "--engine toy" in err
