"""Rendering a bench report from a recorded JSON (a hand-made synthetic fixture): rich, markdown, README."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from tools import report
from tools.bench import BenchResult

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "data" / "bench_sample.json"


@pytest.fixture
def data() -> dict:
    return report.load(FIXTURE)


def _text(renderable) -> str:
    console = Console(file=io.StringIO(), width=220)
    console.print(renderable)
    return console.file.getvalue()


def test_fixture_is_marked_synthetic(data):
    assert data["synthetic"] is True
    assert "SYNTHETIC" in data["note"] and "NOT a measurement" in data["note"]
    assert data["schema"] == "warp-decode-bench/1"


def test_fixture_rows_carry_the_schema_fields(data):
    for row in data["results"]:
        assert {"model", "variant", "batch", "status", "samples_us", "bytes"} <= set(row)
        if row["status"] == "ok":
            assert {"median_us", "min_us", "max_us", "iqr_us", "tbps", "check", "error_vs_fp64", "copies"} <= set(row)
            assert row["min_us"] <= row["median_us"] <= row["max_us"]


def test_speedup_is_baseline_over_variant_at_the_same_batch(data):
    row = next(r for r in data["results"] if r["variant"] == "cupy:warp-decode" and r["batch"] == 1)
    assert report.speedup(data, row) == pytest.approx(45.0 / 20.0)
    base = next(r for r in data["results"] if r["variant"] == "cupy:expert-centric" and r["batch"] == 1)
    assert report.speedup(data, base) == pytest.approx(1.0)
    wrong = next(r for r in data["results"] if r["status"] == "wrong")
    assert report.speedup(data, wrong) is None


def test_crossover_names_the_first_batch_the_baseline_wins(data):
    cross = report.crossover(data, "qwen3-30b-a3b")
    assert cross["batch"] == 64 and cross["baseline"] == "cupy:expert-centric"
    assert "overtakes warp decode" in cross["text"] and "64" in cross["text"]


def test_crossover_when_the_baseline_never_wins(data):
    data["results"] = [r for r in data["results"] if r["batch"] != 64]
    cross = report.crossover(data, "qwen3-30b-a3b")
    assert cross["batch"] is None and "never overtakes" in cross["text"]
    data["results"] = [r for r in data["results"] if not r.get("baseline")]
    assert "no baseline" in report.crossover(data, "qwen3-30b-a3b")["text"]


def test_rich_report_renders_from_json_alone(data):
    text = _text(report.renderables(data))
    for needle in ("SYNTHETIC", "NVIDIA H200", "132 SMs", "4.56 TB/s", "2.72 TB/s", "cupy:warp-decode",
                   "numba:warp-decode", "cupy:expert-centric", "gate_up", "WRONG", "overtakes", "unique expert weight"):
        assert needle in text, needle


def test_cells_percent_and_bar(data):
    row = next(r for r in data["results"] if r["variant"] == "cupy:warp-decode" and r["batch"] == 8)
    c = report.cells(data, row, width=10)
    pct = 100 * row["tbps"] / 4.56
    assert c["pct"] == f"{pct:.0f}%"
    assert c["bar"].startswith("█" * int(pct // 10)) and len(c["bar"]) == 10
    assert c["speedup"] == f"{160 / 115:.2f}x"


def test_markdown_tables(data):
    md = report.markdown(data)
    lines = md.splitlines()
    header = next(line for line in lines if line.startswith("| batch"))
    assert "µs/layer" in header and "TB/s" in header and "% roof" in header and "vs base" in header
    rows = [line for line in lines if line.startswith("| ") and not line.startswith("| batch")]
    assert len(rows) == len(data["results"])
    assert all(line.count("|") == header.count("|") for line in rows)
    assert "SYNTHETIC" in md and "overtakes" in md


def test_readme_marker_replacement(tmp_path):
    text = "# title\n\n<!-- bench:begin -->\nold typed numbers\n<!-- bench:end -->\n\ntail\n"
    new = report.replace_between_markers(text, "| a | b |\n")
    assert new == "# title\n\n<!-- bench:begin -->\n| a | b |\n<!-- bench:end -->\n\ntail\n"
    assert report.replace_between_markers(new, "| a | b |") == new  # idempotent
    with pytest.raises(ValueError, match="markers"):
        report.replace_between_markers("no markers here", "x")
    readme = tmp_path / "README.md"
    readme.write_text(text)
    result = subprocess.run([sys.executable, "-m", "tools.report", str(FIXTURE), "--update-readme", str(readme)],
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    updated = readme.read_text()
    assert "old typed numbers" not in updated and "| batch |" in updated and updated.endswith("tail\n")


def test_report_cli(tmp_path):
    result = subprocess.run([sys.executable, "-m", "tools.report", str(FIXTURE), "--markdown"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "| batch |" in result.stdout
    result = subprocess.run([sys.executable, "-m", "tools.report", str(tmp_path / "missing.json")], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "cannot read" in result.stderr


def test_bench_result_object_renders_and_serialises(data):
    result = BenchResult(data)
    assert "cupy:warp-decode" in _text(result)  # __rich__
    html = result._repr_html_()
    assert "<" in html and "cupy:warp-decode" in html
    printed = []

    class Printer:
        def text(self, value):
            printed.append(value)

    result._repr_pretty_(Printer(), False)
    assert "numba:warp-decode" in printed[0]
    assert json.loads(result.to_json()) == data
    assert "| batch |" in result.markdown()


def test_ratio_markdown_pairs_variants_of_the_same_run_point():
    from tools.report import ratio_markdown

    def row(variant, batch, median, status="ok"):
        return {"model": "qwen3-30b-a3b", "variant": variant, "batch": batch, "median_us": median, "status": status}

    runs = [{"results": [row("numba:warp-decode", 1, 30.0), row("cupy:warp-decode", 1, 24.0),
                         row("numba:warp-decode", 8, 180.0), row("cupy:warp-decode", 8, 120.0, status="wrong")]}]
    text = ratio_markdown(runs)
    assert "| qwen3-30b-a3b | 1.25 |" in text and "T=8" not in text  # a wrong point is never compared
    assert ratio_markdown([{"results": []}]) == ""
