"""Specification of ``lmcache-mp eval``: its figures follow
their definitions, its prompts are what they say, its outputs are written.
The toy engine runs where the model is not the point; one test runs
SmolLM2-135M."""

from __future__ import annotations

import json
import math
import re
import secrets
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from lmcache_mp.__main__ import build_parser, main
from lmcache_mp._harness.agreement import kl_divergence, top1_agreement
from lmcache_mp._harness.prompts import (
    FILLER,
    document_prompts,
    passkey_prompt,
    passkey_prompts,
)
from lmcache_mp.engine.http.server import serve
from lmcache_mp.errors import CacheKindError, KVConfigError
from lmcache_mp.eval import EVAL_SCHEMA, EvalConfig, EvalResult, evaluate
from lmcache_mp.eval._cli import eval_config_from_args
from lmcache_mp.kv import connect

#: A small eval on the toy model: two documents, short continuations.
TOY = {"engine": "toy", "prompts": 2, "continuation": 6, "haystack_lines": 4}


@pytest.fixture(scope="module")
def toy_result() -> EvalResult:
    """window and snapkv at keep 0.5 and 1 on the toy model, modify on the
    process pool (shared by the tests that read a result)."""
    return evaluate(
        EvalConfig(edits=("window", "snapkv"), keeps=(0.5, 1.0), workers=2, **TOY)
    )


def rows(result: EvalResult, keep: float) -> list[dict[str, float]]:
    return [r.__dict__ for r in result.rows[1:] if r.keep == keep]


# -- the figures' definitions --------------------------------------------------------


def test_kl_divergence_is_the_sum_of_p_log_p_over_q() -> None:
    """kl_divergence(ref, edit) is sum_v p_ref (log p_ref - log p_edit) per row, 0 for identical rows."""
    p, q = np.array([0.5, 0.3, 0.2]), np.array([0.2, 0.2, 0.6])
    logs = np.log(np.stack([p, p])).astype(np.float32)
    other = np.log(np.stack([q, p])).astype(np.float32)
    expected = sum(pi * math.log(pi / qi) for pi, qi in zip(p, q, strict=True))
    kl = kl_divergence(logs, other)
    assert kl[0] == pytest.approx(expected, rel=1e-5)
    assert kl[1] == pytest.approx(0.0, abs=1e-7)


def test_top1_agreement_compares_each_rows_argmax_with_the_reference() -> None:
    """A row agrees when its most likely token is the reference token at that position."""
    logprobs = np.log(np.array([[0.7, 0.2, 0.1], [0.1, 0.3, 0.6]], np.float32))
    assert top1_agreement(logprobs, [0, 2]).tolist() == [True, True]
    assert top1_agreement(logprobs, [1, 2]).tolist() == [False, True]


def test_keeping_every_token_keeps_the_output(toy_result: EvalResult) -> None:
    """At keep 1 every edit agrees on every reference token and its KL is 0: the copied KV is the uncompressed one."""
    for row in rows(toy_result, 1.0):
        assert row["kept"] == 1.0
        assert row["agreement"] == 1.0
        assert row["kl"] == pytest.approx(0.0, abs=1e-6)


def test_dropping_tokens_changes_the_distributions(toy_result: EvalResult) -> None:
    """At keep 0.5 about half the prompt is kept and the next-token distributions move away from the uncompressed run's."""
    for row in rows(toy_result, 0.5):
        assert 0.4 < row["kept"] < 0.6
        assert row["kl"] > 0.0
        assert 0.0 <= row["agreement"] <= 1.0


def test_the_uncompressed_row_comes_first_and_every_edit_keep_follows(
    toy_result: EvalResult,
) -> None:
    """Row 0 is the uncompressed run (KL 0, no modify); then one row per edit and keep, with both modify times."""
    base, *others = toy_result.rows
    assert (base.edit, base.keep, base.kl, base.modify_s) == ("none", 1.0, 0.0, None)
    assert base.agreement == 1.0
    assert [(r.edit, r.keep) for r in others] == [
        ("window", 0.5),
        ("window", 1.0),
        ("snapkv", 0.5),
        ("snapkv", 1.0),
    ]
    assert all(r.modify_s is not None and r.thread_modify_s is not None for r in others)


def test_the_table_has_a_line_per_row(toy_result: EvalResult) -> None:
    """format() prints the columns and one line per edit and keep."""
    text = toy_result.format()
    assert "top-1 agree" in text and "KL (nats)" in text and "passkey" in text
    lines = [line.split()[:2] for line in text.splitlines()]
    for row in toy_result.rows:
        assert [row.edit, f"{row.keep:g}"] in lines


