"""Specification of lmcache_mp.metrics: the report every batch phase returns."""

from __future__ import annotations

import io
import json
import os
import pickle
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import lmcache_mp.metrics._formatters as formatters_mod
from lmcache_mp.metrics import (
    FileHandler,
    JSONFormatter,
    MarkdownFormatter,
    Metrics,
    MetricsFormatter,
    MetricsHandler,
    Section,
    StreamHandler,
    TerminalFormatter,
    get_formatter,
    register_formatter,
    summarize,
)


def _report() -> Metrics:
    """A report with a default section and two named ones."""
    m = Metrics("Decode results")
    results = m.add_section("results", "Results")
    results.add("output_tput", "Output throughput (tok/s)", 12345.678)
    results.add("ttft", "Time to first token (s)", 0.123456)
    m.add("num_streams", "Streams", 8)
    timing = m.add_section("timing", "Timing")
    timing.add("tpot", "Time per output token (s)", [0.01, 0.02, 0.03])
    timing.add("missing", "Cached tokens", None)
    return m


class _Recorder(MetricsHandler):
    """A handler that records what it was given, into a shared log."""

    def __init__(self, name: str, log: list[tuple[str, str, list[str]]]) -> None:
        super().__init__(JSONFormatter())
        self.name = name
        self.log = log

    def emit(self, title: str, sections: Sequence[Section]) -> None:
        self.log.append((self.name, title, [s.key for s in sections]))


# --- structure -----------------------------------------------------------


def test_to_dict_shape_has_default_entries_on_top_and_sections_nested() -> None:
    """to_dict() is {"title", "metrics"}: default entries top level, sections nested."""
    assert _report().to_dict() == {
        "title": "Decode results",
        "metrics": {
            "num_streams": 8,
            "results": {"output_tput": 12345.678, "ttft": 0.123456},
            "timing": {"tpot": [0.01, 0.02, 0.03], "missing": None},
        },
    }


def test_to_dict_preserves_order_with_default_section_first() -> None:
    """Default entries come first, then sections and entries in insertion order."""
    data = _report().to_dict()["metrics"]
    assert list(data) == ["num_streams", "results", "timing"]
    assert list(data["results"]) == ["output_tput", "ttft"]


def test_sections_lists_default_first_and_is_a_tuple() -> None:
    """`sections` is a read-only tuple, unnamed section first when it has entries."""
    m = _report()
    assert isinstance(m.sections, tuple)
    assert [s.key for s in m.sections] == ["", "results", "timing"]
    assert [s.key for s in Metrics("t").sections] == []


def test_duplicate_section_key_raises() -> None:
    """Adding a second section with the same key raises ValueError naming it."""
    m = Metrics("t")
    m.add_section("results", "Results")
    with pytest.raises(ValueError, match="results"):
        m.add_section("results", "Again")


def test_section_key_may_not_clash_with_a_default_entry() -> None:
    """A section key equal to a top-level entry key raises: to_dict would merge."""
    m = Metrics("t")
    m.add("results", "Results", 1)
    with pytest.raises(ValueError, match="results"):
        m.add_section("results", "Results")
    m.add_section("other", "Other")
    with pytest.raises(ValueError, match="other"):
        m.add("other", "Other", 2)


def test_empty_section_key_is_rejected() -> None:
    """The empty key is reserved for the unnamed section."""
    with pytest.raises(ValueError, match="non-empty"):
        Metrics("t").add_section("", "Nothing")


def test_unknown_section_raises_key_error() -> None:
    """metrics["absent"] raises KeyError naming the key."""
    with pytest.raises(KeyError, match="absent"):
        _report()["absent"]


def test_getitem_returns_the_section() -> None:
    """metrics["key"] returns the Section added under that key."""
    m = Metrics("t")
    section = m.add_section("results", "Results")
    assert m["results"] is section
    assert "results" in m
    assert "absent" not in m


def test_section_values_read_back_by_key() -> None:
    """Section.get and section[key] return the value stored under key."""
    section = _report()["results"]
    assert section["ttft"] == 0.123456
    assert section.get("output_tput") == 12345.678
    assert section.get("absent", 0) == 0


