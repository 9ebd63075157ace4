"""Specification of ``lmcache-mp bench``: its CLI, its figures, its JSON, its plot."""

from __future__ import annotations

import copy
import dataclasses
import io
import json
import mmap
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest

import lmcache_mp.bench._peers
import lmcache_mp.bench._result as bench_result
from lmcache_mp.__main__ import build_parser, main
from lmcache_mp._harness.progress import ProgressLine
from lmcache_mp._util.paths import shm_root
from lmcache_mp.bench import SCHEMA, BenchConfig, BenchResult, run_bench
from lmcache_mp.bench._cli import config_from_args
from lmcache_mp.bench._compare import (
    format_compare,
    pool_starts,
    run_compare,
)
from lmcache_mp.bench._figures import BASIS_PER_STREAM, BASIS_SERIAL, point_figures
from lmcache_mp.bench._machine import references
from lmcache_mp.bench._monitor import PeakMemory
from lmcache_mp.bench._run import PHASES, PhaseFigures, RunFigures
from lmcache_mp.bench._shapes import SHAPES
from lmcache_mp.bench._synthetic import SyntheticEngine
from lmcache_mp.bench._table import format_point
from lmcache_mp.bench._unhinted import Unhinted
from lmcache_mp.hints import gil_hint
from lmcache_mp.kv import SharedMemoryKVStore
from lmcache_mp.kv._chunk import HEADER_SIZE

ROOT = Path(__file__).resolve().parents[1]
#: A model and batch small enough that a whole run takes well under a second.
TINY: dict[str, Any] = {
    "streams": 2,
    "prompt_tokens": 64,
    "layers": 1,
    "kv_heads": 2,
    "head_dim": 8,
    "max_tokens": 4,
    "chunk_size": 16,
    "engine": "toy",
}
TINY_FLAGS = [
    "--engine=toy",
    "--streams=2",
    "--prompt-tokens=64",
    "--layers=1",
    "--kv-heads=2",
    "--head-dim=8",
    "--max-tokens=4",
    "--chunk-size=16",
]
FIGURE_KEYS = {"median", "min", "max", "values"}


def parse(*argv: str) -> BenchConfig:
    """Parse ``lmcache-mp bench ARGV`` into the config it would run."""
    parser, bench = build_parser()
    return config_from_args(bench, parser.parse_args(["bench", *argv]))


@pytest.fixture(scope="module")
def all_executors() -> dict[str, Any]:
    """One tiny run of serial, thread and process (2 streams x 64 tokens)."""
    config = BenchConfig(executors=("serial", "thread", "process"), **TINY)
    return run_bench(config, progress=False).to_dict()


# -- command line ---------------------------------------------------------------


def test_no_flags_runs_the_default_config() -> None:
    """``lmcache-mp bench`` with no flags runs BenchConfig's defaults:
    SmolLM2-135M, 4 streams x 512 tokens, thread and process on
    the GIL-bound pyscore edit (the default run is about
    modify), no sweep, one repeat."""
    config = parse()
    assert config == BenchConfig()
    assert config.engine == "smollm2-135m"
    assert (config.streams, config.prompt_tokens) == (4, 512)
    assert config.executors == ("thread", "process")
    assert config.edits == ("pyscore",)
    assert (config.sweep, config.repeat, config.workers) == (None, 1, None)