def test_json_and_plot_are_written(toy_result: EvalResult, tmp_path: Path) -> None:
    """write_json writes the schema, config and one object per row; write_plot writes a PNG."""
    out_json, out_png = tmp_path / "eval.json", tmp_path / "eval.png"
    toy_result.write_json(out_json)
    toy_result.write_plot(out_png)
    data = json.loads(out_json.read_text())
    assert data["schema"] == EVAL_SCHEMA
    assert data["config"]["edits"] == ["window", "snapkv"]
    assert [r["edit"] for r in data["rows"]] == [r.edit for r in toy_result.rows]
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- the prompts ---------------------------------------------------------------------


@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 1.0])
def test_a_passkey_prompt_hides_the_number_at_the_asked_depth(depth: float) -> None:
    """The number appears in the needle after round(depth * lines) filler lines, followed by the rest of the filler and the question."""
    lines = 8
    prompt = passkey_prompt(12345, depth, lines)
    before, _, after = prompt.text.partition("The pass key is 12345.")
    assert before.count(FILLER) == round(depth * lines)
    assert after.count(FILLER) == lines - round(depth * lines)
    assert prompt.text.rstrip().endswith("What is the pass key? The pass key is")
    assert prompt.depth == round(depth * lines) / lines


def test_passkey_prompts_spread_their_needles_and_draw_5_digit_keys() -> None:
    """Needle i sits at depth (i + 0.5) / count; keys are 5-digit, the same for the same seed."""
    prompts = passkey_prompts(4, 8, seed=3)
    assert [p.depth for p in prompts] == [
        round((i + 0.5) / 4 * 8) / 8 for i in range(4)
    ]
    assert all(10_000 <= p.key <= 99_999 for p in prompts)
    assert prompts == passkey_prompts(4, 8, seed=3)


def test_an_answer_states_the_key_only_as_a_whole_number() -> None:
    """found_in accepts the key among other words, not inside a longer number."""
    prompt = passkey_prompt(12345, 0.5, 2)
    assert prompt.found_in(" 12345. Remember it.")
    assert not prompt.found_in(" 123456")
    assert not prompt.found_in(" 1234")


def test_document_prompts_differ() -> None:
    """Each document prompt is a different text, also past the shipped documents."""
    texts = document_prompts(20)
    assert len(set(texts)) == 20


# -- the command line ------------------------------------------------------------------


def test_the_cli_parses_edits_keeps_and_counts() -> None:
    """eval's flags become the EvalConfig's fields."""
    parser, _ = build_parser()
    args = parser.parse_args(
        [
            "eval",
            "--edits",
            "knorm,tova",
            "--keep",
            "0.25,0.5",
            "--continuation",
            "8",
            "--prompts",
            "3",
            "--executor",
            "thread",
            "--engine",
            "toy",
        ]
    )
    config = eval_config_from_args(args.eval_parser, args)
    assert config.edits == ("knorm", "tova")
    assert config.keeps == (0.25, 0.5)
    assert (config.continuation, config.prompts) == (8, 3)
    assert (config.executor, config.engine) == ("thread", "toy")
    assert config.rerotate is None