def test_missing_entry_raises_key_error_naming_key_and_section() -> None:
    """A missing entry raises KeyError naming both the entry and the section."""
    with pytest.raises(KeyError, match=r"'absent'.*'results'"):
        _report()["results"]["absent"]
    with pytest.raises(KeyError, match="absent"):
        _report()["results"].get("absent")


def test_duplicate_entry_key_in_a_section_raises() -> None:
    """A section refuses a second entry with the same key."""
    section = Section("s", "S")
    section.add("a", "A", 1)
    with pytest.raises(ValueError, match="'a'"):
        section.add("a", "A again", 2)
    assert section.entries == [("a", "A", 1)]


def test_title_sets_and_returns_the_title() -> None:
    """title(new) replaces the title; title() returns it."""
    m = Metrics("old")
    assert m.title() == "old"
    m.title("new")
    assert m.title() == "new"
    assert m.to_dict()["title"] == "new"


def test_metrics_survive_pickling() -> None:
    """A report with default handlers pickles (errors carry it across processes)."""
    m = _report()
    m.add_handler(StreamHandler())
    clone = pickle.loads(pickle.dumps(m))
    assert clone.to_dict() == m.to_dict()


# --- terminal ------------------------------------------------------------


@pytest.mark.parametrize("width", [40, 80, 120])
def test_terminal_shows_title_labels_and_values(width: int) -> None:
    """The terminal rendering holds the title, every label and every value."""
    text = _report().format("terminal", width=width)
    for expected in ["Decode results", "Results", "Timing", "12,345.68", "0.1235"]:
        assert expected in text
    words = text.split()
    for label in ["Streams", "Output throughput", "Time to first token", "Cached"]:
        assert label in " ".join(words)
    assert "8" in words and "N/A" in words


@pytest.mark.parametrize("width", [40, 80, 120])
def test_terminal_lines_never_exceed_width(width: int) -> None:
    """No line is wider than `width`, even with very long labels and values."""
    m = _report()
    m["timing"].add("long", "A label " * 30, "value-" * 60)
    m.title("T" * 300)
    lines = m.format("terminal", width=width).splitlines()
    assert max(len(line) for line in lines) <= width


@settings(max_examples=60, deadline=None)
@given(
    width=st.integers(min_value=20, max_value=160),
    rows=st.lists(
        st.tuples(st.text(max_size=120), st.one_of(st.text(max_size=200), st.floats())),
        min_size=1,
        max_size=5,
    ),
)
def test_terminal_width_holds_for_arbitrary_entries(
    width: int, rows: list[tuple[str, object]]
) -> None:
    """Whatever the labels and values, every rendered line fits in `width`."""
    m = Metrics("report")
    section = m.add_section("s", "Section")
    for i, (label, value) in enumerate(rows):
        section.add(f"k{i}", label, value)
    lines = m.format("terminal", width=width).splitlines()
    assert max(len(line) for line in lines) <= width


def test_terminal_frames_report_in_banners() -> None:
    """Title line centred in '=', section headings in '-', closing '=' line."""
    lines = _report().format("terminal", width=60).splitlines()
    assert len(lines[0]) == 60
    assert lines[0].startswith("===") and lines[0].endswith("===")
    assert " Decode results " in lines[0]
    assert lines[-1] == "=" * 60
    heading = next(line for line in lines if " Results " in line)
    assert heading.startswith("---") and heading.endswith("---") and len(heading) == 60


def test_terminal_formats_numbers_none_and_lists() -> None:
    """4 significant digits, separators for large values, N/A, list summaries."""
    m = Metrics("t")
    m.add("small", "small", 0.123456)
    m.add("large", "large", 12345.678)
    m.add("count", "count", 1234567)
    m.add("none", "none", None)
    m.add("list", "list", [1.0, 2.0, 6.0])
    text = str(m)
    for expected in [
        "0.1235",
        "12,345.68",
        "1,234,567",
        "N/A",
        "n=3",
        "mean 3",
        "max 6",
    ]:
        assert expected in text
    assert "0.123456" not in text