@pytest.mark.parametrize(
    ("flags", "field", "value"),
    [
        (["--executors", "serial,process"], "executors", ("serial", "process")),
        (["--streams", "3"], "streams", 3),
        (["--prompt-tokens", "128"], "prompt_tokens", 128),
        (["--engine", "toy", "--layers", "2"], "layers", 2),
        (["--engine", "toy", "--kv-heads", "3"], "kv_heads", 3),
        (["--engine", "synthetic", "--head-dim", "8"], "head_dim", 8),
        (["--dtype", "float16"], "dtype", "float16"),
        (["--edit", "pyscore,redundancy"], "edits", ("pyscore", "redundancy")),
        (["--edit", "window", "--keep", "0.25"], "keep", 0.25),
        (["--max-tokens", "5"], "max_tokens", 5),
        (["--every", "4"], "every", 4),
        (["--workers", "3"], "workers", 3),
        (["--start-method", "forkserver"], "start_method", "forkserver"),
        (["--repeat", "4"], "repeat", 4),
        (["--sweep", "prompt-tokens"], "sweep", "prompt-tokens"),
        (["--chunk-size", "32"], "chunk_size", 32),
        (["--seed", "7"], "seed", 7),
        (["--engine", "toy"], "engine", "toy"),
        (["--engine", "/models/llama"], "engine", "/models/llama"),
        (["--executor", "dask"], "executors", ("dask",)),
        (
            ["--executor", "dask", "--scheduler", "dask://127.0.0.1:8786"],
            "scheduler",
            "dask://127.0.0.1:8786",
        ),
        (
            ["--executor", "ray", "--ray-address", "ray://h:1"],
            "ray_address",
            "ray://h:1",
        ),
        (
            ["--store", "redis://127.0.0.1:6379/0?prefix=b"],
            "store",
            "redis://127.0.0.1:6379/0?prefix=b",
        ),
        (["--arena", "1.5"], "arena_bytes", 3 << 29),
    ],
)
def test_each_flag_sets_its_field(flags: list[str], field: str, value: Any) -> None:
    """Every flag lands in the matching BenchConfig field."""
    assert getattr(parse(*flags), field) == value


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--executors", "gpu"],
            "unknown executor 'gpu' (choose from auto, process, serial",
        ),
        (["--executors", "thread,thread"], "named twice"),
        (
            ["--edit", "prune"],
            "unknown edit 'prune' (choose from expected_attention, h2o, identity",
        ),
        (["--streams", "0"], "--streams: expected an integer >= 1, got 0"),
        (["--prompt-tokens", "many"], "expected an integer >= 1, got 'many'"),
        (["--keep", "1.5"], "--keep: expected a fraction in (0, 1], got 1.5"),
        (["--edit", "quantize", "--keep", "0.5"], "edit quantize keeps every token"),
        (["--dtype", "float64"], "invalid choice: 'float64'"),
        (["--sweep", "cores"], "invalid choice: 'cores'"),
        (["--start-method", "thread"], "invalid choice: 'thread'"),
        (
            ["--engine", "toy", "--head-dim", "7"],
            "head_dim is 7, expected an even number",
        ),
        (["--json", "/nonexistent-dir/x.json"], "/nonexistent-dir does not exist"),
        (["--arena", "-1"], "--arena: expected GiB >= 0, got -1"),
        (["--every", "0"], "--every: expected an integer >= 1, got 0"),
        (
            ["--every", "16", "--max-tokens", "16"],
            "every (16) must be below max_tokens (16): no compression round",
        ),
        (
            ["--arena", "1", "--store", "redis://h:1/0"],
            "arena_bytes is the shared-memory store's",
        ),
        (["--scheduler", "dask://h:1"], "--scheduler is for the dask executor"),
        (["--ray-address", "h:1"], "--ray-address is for the ray executor"),
        (
            ["--executors", "dask", "--scheduler", "dask://h:1", "--sweep", "workers"],
            "a given --scheduler or --ray-address has the size it has",
        ),
    ],
)
def test_bad_values_are_usage_errors(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bad value exits with status 2 and a message naming the problem
    (unknown names list the choices), before anything runs."""
    with pytest.raises(SystemExit) as exit_info:
        parse(*flags)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_module_help_lists_bench_and_serve() -> None:
    """``python -m lmcache_mp --help`` lists both subcommands."""
    done = subprocess.run(
        [sys.executable, "-m", "lmcache_mp", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert "bench" in done.stdout
    assert "serve" in done.stdout


def test_script_wrapper_runs_the_bench_command() -> None:
    """``scripts/bench.py`` is ``lmcache-mp bench``: it takes the same flags."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench.py"), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert "usage: lmcache-mp bench" in done.stdout
    assert "--executors" in done.stdout