@pytest.mark.parametrize(
    ("flags", "value"),
    [
        (["--rerotate"], True),
        (["--rerotate", "shift"], "shift"),
        (["--rerotate", "compact"], "compact"),
        (["--no-rerotate"], False),
    ],
)
def test_rerotate_applies_to_every_edit(flags: list[str], value: bool | str) -> None:
    """--rerotate [MODE] / --no-rerotate set EvalConfig.rerotate, which every
    edit is built with."""
    parser, _ = build_parser()
    args = parser.parse_args(["eval", *flags])
    assert eval_config_from_args(args.eval_parser, args).rerotate == value


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--edits", "random,nope"], "unknown edit 'nope'"),
        (["--keep", "0.5,1.5"], "fraction in (0, 1]"),
        (["--prompts", "0"], "integer >= 1"),
        (["--rerotate", "original"], "expected 'compact' or 'shift'"),
        (["--rerotate", "--no-rerotate"], "not allowed with"),
    ],
)
def test_bad_flags_are_usage_errors(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """An unknown edit, a keep outside (0, 1] or a zero count exits with status 2 naming the problem."""
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", *flags])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_the_cli_prints_the_table_and_writes_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A toy run on threads prints the table (one modify column) and writes the JSON."""
    out = tmp_path / "eval.json"
    status = main(
        [
            "eval",
            "--engine",
            "toy",
            "--edits",
            "streamingllm",
            "--keep",
            "0.5",
            "--prompts",
            "1",
            "--continuation",
            "4",
            "--haystack-lines",
            "2",
            "--executor",
            "thread",
            "--json",
            str(out),
        ]
    )
    assert status == 0
    printed = capsys.readouterr().out
    assert re.search(r"^streamingllm\s+0\.5\s", printed, re.MULTILINE)
    assert "modify thread (s)" in printed
    assert json.loads(out.read_text())["rows"][1]["edit"] == "streamingllm"


# -- through a server --------------------------------------------------------------------


@pytest.fixture
def served_store() -> Iterator[tuple[str, str]]:
    """lmcache-mp serve (the toy model) on a named store: its URL and the store's."""
    store = f"shm:///test-eval-serve-{secrets.token_hex(6)}"
    try:
        with serve(port=0, store=store, chunk_size=16) as srv:
            yield srv.url, store
    finally:
        connect(store, chunk_size=16).destroy()


def test_an_eval_through_serve_keeps_the_local_evals_agreement(
    served_store: tuple[str, str],
) -> None:
    """With --server (prefill, decode and scoring on lmcache-mp serve, sharing the store) KV-only edits keep exactly the local eval's kept share, top-1 agreement and passkey; KL is the top-20 approximation, 0 uncompressed and > 0 where tokens were dropped."""
    url, store = served_store
    config = EvalConfig(
        edits=("window", "knorm"), keeps=(0.5,), executor="thread", **TOY
    )
    local = evaluate(config)
    served = evaluate(config, server=url, store=store)

    def figures(result: EvalResult) -> list[tuple[object, ...]]:
        return [(r.edit, r.keep, r.kept, r.agreement, r.passkey) for r in result.rows]

    assert figures(served) == figures(local)
    assert served.rows[0].kl == 0.0
    assert all(r.kl > 0 for r in served.rows[1:])


def test_a_server_needs_the_store() -> None:
    """server without store is an invalid config naming the store."""
    with pytest.raises(ValueError, match="store"):
        EvalConfig(server="http://127.0.0.1:1", edits=("window",))


def test_query_edits_through_serve_read_the_queries_it_records() -> None:
    """With serve --record-queries, snapkv through the server keeps the local eval's agreement; a server that records none is refused before any stream runs, naming the edit."""
    store = f"shm:///test-eval-queries-{secrets.token_hex(6)}"
    config = EvalConfig(edits=("snapkv",), keeps=(0.5,), executor="thread", **TOY)
    try:
        with serve(port=0, store=store, chunk_size=16, record_queries=True) as srv:
            served = evaluate(config, server=srv.url, store=store)
        with (
            serve(port=0, store=store, chunk_size=16) as srv,
            pytest.raises(CacheKindError, match="snapkv"),
        ):
            evaluate(config, server=srv.url, store=store)
    finally:
        connect(store, chunk_size=16).destroy()
    local = evaluate(config)
    assert [r.agreement for r in served.rows] == [r.agreement for r in local.rows]
    assert [r.kept for r in served.rows] == [r.kept for r in local.rows]


def test_the_cli_refuses_server_without_store(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """eval --server without --store exits 2 saying what is needed."""
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", "--engine", "toy", "--edits", "window", "--server", "http://h"])
    assert exit_info.value.code == 2
    assert "needs EvalConfig.store" in capsys.readouterr().err


def test_a_server_on_another_chunk_size_is_refused_up_front(
    served_store: tuple[str, str],
) -> None:
    """A server whose model card gives another chunk size than the eval's raises KVConfigError naming it, before any stream runs."""
    url, store = served_store
    with pytest.raises(KVConfigError, match="chunk_size"):
        evaluate(
            EvalConfig(edits=("window",), keeps=(0.5,), chunk_size=32, **TOY),
            server=url,
            store=store,
        )


# -- a trained model -------------------------------------------------------------------


def test_smollm2_finds_the_passkey_uncompressed_and_edits_move_its_output() -> None:
    """On SmolLM2-135M the uncompressed run finds every passkey and its scorer agrees with its greedy decode; dropping half the prompt moves the distributions (KL > 0) while agreement stays a fraction."""
    result = evaluate(
        EvalConfig(
            engine="smollm2-135m",
            edits=("knorm", "snapkv"),
            keeps=(0.5,),
            prompts=2,
            continuation=8,
            haystack_lines=6,
            answer_tokens=6,
            executor="thread",
        )
    )
    base, *edited = result.rows
    assert base.passkey == 1.0
    assert base.agreement == 1.0
    for row in edited:
        assert row.kl > 0.0
        assert 0.0 <= row.agreement <= 1.0