def test_terminal_rejects_too_narrow_width() -> None:
    """A width below the minimum raises ValueError naming the width."""
    with pytest.raises(ValueError, match="5"):
        _report().format("terminal", width=5)


def test_str_is_the_terminal_rendering() -> None:
    """str(metrics) is the 80-column terminal rendering; repr is short."""
    m = _report()
    assert str(m) == m.format("terminal", width=80)
    assert "Decode results" in repr(m)
    assert "\n" not in repr(m)


# --- json and markdown ---------------------------------------------------


def test_json_output_parses_back_to_to_dict() -> None:
    """The json format is exactly to_dict() once parsed."""
    m = _report()
    assert json.loads(m.format("json")) == m.to_dict()


def test_numpy_scalars_serialise_as_python_numbers() -> None:
    """numpy scalars and arrays become Python numbers and lists in to_dict and json."""
    m = Metrics("np")
    m.add("i", "int", np.int64(7))
    m.add("f", "float", np.float32(0.5))
    m.add("arr", "array", np.array([1.5, 2.5]))
    data = m.to_dict()["metrics"]
    assert type(data["i"]) is int and data["i"] == 7
    assert type(data["f"]) is float and data["f"] == 0.5
    assert data["arr"] == [1.5, 2.5]
    assert json.loads(m.format("json")) == m.to_dict()
    assert "7" in str(m)


def test_markdown_output_has_headings_and_table_rows() -> None:
    """Markdown has ## title, ### section labels and | label | value | rows."""
    lines = _report().format("markdown").splitlines()
    assert lines[0] == "## Decode results"
    assert "### Results" in lines
    assert "| Metric | Value |" in lines
    assert "| Streams | 8 |" in lines
    assert "| Output throughput (tok/s) | 12,345.68 |" in lines
    assert "| Cached tokens | N/A |" in lines


def test_markdown_escapes_pipes_in_cells() -> None:
    """A '|' in a label or value cannot break the table."""
    m = Metrics("t")
    m.add("k", "a|b", "c|d")
    assert "| a\\|b | c\\|d |" in m.format("markdown").splitlines()


# --- formatter registry --------------------------------------------------


def test_unknown_format_raises_value_error_listing_formats() -> None:
    """An unknown format name raises ValueError that lists the available ones."""
    with pytest.raises(ValueError, match="unknown format 'xml'") as info:
        _report().format("xml")
    assert "json, markdown, terminal" in str(info.value)


def test_get_formatter_forwards_only_accepted_options() -> None:
    """Options a formatter does not take are dropped, accepted ones applied."""
    assert isinstance(get_formatter("markdown", width=50), MarkdownFormatter)
    terminal = get_formatter("terminal", width=50, indent=4)
    assert isinstance(terminal, TerminalFormatter) and terminal.width == 50


def test_registered_formatter_is_usable_by_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """register_formatter makes a class available to Metrics.format."""
    monkeypatch.setattr(formatters_mod, "_FORMATTERS", dict(formatters_mod._FORMATTERS))

    @register_formatter("keys")
    class KeysFormatter(MetricsFormatter):
        def format(self, title: str, sections: Sequence[Section]) -> str:
            return title + ":" + ",".join(s.key for s in sections)

    assert _report().format("keys") == "Decode results:,results,timing"


def test_registering_a_taken_name_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    """A second class cannot take an existing format name."""
    monkeypatch.setattr(formatters_mod, "_FORMATTERS", dict(formatters_mod._FORMATTERS))

    class Other(JSONFormatter):
        pass

    with pytest.raises(ValueError, match="json"):
        register_formatter("json")(Other)


# --- handlers and emit ---------------------------------------------------


def test_stream_handler_writes_rendering_and_newline_to_stream() -> None:
    """StreamHandler writes formatter output plus a newline to its stream."""
    buf = io.StringIO()
    m = _report()
    m.add_handler(StreamHandler(JSONFormatter(), stream=buf))
    m.emit()
    assert buf.getvalue() == m.format("json") + "\n"