def test_cli_prints_the_table_and_writes_json_and_png(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A CLI run prints one table with a row per phase and executor, writes
    the JSON and a PNG, and draws no progress line when stderr is no TTY."""
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    outputs = ["--json", str(out_json), "--plot", str(out_png)]
    status = main(["bench", *TINY_FLAGS, "--executors", "serial,thread", *outputs])
    assert status == 0
    captured = capsys.readouterr()
    rows = [line.split()[:2] for line in captured.out.splitlines()]
    for phase in PHASES:
        assert [phase, "serial"] in rows
        assert [phase, "thread"] in rows
    assert captured.err == ""
    assert json.loads(out_json.read_text())["schema"] == SCHEMA
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_is_a_usage_error_naming_the_extra(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--plot`` without matplotlib exits with status 2 before running and
    says which extra to install."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", *TINY_FLAGS, "--plot", str(tmp_path / "x.png")])
    assert exit_info.value.code == 2
    assert "pip install 'lmcache-mp[plot]'" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


# -- real shapes -------------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "layers", "kv_heads", "head_dim", "kib_per_token"),
    [
        # The models' config.json: num_hidden_layers, num_key_value_heads,
        # head_dim; K and V in bfloat16.
        ("llama3-8b", 32, 8, 128, 128),
        ("qwen3-8b", 36, 8, 128, 144),
        ("smollm2-135m", 30, 3, 64, 22.5),
    ],
)
def test_shape_sets_the_models_kv_dims(
    shape: str, layers: int, kv_heads: int, head_dim: int, kib_per_token: float
) -> None:
    """``--shape NAME`` sets the model's layers, KV heads, head size and
    bfloat16, and runs the synthetic engine (the toy model cannot)."""
    config = parse("--shape", shape, "--prompt-tokens", "4096")
    assert (config.layers, config.kv_heads, config.head_dim) == (
        layers,
        kv_heads,
        head_dim,
    )
    assert (config.dtype, config.engine, config.shape) == (
        "bfloat16",
        "synthetic",
        shape,
    )
    assert config.prompt_tokens == 4096
    assert SHAPES[shape].bytes_per_token == kib_per_token * 1024


def test_flags_beside_a_shape_override_it() -> None:
    """A model flag given with ``--shape`` wins; the shape fills the rest."""
    config = parse("--shape", "llama3-8b", "--layers", "2", "--dtype", "float16")
    assert (config.layers, config.kv_heads, config.dtype) == (2, 8, "float16")


def test_bfloat16_is_not_the_toy_engines(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The toy model computes float16/float32 only: bfloat16 on it is a
    usage error naming what it takes."""
    with pytest.raises(SystemExit):
        parse("--engine", "toy", "--dtype", "bfloat16")
    assert "the toy engine takes float16, float32" in capsys.readouterr().err


@pytest.mark.parametrize("flag", [["--layers", "2"], ["--shape", "llama3-8b"]])
def test_a_trained_model_has_its_own_kv_shape(
    flag: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """A KV-shape flag beside a trained model is a usage error that names
    the flag and the engines that take it."""
    with pytest.raises(SystemExit):
        parse("--engine", "smollm2-135m", *flag)
    err = capsys.readouterr().err
    assert flag[0] in err and "own KV shape" in err and "--engine synthetic" in err


def test_auto_brings_its_unhinted_run() -> None:
    """Naming auto runs auto-unhinted right after it; naming both runs each
    once, where named."""
    assert parse("--executors", "thread,auto,process").runs == (
        "thread",
        "auto",
        "auto-unhinted",
        "process",
    )
    assert parse("--executors", "auto-unhinted,auto").runs == (
        "auto-unhinted",
        "auto",
    )
    assert parse("--executors", "thread").runs == ("thread",)


def test_edit_takes_a_comma_list_of_the_issue_20_edits() -> None:
    """``--edit stride,redundancy,pyscore`` runs the three, in that order."""
    assert parse("--edit", "stride,redundancy,pyscore").edits == (
        "stride",
        "redundancy",
        "pyscore",
    )


@pytest.fixture(scope="module")
def synthetic_run() -> dict[str, Any]:
    """A tiny bfloat16 run on the synthetic engine: thread, auto, auto-unhinted."""
    config = BenchConfig(
        executors=("thread", "auto"),
        dtype="bfloat16",
        edits=("pyscore",),
        **{**TINY, "engine": "synthetic"},
    )
    return run_bench(config, progress=False).to_dict()


def test_synthetic_run_decodes_the_same_tokens_on_every_executor(
    synthetic_run: dict[str, Any],
) -> None:
    """Prefill stores every prompt token's KV, modify edits it, decode hits
    the edited KV; the decoded tokens agree across executors."""
    point = synthetic_run["points"][0]
    assert point["outputs_agree"] is True
    for ex in point["executors"].values():
        phases = ex["phases"]
        assert phases["prefill"]["input_tokens"]["median"] == 2 * 64
        assert phases["modify"]["tokens_after"]["median"] < 2 * 64
        cached = phases["decode"]["cache_hit_tokens"]["median"]
        assert cached == phases["modify"]["tokens_after"]["median"]


def test_kv_rate_and_memcpy_ratio_follow_their_definitions(
    synthetic_run: dict[str, Any],
) -> None:
    """KV GB/s = KV bytes read + written by modify / its wall time; x memcpy
    = that / the run's own one-core memcpy rate; the table shows both."""
    point = synthetic_run["points"][0]
    memcpy = synthetic_run["machine"]["memcpy_gb_s"]
    for ex in point["executors"].values():
        modify = ex["phases"]["modify"]
        rate = modify["kv_bytes"]["median"] / modify["wall_s"]["median"] / 1e9
        assert modify["kv_gb_s"]["median"] == pytest.approx(rate)
        assert modify["kv_vs_memcpy"]["median"] == pytest.approx(rate / memcpy)
        assert ex["phases"]["decode"]["kv_gb_s"] is None
    text = format_point(point)
    header = text.splitlines()[1]
    assert "KV GB/s" in header and "x memcpy" in header and "peak RSS" in header


def test_each_run_writes_an_arena_of_what_it_writes_and_reports_it(
    synthetic_run: dict[str, Any],
) -> None:
    """By default each run's temporary store writes an arena of the prompts'
    KV and the half that pyscore keeps before the phases; the JSON gives its
    bytes and fill time, the table a note."""
    # 2 streams x (4 chunks of prompt + 2 kept) x [2, 1, 16, 16] bf16.
    arena = 2 * (4 + 2) * (HEADER_SIZE + 2 * 1 * 16 * 16 * 2)
    point = synthetic_run["points"][0]
    for ex in point["executors"].values():
        assert ex["arena_bytes"] == arena
        assert ex["arena_fill_s"]["median"] > 0
    note = f"store arena: {arena / 1024:.1f} KiB of chunk files"
    assert note in format_point(point)


#: A chunk file of BenchConfig(streams=3, prompt_tokens=64, layers=2,
#: kv_heads=2, head_dim=8, chunk_size=16): [2, 2, 16, 16] float32 + header.
_FILE = HEADER_SIZE + 2 * 2 * 16 * 16 * 4


@pytest.mark.parametrize(
    ("fields", "capacity", "edit", "expected"),
    [
        ({}, 1 << 40, None, 3 * (4 + 4) * _FILE),
        ({}, 1 << 40, "identity", 3 * (4 + 4) * _FILE),
        ({}, 1 << 40, "stride", 3 * (4 + 2) * _FILE),
        ({}, 1 << 40, "redundancy", 3 * (4 + 2) * _FILE),
        ({"keep": 0.25}, 1 << 40, "snapkv", 3 * (4 + 1) * _FILE),
        ({"keep": 0.25}, 1 << 40, "stride", 3 * (4 + 2) * _FILE),
        ({"keep": 0.2}, 1 << 40, "snapkv", 3 * (4 + 0) * _FILE),
        ({}, 1000, None, 500),
        ({"arena_bytes": 5}, 1 << 40, "stride", 5),
        ({"arena_bytes": 0}, 1 << 40, None, 0),
        ({"store": "shm:///bench"}, 1 << 40, None, 0),
    ],
)
def test_the_run_arena_is_given_or_what_the_run_writes_within_half_the_capacity(
    fields: dict[str, Any], capacity: int, edit: str | None, expected: float
) -> None:
    """arena_bytes when given; else, for the temporary store, the chunk
    files of every prompt's full chunks and of those the edit keeps (keep
    for the dropping edits, one in two for stride, all for the others), no
    more than half the capacity; for a store by URL, none."""
    config = BenchConfig(
        streams=3,
        prompt_tokens=64,
        layers=2,
        kv_heads=2,
        head_dim=8,
        chunk_size=16,
        **fields,
    )
    assert config.run_arena_bytes(capacity, edit) == expected


def test_auto_unhinted_measures_the_edit_the_hinted_run_skips(
    synthetic_run: dict[str, Any],
) -> None:
    """auto runs the hinted pyscore on processes by its hint; auto-unhinted
    runs the same edit without the hint, so auto measures it; the table
    says which each chose and why."""
    executors = synthetic_run["points"][0]["executors"]
    reasons = {
        name: executors[name]["phases"]["modify"]["reports"][0]["metrics"]["config"][
            "executor_reason"
        ]
        for name in ("auto", "auto-unhinted")
    }
    assert reasons["auto"] == "the modify fn is marked gil_bound"
    assert "holding the GIL" in reasons["auto-unhinted"]
    assert "auto-unhinted modify ran on" in format_point(synthetic_run["points"][0])


def test_unhinted_copy_has_no_hint_and_the_same_result() -> None:
    """The wrapper drops the edit's GIL hint and returns what the edit returns."""
    edit = BenchConfig(**TINY).edit("pyscore")
    kv = np.arange(2 * 1 * 64 * 16, dtype=np.float32).reshape(2, 1, 64, 16)
    tokens = list(range(64))
    assert gil_hint(edit) is True and gil_hint(Unhinted(edit)) is None
    wrapped, plain = Unhinted(edit)(kv, tokens), edit(kv, tokens)
    assert np.array_equal(wrapped[0], plain[0]) and wrapped[1] == plain[1]


def test_synthetic_engine_decodes_by_the_cached_kv(
    store: SharedMemoryKVStore,
) -> None:
    """Its replies depend on the cached KV: after the KV of a prompt is
    replaced, the same prompt decodes other tokens; the first event says
    how many tokens were cached."""
    engine = SyntheticEngine(store, layers=1, width=8, dtype="float32")
    prompt = list(range(1, 9))
    first = list(engine(prompt, {"max_tokens": 3}))
    assert first[0].cached_tokens == 0
    again = list(engine(prompt, {"max_tokens": 3}))
    assert again[0].cached_tokens == 8
    assert [e.token_id for e in again] == [e.token_id for e in first]
    store.store(np.zeros((2, 1, 8, 8), np.float32), prompt, overwrite=True)
    edited = list(engine(prompt, {"max_tokens": 3}))
    assert [e.token_id for e in edited] != [e.token_id for e in first]


@dataclasses.dataclass(frozen=True)
class _FailsOn:
    """An edit that fails the stream whose prompt starts with ``token``."""

    token: int

    def __call__(self, kv: Any, tokens: list[int]) -> Any:
        if tokens[0] == self.token:
            raise ValueError("this stream's KV is gone")
        return kv, tokens


def test_failed_streams_are_reported_and_the_run_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stream failing a phase does not end the benchmark: the phase's
    figures count it, the other phases run, the table says FAILED and the
    command's result counts it."""
    config = BenchConfig(executors=("thread",), **TINY)
    first = config.prompts()[0][0]
    monkeypatch.setattr(BenchConfig, "edit", lambda self, name: _FailsOn(first))
    result = run_bench(config, progress=False)
    phases = result.points[0]["executors"]["thread"]["phases"]
    assert phases["modify"]["failed_streams"]["median"] == 1
    assert phases["decode"]["output_tokens"]["median"] == 2 * TINY["max_tokens"]
    assert result.failed_streams == 1
    assert "FAILED: modify on thread (repeat 1): 1 of 2 streams; first:" in (
        result.format()
    )


# -- the JSON result ---------------------------------------------------------------


def test_json_has_schema_machine_and_config(all_executors: dict[str, Any]) -> None:
    """The result names its schema, describes the machine and holds the
    full config, so that runs can be compared later."""
    data = json.loads(json.dumps(all_executors))
    assert data["schema"] == "lmcache-mp-bench/1"
    machine = data["machine"]
    for key in ("cores_physical", "cores_logical", "memory_total_bytes"):
        assert isinstance(machine[key], int) and machine[key] > 0
    for key in ("python", "numpy", "platform"):
        assert isinstance(machine[key], str) and machine[key]
    for key in ("memcpy_gb_s", "pickle_gb_s"):
        assert isinstance(machine[key], float) and machine[key] > 0
    assert machine["start_method"] == "spawn"
    assert isinstance(machine["blas"], list)
    assert (
        data["config"]
        == BenchConfig(executors=("serial", "thread", "process"), **TINY).to_dict()
    )
    assert data["sweep"] is None
    assert len(data["points"]) == 1


def test_every_executor_and_phase_has_its_figures(
    all_executors: dict[str, Any],
) -> None:
    """Each executor reports each phase's wall time, speedup, efficiency,
    bytes, memory and throughput as median/min/max/values."""
    point = all_executors["points"][0]
    assert set(point["executors"]) == {"serial", "thread", "process"}
    for ex in point["executors"].values():
        for phase in PHASES:
            fig = ex["phases"][phase]
            for key in (
                "wall_s",
                "serial_s",
                "speedup_vs_thread",
                "efficiency",
                "pickled_bytes",
                "peak_rss_bytes",
                "throughput_tok_s",
            ):
                assert set(fig[key]) == FIGURE_KEYS, (phase, key)
                assert fig[key]["median"] >= 0
            assert len(fig["reports"]) == 1
        assert ex["phases"]["decode"]["tpot_p99_ms"]["median"] >= 0
        assert ex["phases"]["prefill"]["ttft_p50_ms"]["median"] > 0


def test_a_tiny_run_of_each_executor_is_correct(
    all_executors: dict[str, Any],
) -> None:
    """Serial, thread and process prefill every prompt token, decode the
    same tokens, and only the process executor pickles through pipes."""
    point = all_executors["points"][0]
    assert point["outputs_agree"] is True
    assert point["serial_basis"] == BASIS_SERIAL
    prompt_tokens = TINY["streams"] * TINY["prompt_tokens"]
    digests = set()
    for name, ex in point["executors"].items():
        phases = ex["phases"]
        assert phases["prefill"]["input_tokens"]["median"] == prompt_tokens
        assert phases["prefill"]["cache_hit_tokens"]["median"] == 0
        assert phases["decode"]["output_tokens"]["median"] == 2 * TINY["max_tokens"]
        assert phases["modify"]["tokens_before"]["median"] == prompt_tokens
        assert phases["modify"]["kv_bytes"]["median"] > 0
        pickled = phases["modify"]["pickled_bytes"]["median"]
        assert (pickled > 0) == (name == "process")
        assert (ex["pool_start_s"]["median"] > 0) == (name == "process")
        digests.add(ex["outputs_digest"])
    assert len(digests) == 1


def test_repeat_reports_median_and_spread() -> None:
    """With repeat=2 every figure holds both values, their median and
    their min-max."""
    config = BenchConfig(executors=("serial",), repeat=2, **TINY)
    point = run_bench(config, progress=False).to_dict()["points"][0]
    wall = point["executors"]["serial"]["phases"]["modify"]["wall_s"]
    assert len(wall["values"]) == 2
    assert wall["min"] == min(wall["values"])
    assert wall["max"] == max(wall["values"])
    assert wall["median"] == pytest.approx(sum(wall["values"]) / 2)


def test_sweep_workers_has_one_point_per_worker_count(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``--sweep workers`` runs 1, 2, ... up to the cores, one point each,
    and the plot draws its speedup curve."""
    monkeypatch.setattr(bench_result, "usable_cores", lambda: 3)
    config = BenchConfig(executors=("serial", "thread"), sweep="workers", **TINY)
    result = run_bench(config, progress=False)
    data = result.to_dict()
    assert data["sweep"] == {"parameter": "workers", "values": [1, 2, 3]}
    assert [p["config"]["workers"] for p in data["points"]] == [1, 2, 3]
    assert [p["executors"]["thread"]["workers"] for p in data["points"]] == [1, 2, 3]
    result.write_plot(tmp_path / "sweep.png")
    assert (tmp_path / "sweep.png").read_bytes()[:4] == b"\x89PNG"


# -- the figures -----------------------------------------------------------------


def _run(name: str, walls: dict[str, float], per_stream: float, out: int) -> RunFigures:
    phases = {
        phase: PhaseFigures(wall, per_stream, 0, 0, {"metrics": {}})
        for phase, wall in walls.items()
    }
    return RunFigures(name, 2, 0.0, phases, [[1, 2], [3, out]])


def test_speedup_and_efficiency_follow_their_definitions() -> None:
    """Speedup = thread wall / wall; efficiency = serial wall / (wall x
    min(cores, streams)); serial time is the serial executor's wall."""
    walls = {"serial": 4.0, "thread": 3.0, "process": 1.0}
    runs = {n: _run(n, dict.fromkeys(PHASES, w), 9.0, 4) for n, w in walls.items()}
    config = BenchConfig(executors=tuple(walls), **TINY)
    point = point_figures(config, "random", None, [runs], cores=8)
    modify = point["executors"]["process"]["phases"]["modify"]
    assert point["ideal_parallelism"] == TINY["streams"]
    assert modify["speedup_vs_thread"]["median"] == pytest.approx(3.0)
    assert modify["efficiency"]["median"] == pytest.approx(4.0 / (1.0 * 2))


def test_without_serial_only_modify_has_a_per_stream_basis() -> None:
    """Without a serial run, modify's serial time is the lowest sum of
    per-stream times; prefill/decode (overlapping streams) get none."""
    runs = {
        "thread": _run("thread", dict.fromkeys(PHASES, 2.0), 3.0, 4),
        "process": _run("process", dict.fromkeys(PHASES, 1.0), 2.5, 4),
    }
    config = BenchConfig(executors=("thread", "process"), **TINY)
    point = point_figures(config, "random", None, [runs], cores=2)
    assert point["serial_basis"] == BASIS_PER_STREAM
    phases = point["executors"]["thread"]["phases"]
    assert phases["modify"]["serial_s"]["median"] == 2.5
    assert phases["prefill"]["efficiency"] is None


def test_an_edits_attention_config_is_json_data_and_one_short_line() -> None:
    """An edit with an attention config (h2o) gives its fields as a JSON
    mapping, and the report's edit line shows the 32 RoPE frequencies of a
    model as their count (``--json`` failed on the dataclass)."""
    runs = {"thread": _run("thread", dict.fromkeys(PHASES, 1.0), 1.0, 4)}
    config = BenchConfig(executors=("thread",), edits=("h2o",), **TINY)
    point = json.loads(json.dumps(point_figures(config, "h2o", None, [runs], cores=2)))
    attention = point["edit_params"]["attention"]
    assert attention["kv_heads"] == config.edit("h2o").attention.kv_heads
    attention["inv_freq"] = [0.5] * 32  # a trained model's, e.g. SmolLM2's
    line = format_point(point).splitlines()[0]
    assert f"attention=(q_heads={attention['q_heads']}, " in line
    assert "inv_freq=[32 values])" in line


def test_auto_is_rated_against_the_better_of_threads_and_processes() -> None:
    """The notes give auto's and auto-unhinted's modify speed over the
    faster of thread and process (the project's goal: >= 0.95x)."""
    walls = {"thread": 3.0, "process": 2.0, "auto": 2.5, "auto-unhinted": 4.0}
    runs = {n: _run(n, dict.fromkeys(PHASES, w), 9.0, 4) for n, w in walls.items()}
    config = BenchConfig(executors=tuple(walls), **TINY)
    text = format_point(point_figures(config, "random", None, [runs], cores=2))
    assert "modify, auto vs the better of thread and process: 0.80x" in text
    assert "modify, auto-unhinted vs the better of thread and process: 0.50x" in text


def test_peak_rss_is_rated_against_the_kv_held_and_two_streams_per_worker(
    synthetic_run: dict[str, Any],
) -> None:
    """The notes give each executor's memory bound (the KV the store
    holds at the end + 2 streams' KV per worker + 1 GiB) and name the
    phases whose peak RSS is above it, and only those."""
    point = copy.deepcopy(synthetic_run["points"][0])
    per_token = 2 * TINY["layers"] * TINY["kv_heads"] * TINY["head_dim"] * 2
    thread = point["executors"]["thread"]
    phases = thread["phases"]
    held = phases["prefill"]["input_tokens"]["median"]
    held += phases["modify"]["tokens_after"]["median"]
    two_streams = 2 * per_token * TINY["prompt_tokens"]
    bound = per_token * held + two_streams * thread["workers"] + 2**30
    phases["prefill"]["peak_rss_bytes"]["median"] = bound + 1
    phases["modify"]["peak_rss_bytes"]["median"] = bound
    line = next(
        line for line in format_point(point).splitlines() if "peak RSS bound" in line
    )
    assert re.search(r"thread [\d.]+ GiB \(over it: prefill [\d.]+ GiB\);", line)
    assert re.search(r"auto [\d.]+ GiB[;.]", line)
    assert "modify" not in line


def test_peak_rss_is_not_rated_for_a_model_engine(
    all_executors: dict[str, Any],
) -> None:
    """A model engine's workers each hold its weights, so the notes of a
    run on one (here the toy model) give no memory bound."""
    point = all_executors["points"][0]
    assert point["config"]["engine"] == "toy"
    assert point["executors"]["process"]["phases"]["modify"]["tokens_after"]
    assert "peak RSS bound" not in format_point(point)


def test_differing_decode_outputs_are_reported() -> None:
    """A stream whose decoded tokens differ between executors is counted
    and the point says the outputs do not agree."""
    runs = {
        "thread": _run("thread", dict.fromkeys(PHASES, 1.0), 1.0, 4),
        "process": _run("process", dict.fromkeys(PHASES, 1.0), 1.0, 5),
    }
    config = BenchConfig(executors=("thread", "process"), **TINY)
    point = point_figures(config, "random", None, [runs], cores=2)
    assert point["outputs_agree"] is False
    assert point["mismatched_streams"] == 1


# -- monitors ----------------------------------------------------------------------


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_line_is_silent_when_stderr_is_not_a_tty() -> None:
    """Nothing is drawn to a stream that is not a terminal (pipes, CI)."""
    stream = io.StringIO()
    with ProgressLine("[process] modify", stream):
        time.sleep(0.3)
    assert stream.getvalue() == ""


def test_progress_line_draws_elapsed_time_on_a_tty_then_erases_it() -> None:
    """On a terminal the line shows executor, phase and elapsed seconds,
    redrawn in place, and is blanked when the phase ends."""
    stream = _Tty()
    with ProgressLine("[process] modify", stream):
        time.sleep(0.3)
    text = stream.getvalue()
    assert text.startswith("\r[process] modify 0.0 s elapsed")
    assert text.count("\r") >= 3
    assert text.endswith("\r") and text.rsplit("\r", 2)[1].strip() == ""


def test_peak_memory_counts_child_processes() -> None:
    """The sampled total sums the RSS of the parent and of its children."""
    own = psutil.Process().memory_info().rss
    size = 64 << 20
    code = f"import sys; b = b'x' * {size}; print(flush=True); sys.stdin.read()"
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert child.stdout is not None
        child.stdout.readline()  # the child has touched its memory
        with PeakMemory() as memory:
            total = memory.sample()
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(timeout=30)
    assert total >= own + size


def test_peak_memory_counts_shared_memory_pages_once() -> None:
    """Shared-memory pages that the parent and a child both map (as every
    process keeps a store's arena mapped) count once in the total."""
    size = 64 << 20
    fd, path = tempfile.mkstemp(dir=shm_root())
    try:
        os.pwrite(fd, b"x" * size, 0)
        mapped = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        touched = bytes(mapped[::4096])  # maps every page in the parent
        code = (
            "import mmap, sys; f = open(sys.argv[1], 'rb'); "
            "m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ); "
            "t = bytes(m[::4096]); print(flush=True); sys.stdin.read()"
        )
        child = subprocess.Popen(
            [sys.executable, "-c", code, path],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        try:
            assert child.stdout is not None
            child.stdout.readline()  # the child has mapped every page
            with PeakMemory() as memory:
                total = memory.sample()
            # RSS summed as it is, over the processes the sample covers.
            me = psutil.Process()
            every = sum(p.memory_info().rss for p in [me, *me.children(True)])
        finally:
            assert child.stdin is not None
            child.stdin.close()
            child.wait(timeout=30)
        mapped.close()
    finally:
        os.close(fd)
        os.unlink(path)
    assert len(touched) == size // 4096
    assert size <= total <= every - size // 2


def test_result_round_trips_through_json(tmp_path: Path) -> None:
    """``write_json`` writes exactly ``to_json``'s text, parseable JSON."""
    result = BenchResult(BenchConfig(**TINY), {"cores_physical": 2}, [], "t", 1.5)
    path = tmp_path / "r.json"
    result.write_json(path)
    assert json.loads(path.read_text()) == result.to_dict()
    assert os.listdir(tmp_path) == ["r.json"]


def test_header_warns_when_threads_cannot_cap_blas() -> None:
    """Without threadpoolctl (machine.blas is null) the header says the thread baseline is oversubscribed."""
    from lmcache_mp.bench._table import format_header

    config = {
        "streams": 2,
        "prompt_tokens": 64,
        "max_tokens": 2,
        "layers": 1,
        "kv_heads": 1,
        "head_dim": 4,
        "dtype": "float32",
        "chunk_size": 16,
        "start_method": "spawn",
        "repeat": 1,
        "seed": 0,
        "executors": ["thread", "process"],
    }
    machine = {
        "cores_physical": 2,
        "cores_logical": 2,
        "cpu_model": "x",
        "memory_total_bytes": 1,
        "python": "3",
        "numpy": "2",
        "load_average_1m": 0.0,
        "blas": None,
    }
    assert "lmcache-mp[blas]" in format_header({"config": config, "machine": machine})
    machine["blas"] = []
    assert "lmcache-mp[blas]" not in format_header(
        {"config": config, "machine": machine}
    )


# --- bench --compare ---------------------------------------------


def _tiny_compare_config() -> BenchConfig:
    return BenchConfig(
        engine="toy",
        executors=("serial", "thread"),
        streams=2,
        prompt_tokens=64,
        layers=2,
        chunk_size=16,
        edits=("stride",),
        repeat=2,
    )


def test_compare_ranks_every_runner_on_the_same_edit() -> None:
    """Each executor gets a row with its repeats; the fastest is 1.0x and
    every runner's edited tokens agree."""
    (point,) = run_compare(_tiny_compare_config(), (), workers=1)
    runners = [row["runner"] for row in point["rows"]]
    assert sorted(runners) == ["lmcache_mp serial", "lmcache_mp thread"]
    assert point["rows"][0]["x_fastest"] == 1.0
    assert all(len(row["wall_s"]["values"]) == 2 for row in point["rows"])
    assert point["outputs_agree"]


def test_compare_lists_a_missing_peer_as_not_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A peer whose package cannot be imported is named with the extra to
    install; the other runners still run."""

    def missing(name: str) -> None:
        raise ImportError(f"No module named {name!r}")

    monkeypatch.setattr(lmcache_mp.bench._peers.importlib, "import_module", missing)
    (point,) = run_compare(_tiny_compare_config(), ("loky",), workers=1)
    assert "lmcache-mp[compare]" in point["unavailable"]["loky"]
    assert len(point["rows"]) == 2


def test_compare_runs_the_loky_peer_on_the_same_edit() -> None:
    """loky's reusable executor edits the same streams (KV pickled) and
    ends with the same tokens as lmcache_mp's executors."""
    (point,) = run_compare(_tiny_compare_config(), ("loky",), workers=2)
    rows = {row["runner"]: row for row in point["rows"]}
    assert set(rows) == {"lmcache_mp serial", "lmcache_mp thread", "loky"}
    assert rows["loky"]["workers"] == 2 and rows["loky"]["pickled_bytes"] is None
    assert point["outputs_agree"] and not point["unavailable"]


def test_forkserver_pool_starts_are_timed_twice() -> None:
    """pool_starts times a first and a next forkserver pool, each started
    and closed (the leak check sees no worker left)."""
    starts = pool_starts()
    assert set(starts) == {"first_s", "next_s"}
    assert all(value > 0 for value in starts.values())


def test_compare_table_shows_runners_and_references() -> None:
    """The text names each runner once and the measured memcpy/pickle speeds."""
    config = _tiny_compare_config()
    refs = references()
    text = format_compare(config, run_compare(config, (), workers=1), refs)
    assert text.count("lmcache_mp serial") == 1
    assert f"memcpy {refs['memcpy_gb_s']:.1f} GB/s" in text


@pytest.mark.parametrize("edit", ["h2o", "streamingllm"])
def test_the_compression_methods_run_in_the_bench(edit: str) -> None:
    """A KIND edit (h2o: its streams get a QUERY context) and streamingllm
    (rerotating with the toy model's attention) run on threads and
    processes and keep the asked fraction of the tokens."""
    config = BenchConfig(executors=("thread", "process"), edits=(edit,), **TINY)
    point = run_bench(config, progress=False).to_dict()["points"][0]
    prompt_tokens = TINY["streams"] * TINY["prompt_tokens"]
    for ex in point["executors"].values():
        modify = ex["phases"]["modify"]
        assert modify["tokens_after"]["median"] == prompt_tokens // 2


def test_every_compresses_while_decoding_to_the_modify_phases_size() -> None:
    """With ``every``, the decode phase compresses every ``every`` tokens on
    the run's executor: each executor runs the same rounds to the same
    tokens, no stream keeps more than the modify phase left of its prompt,
    and the table names the rounds' modify time beside threads'."""
    config = BenchConfig(
        executors=("thread", "process"),
        edits=("knorm",),
        **{**TINY, "max_tokens": 40, "every": 8},
    )
    budget = config.edit("knorm").budget
    assert budget == TINY["prompt_tokens"] // 2
    point = run_bench(config, progress=False).to_dict()["points"][0]
    assert point["outputs_agree"]
    for ex in point["executors"].values():
        decode = ex["phases"]["decode"]
        assert decode["rounds"]["median"] == 40 // 8 - 1
        assert 0 < decode["max_kv_tokens"]["median"] <= budget
        assert decode["output_tokens"]["median"] == TINY["streams"] * 40
    text = format_point(point)
    assert "compression rounds in decode: 4," in text
    assert "x thread)" in text.split("compression rounds in decode")[1]


def test_without_every_the_dropping_edits_keep_a_fraction() -> None:
    """Without ``every``, a dropping edit keeps ``keep`` of whatever it is
    given; with it, the same count of a prompt as a fixed budget."""
    plain = BenchConfig(edits=("knorm",), keep=0.25, **TINY)
    rounds = BenchConfig(edits=("knorm",), keep=0.25, **{**TINY, "every": 2})
    assert (plain.edit("knorm").keep, plain.edit("knorm").budget) == (0.25, None)
    assert (rounds.edit("knorm").keep, rounds.edit("knorm").budget) == (None, 16)
    assert rounds.edit("pyscore").budget == 16
