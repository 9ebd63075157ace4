"""Specification of ``lmcache-mp bench``: its CLI, its figures, its JSON, its plot."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

import lmcache_mp.bench._peers
import lmcache_mp.bench._result as bench_result
from lmcache_mp.__main__ import build_parser, main
from lmcache_mp.bench import SCHEMA, BenchConfig, BenchResult, run_bench
from lmcache_mp.bench._cli import config_from_args
from lmcache_mp.bench._compare import (
    format_compare,
    pool_starts,
    run_compare,
)
from lmcache_mp.bench._figures import BASIS_PER_STREAM, BASIS_SERIAL, point_figures
from lmcache_mp.bench._machine import references
from lmcache_mp.bench._monitor import PeakMemory, ProgressLine
from lmcache_mp.bench._run import PHASES, PhaseFigures, RunFigures

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
}
TINY_FLAGS = [
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
    thread, process and auto on the GIL-bound pyscore edit (issue #12: the
    default run is about modify), no sweep, one repeat."""
    config = parse()
    assert config == BenchConfig()
    assert config.executors == ("thread", "process", "auto")
    assert config.edits == ("pyscore",)
    assert (config.sweep, config.repeat, config.workers) == (None, 1, None)


@pytest.mark.parametrize(
    ("flags", "field", "value"),
    [
        (["--executors", "serial,process"], "executors", ("serial", "process")),
        (["--streams", "3"], "streams", 3),
        (["--prompt-tokens", "128"], "prompt_tokens", 128),
        (["--layers", "2"], "layers", 2),
        (["--kv-heads", "3"], "kv_heads", 3),
        (["--head-dim", "8"], "head_dim", 8),
        (["--dtype", "float16"], "dtype", "float16"),
        (["--edit", "pyscore,redundancy"], "edits", ("pyscore", "redundancy")),
        (["--edit", "window", "--keep", "0.25"], "keep", 0.25),
        (["--max-tokens", "5"], "max_tokens", 5),
        (["--workers", "3"], "workers", 3),
        (["--start-method", "forkserver"], "start_method", "forkserver"),
        (["--repeat", "4"], "repeat", 4),
        (["--sweep", "prompt-tokens"], "sweep", "prompt-tokens"),
        (["--chunk-size", "32"], "chunk_size", 32),
        (["--seed", "7"], "seed", 7),
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
            "unknown edit 'prune' (choose from h2o, identity, keydiff",
        ),
        (["--streams", "0"], "--streams: expected an integer >= 1, got 0"),
        (["--prompt-tokens", "many"], "expected an integer >= 1, got 'many'"),
        (["--keep", "1.5"], "--keep: expected a fraction in (0, 1], got 1.5"),
        (["--edit", "quantize", "--keep", "0.5"], "edit quantize keeps every token"),
        (["--dtype", "float64"], "invalid choice: 'float64'"),
        (["--sweep", "cores"], "invalid choice: 'cores'"),
        (["--start-method", "thread"], "invalid choice: 'thread'"),
        (["--head-dim", "7"], "head_dim is 7, expected an even number"),
        (["--json", "/nonexistent-dir/x.json"], "/nonexistent-dir does not exist"),
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


# --- bench --compare (issue #12) ---------------------------------------------


def _tiny_compare_config() -> BenchConfig:
    return BenchConfig(
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
    processes and keep the asked fraction of the tokens (issue #21)."""
    config = BenchConfig(executors=("thread", "process"), edits=(edit,), **TINY)
    point = run_bench(config, progress=False).to_dict()["points"][0]
    prompt_tokens = TINY["streams"] * TINY["prompt_tokens"]
    for ex in point["executors"].values():
        modify = ex["phases"]["modify"]
        assert modify["tokens_after"]["median"] == prompt_tokens // 2