def test_stream_handler_defaults_to_current_stdout(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Without a stream, StreamHandler writes the terminal form to sys.stdout."""
    m = _report()
    m.add_handler(StreamHandler())
    m.emit()
    assert capsys.readouterr().out == str(m) + "\n"


def test_emit_without_handlers_prints_terminal_form(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """emit() with no handler registered prints the terminal rendering."""
    m = _report()
    m.emit()
    assert capsys.readouterr().out == str(m) + "\n"


def test_emit_calls_every_handler_in_order() -> None:
    """emit() calls each registered handler once, in order, with the report."""
    log: list[tuple[str, str, list[str]]] = []
    m = _report()
    m.add_handler(_Recorder("first", log))
    m.add_handler(_Recorder("second", log))
    m.emit()
    keys = ["", "results", "timing"]
    assert log == [
        ("first", "Decode results", keys),
        ("second", "Decode results", keys),
    ]
    assert [h.name for h in m.handlers if isinstance(h, _Recorder)] == [
        "first",
        "second",
    ]


def test_file_handler_writes_json_that_parses_back(tmp_path: Path) -> None:
    """FileHandler defaults to JSON and leaves only the target file behind."""
    target = tmp_path / "report.json"
    m = _report()
    m.add_handler(FileHandler(target))
    m.emit()
    assert json.loads(target.read_text()) == m.to_dict()
    assert os.listdir(tmp_path) == ["report.json"]


def test_to_json_writes_a_file_that_parses_back(tmp_path: Path) -> None:
    """to_json(path) writes to_dict() as JSON, replacing any previous file."""
    target = tmp_path / "report.json"
    target.write_text("old")
    m = _report()
    m.to_json(str(target))
    assert json.loads(target.read_text()) == m.to_dict()


def test_failed_write_keeps_previous_file_and_leaves_no_temp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """If the final rename fails, the old file stays intact and the temp is removed."""
    target = tmp_path / "report.json"
    target.write_text("old")

    def fail_replace(src: str, dst: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail_replace)
    with pytest.raises(OSError, match="disk full"):
        _report().to_json(target)
    assert target.read_text() == "old"
    assert os.listdir(tmp_path) == ["report.json"]


# --- summarize -----------------------------------------------------------


@pytest.mark.parametrize(
    "values",
    [
        [3.0],
        [5.0, 1.0],
        [1.0, 2.0, 3.0, 4.0],
        list(np.random.default_rng(0).random(101)),
    ],
)
def test_summarize_matches_numpy_linear_percentiles(values: list[float]) -> None:
    """Mean and p50/p90/p99 equal numpy's mean and linear-method percentiles."""
    result = summarize(values)
    expected = np.percentile(values, [50, 90, 99], method="linear")
    assert list(result) == ["mean", "p50", "p90", "p99"]
    assert result["mean"] == pytest.approx(np.mean(values))
    assert [result["p50"], result["p90"], result["p99"]] == pytest.approx(expected)


def test_summarize_interpolates_between_ranks() -> None:
    """The median of 1..4 is 2.5 and p90 sits 70% of the way from 3 to 4."""
    result = summarize([4, 1, 3, 2])
    assert result["p50"] == pytest.approx(2.5)
    assert result["p90"] == pytest.approx(3.7)


def test_summarize_of_empty_input_is_all_zero() -> None:
    """No values give 0.0 for the mean and every percentile."""
    assert summarize([]) == {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    assert summarize(np.array([]), percentiles=(25,)) == {"mean": 0.0, "p25": 0.0}


def test_summarize_names_custom_percentiles() -> None:
    """Each requested percentile gets a p<value> key; numpy arrays are accepted."""
    values = np.arange(1001, dtype=np.float64)
    result = summarize(values, percentiles=(0, 99.9, 100))
    assert result == {
        "mean": pytest.approx(500.0),
        "p0": pytest.approx(0.0),
        "p99.9": pytest.approx(np.percentile(values, 99.9)),
        "p100": pytest.approx(1000.0),
    }


def test_summarize_rejects_bad_percentiles_and_nan() -> None:
    """A percentile outside [0, 100] or a NaN value raises ValueError."""
    with pytest.raises(ValueError, match="101"):
        summarize([1.0], percentiles=(101,))
    with pytest.raises(ValueError, match="NaN"):
        summarize([1.0, float("nan")])
