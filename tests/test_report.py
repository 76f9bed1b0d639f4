"""Rendering a bench report from a recorded JSON (a hand-made synthetic fixture): rich, markdown, README."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from kernels.variants import get_variant
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


def test_crossover_races_the_baseline_in_its_own_weight_format(data):
    """A faster FP8 warp-decode row reads half the bytes: it does not move the bf16 crossover."""
    import copy

    before = report.crossover(data, "qwen3-30b-a3b")
    for row in [r for r in data["results"] if r["variant"] == "cupy:warp-decode" and r["status"] == "ok"]:
        fp8 = copy.deepcopy(row)
        fp8.update(variant="cupy:warp-decode-fp8", median_us=row["median_us"] / 100)
        fp8["bytes"]["weight_format"] = "fp8-block128"
        data["results"].append(fp8)
    after = report.crossover(data, "qwen3-30b-a3b")
    assert after["batch"] == before["batch"] == 64 and after["compared"] == before["compared"]


def test_rich_report_renders_from_json_alone(data):
    text = _text(report.renderables(data))
    for needle in ("SYNTHETIC", "NVIDIA H200", "132 SMs", "4.56 TB/s", "2.72 TB/s", "cupy:warp-decode",
                   "numba:warp-decode", "cupy:expert-centric", "gate_up", "WRONG", "overtakes", "unique expert weight"):
        assert needle in text, needle


def test_stage_lines_say_alone_and_in_the_chain(data):
    row = next(r for r in data["results"] if r.get("stages"))
    row["stages"][0].update(layer_us=100.0, without_us=97.5, in_chain_us=2.5)
    text = _text(report.renderables(data))
    assert f"{row['stages'][0]['name']}: {row['stages'][0]['median_us']:.2f} µs alone, 2.50 µs in the layer's chain" \
        in text
    assert f"{row['stages'][1]['name']}: {row['stages'][1]['median_us']:.2f} µs alone" in text


def test_cells_percent_and_bar(data):
    row = next(r for r in data["results"] if r["variant"] == "cupy:warp-decode" and r["batch"] == 8)
    c = report.cells(data, row, width=10)
    pct = 100 * row["tbps"] / 4.56
    assert c["pct"] == f"{pct:.0f}%"
    assert c["bar"].startswith("█" * int(pct // 10)) and len(c["bar"]) == 10
    assert c["speedup"] == f"{160 / 115:.2f}x"


def test_markdown_tables(data):
    md = report.markdown(data)
    assert "#### Crossover: qwen3-30b-a3b, uniform routing" in md  # strict + expert-centric: one crossover table
    lines = md[: md.index("#### Crossover")].splitlines()  # the per-model table before it
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
    assert "old typed numbers" not in updated and updated.endswith("tail\n")
    assert "| T | strict µs (% roof)" in updated and "Any run's full tables" in updated  # the report, not the rows


def test_regenerate_from_the_documents_own_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Given a document alone, the tool regenerates it from the runs its own generating command names (a command
    wrapped over lines, the document named by any path ending in its file name); a document without such a command,
    or both options without JSON, exit 2 naming what is missing."""
    doc = tmp_path / "REPORT.md"
    text = (f"Generated by `python -m tools.report {FIXTURE}\n  {FIXTURE} --update-readme results/REPORT.md`.\n\n"
            "<!-- bench:begin -->\nold typed numbers\n<!-- bench:end -->\n")
    doc.write_text(text)
    assert report.named_runs(text, "--update-readme", doc) == [str(FIXTURE)] * 2
    assert report.main(["--update-readme", str(doc)]) == 0
    updated = doc.read_text()
    assert "old typed numbers" not in updated and "#### qwen3-30b-a3b, uniform routing" in updated
    assert f"[{FIXTURE}](" in updated  # the run the cells come from, a link to its JSON
    assert updated.startswith(text.split("<!--")[0])  # the command itself is kept
    for argv, message in ((["--headline", str(doc)], "names no `python -m tools.report JSON... --headline REPORT.md`"),
                          (["--headline", str(doc), "--update-readme", str(doc)], "required: JSON"),
                          (["--update-readme", str(tmp_path / "absent.md")], "--update-readme: ")):
        with pytest.raises(SystemExit) as exc:
            report.main(argv)
        assert exc.value.code == 2 and message in capsys.readouterr().err, argv


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
    # a later run's cupy row alone never pairs with an earlier run's numba row; a later run with both wins the point
    later = {"results": [row("cupy:warp-decode", 1, 10.0), row("cupy:warp-decode", 8, 100.0),
                         row("numba:warp-decode", 8, 150.0)]}
    text = ratio_markdown([*runs, later], names=["a.json", "b.json"], link_base=".")
    assert "| qwen3-30b-a3b | 1.25 | 1.50 |" in text
    assert text.rstrip().endswith("From [a.json](a.json), [b.json](b.json).")


# ------------------------------------------------------------------------------------------------
# The crossover table (strict / batched / expert-centric / auto over several runs)
# ------------------------------------------------------------------------------------------------
STRICT, BATCHED, EC, AUTO = "cupy:warp-decode", "cupy:warp-decode-batched", "cupy:expert-centric", "cupy:auto"
MODEL = "qwen3-30b-a3b"


def _row(variant, batch, us, status="ok", routing="uniform", model=MODEL, tbps=None, **extra):
    row = {"model": model, "variant": variant, "family": "x", "batch": batch, "routing": routing, "status": status,
           "median_us": us if status == "ok" else None, "tbps": (tbps if tbps is not None else 100.0 / us)
           if status == "ok" else None, "samples_us": [us] * 3, "min_us": us, "max_us": us, "iqr_us": 0.0}
    if routing is None:
        del row["routing"]
    row.update(extra)
    return row


def _run(rows, read_tbps=4.0, routing="uniform"):
    return {"schema": "warp-decode-bench/1", "config": {"routing": routing}, "rooflines": {"read_tbps": read_tbps},
            "results": rows}


def _point(record, batch):
    return next(p for p in record["points"] if p["batch"] == batch)


def test_crossover_table_best_path_auto_and_flag():
    run = _run([_row(STRICT, 1, 20.0), _row(BATCHED, 1, 25.0), _row(EC, 1, 40.0), _row(AUTO, 1, 20.08),
                _row(STRICT, 8, 130.0), _row(BATCHED, 8, 100.0), _row(EC, 8, 120.0), _row(AUTO, 8, 103.5),
                _row(STRICT, 64, 1000.0), _row(BATCHED, 64, 500.0), _row(EC, 64, 350.0), _row(AUTO, 64, 500.0)])
    record = report.crossover_table([run], MODEL, "uniform")
    assert record["batches"] == [1, 8, 64]
    p1, p8, p64 = (_point(record, b) for b in (1, 8, 64))
    assert (p1["best"], p8["best"], p64["best"]) == ("strict", "batched", "expert-centric")
    assert p1["best_us"] == 20.0 and p1["auto_vs_best"] == pytest.approx(0.004) and not p1["flag"]
    assert p8["auto_vs_best"] == pytest.approx(0.035) and p8["flag"]  # 3.5 % > the 3 % bar
    assert p64["auto_vs_best"] == pytest.approx(500 / 350 - 1) and p64["flag"]
    assert p1["choice"] is None  # rows without a recorded choice
    c1, c8 = report.crossover_cells(p1), report.crossover_cells(p8)
    assert c1["vs_best"] == "+0.4 %" and c1["choice"] == "-" and c1["best"] == "strict"
    assert c8["vs_best"] == "+3.5 % ⚠" and "†" not in c8["vs_best"]
    assert record["fastest"] == {"strict": [1], "batched": [8], "mixed": [], "MMA": [], "per-pair": [], "grouped": [],
                                 "expert-centric": [64]}
    assert (record["auto_within"], record["auto_compared"]) == (1, 3)
    assert record["summary"] == ("qwen3-30b-a3b, uniform routing: strict T=1, batched T=8, expert-centric T=64 "
                                 "(mixed, MMA, per-pair, grouped not measured); "
                                 "auto within 3 % of the best at 1/3 points "
                                 "(slower at T=8: +3.5 %, T=64: +42.9 %)")


def test_crossover_records_auto_choice_when_present():
    run = _run([_row(STRICT, 4, 70.0), _row(BATCHED, 4, 72.0), _row(AUTO, 4, 69.0, choice=STRICT),
                _row(STRICT, 16, 266.0), _row(BATCHED, 16, 214.0), _row(AUTO, 16, 214.5, choice=BATCHED,
                                                                     choice_source="table")])
    record = report.crossover_table([run], MODEL, "uniform")
    assert _point(record, 4)["choice"] == STRICT and _point(record, 16)["choice"] == BATCHED
    assert report.crossover_cells(_point(record, 4))["choice"] == "strict"
    assert report.crossover_cells(_point(record, 4))["vs_best"] == "-1.4 %"  # auto faster than the best: no flag
    assert report.crossover_cells(_point(record, 16))["choice"] == "batched (table)"
    assert "auto within 3 % of the best at 2/2 points" in record["summary"]
    assert "expert-centric not measured" in record["summary"]


def test_crossover_later_file_wins_and_per_file_roofline():
    early = _run([_row(STRICT, 1, 30.0, tbps=2.0), _row(BATCHED, 1, 28.0, tbps=2.2), _row(EC, 1, 40.0, tbps=1.5)],
                 read_tbps=4.0)
    late = _run([_row(STRICT, 1, 20.0, tbps=3.0), _row(AUTO, 1, 20.2, tbps=2.97)], read_tbps=5.0)
    record = report.crossover_table([early, late], MODEL, "uniform")
    point = _point(record, 1)
    strict, batched, auto = point["cells"]["strict"], point["cells"]["batched"], point["cells"]["auto"]
    assert strict["us"] == 20.0 and strict["source"] == 1  # the later file's strict row replaced the earlier one
    assert strict["pct"] == pytest.approx(100 * 3.0 / 5.0)  # % of the later run's roofline
    assert batched["source"] == 0 and batched["pct"] == pytest.approx(100 * 2.2 / 4.0)  # the earlier run's
    assert auto["pct"] == pytest.approx(100 * 2.97 / 5.0)
    assert point["best"] == "strict" and point["mixed_runs"]
    cells = report.crossover_cells(point)
    assert cells["strict"] == "20.00 (60%)" and cells["batched"] == "28.00 (55%)" and cells["vs_best"].endswith("†")
    # the other order: the earlier strict timing wins now
    reverse = report.crossover_table([late, early], MODEL, "uniform")
    assert _point(reverse, 1)["cells"]["strict"]["us"] == 30.0 and _point(reverse, 1)["best"] == "batched"


def test_crossover_missing_variants_and_failed_rows():
    run = _run([_row(STRICT, 1, 20.0), _row(BATCHED, 1, 10.0, status="wrong"), _row(AUTO, 1, 10.0, status="error"),
                _row(STRICT, 2, 40.0), _row(BATCHED, 2, 45.0),
                _row("numba:warp-decode", 2, 5.0), _row("proto:warps-per-block", 2, 5.0)])  # not crossover columns
    record = report.crossover_table([run], MODEL, "uniform")
    p1, p2 = _point(record, 1), _point(record, 2)
    assert p1["best"] == "strict" and p1["auto_vs_best"] is None and not p1["flag"]  # failed rows never compared
    c1 = report.crossover_cells(p1)
    assert c1["batched"] == "WRONG" and c1["auto"] == "ERROR" and c1["expert-centric"] == "-"
    assert c1["vs_best"] == "-"
    c2 = report.crossover_cells(p2)
    assert c2["expert-centric"] == "-" and c2["auto"] == "-" and c2["choice"] == "-" and c2["best"] == "strict"
    assert record["summary"].startswith(
        "qwen3-30b-a3b, uniform routing: strict T=1-2 (mixed, MMA, per-pair, grouped, expert-centric not "
        "measured)")
    assert "auto not compared" in record["summary"]
    # a later failure hides an earlier timing: that kernel changed since
    later = _run([_row(STRICT, 2, 40.0, status="wrong")])
    again = report.crossover_table([run, later], MODEL, "uniform")
    assert _point(again, 2)["best"] == "batched" and report.crossover_cells(_point(again, 2))["strict"] == "WRONG"
    # nothing timed at all
    empty = report.crossover_table([_run([_row(STRICT, 1, 1.0, status="error")])], MODEL, "uniform")
    assert "no timed single path of its own" in empty["summary"]


def test_crossover_keeps_routings_and_models_apart():
    uniform = _run([_row(STRICT, 1, 20.0), _row(BATCHED, 1, 25.0), _row(AUTO, 1, 20.0),
                    _row(STRICT, 1, 70.0, model="qwen3-235b-a22b"), _row(BATCHED, 1, 80.0, model="qwen3-235b-a22b")])
    zipf = _run([_row(STRICT, 1, 15.0, routing=None), _row(BATCHED, 1, 12.0, routing=None),
                 _row(AUTO, 1, 15.0, routing=None)], routing="zipf")  # no row key: the config's routing
    assert report.crossover_keys([uniform, zipf]) == [(MODEL, "uniform"), ("qwen3-235b-a22b", "uniform"),
                                                     (MODEL, "zipf")]
    u, z = report.crossover_table([uniform, zipf], MODEL, "uniform"), report.crossover_table([uniform, zipf], MODEL,
                                                                                             "zipf")
    assert _point(u, 1)["best"] == "strict" and not _point(u, 1)["flag"] and not _point(u, 1)["mixed_runs"]
    assert _point(z, 1)["best"] == "batched" and _point(z, 1)["auto_vs_best"] == pytest.approx(0.25)
    assert _point(z, 1)["flag"] and _point(z, 1)["cells"]["strict"]["source"] == 1
    # a (model, routing) with one path only gets no table
    only_strict = _run([_row(STRICT, 1, 20.0, model="deepseek-v3"), _row("numba:warp-decode", 1, 25.0,
                                                                         model="deepseek-v3")])
    assert report.crossover_keys([only_strict]) == []
    assert report.crossover_markdown([only_strict]) == ""


def test_crossover_t_ranges_in_the_summary():
    batches = (1, 2, 4, 8, 16, 32, 64)
    best = {1: STRICT, 2: STRICT, 4: STRICT, 8: BATCHED, 16: BATCHED, 32: EC, 64: EC}
    rows = []
    for batch in batches:
        for variant in (STRICT, BATCHED, EC):
            rows.append(_row(variant, batch, 10.0 * batch * (1.0 if variant == best[batch] else 1.5)))
        rows.append(_row(AUTO, batch, 10.0 * batch * 1.01))
    record = report.crossover_table([_run(rows)], MODEL, "uniform")
    assert record["summary"] == ("qwen3-30b-a3b, uniform routing: strict T=1-4, batched T=8-16, "
                                 "expert-centric T=32-64 (mixed, MMA, per-pair, grouped not measured); "
                                 "auto within 3 % of the best at 7/7 points")
    assert report._t_ranges([1, 2, 16], [1, 2, 4, 8, 16]) == "1-2, 16"


def test_crossover_markdown_and_rich():
    uniform = _run([_row(STRICT, 1, 20.0), _row(BATCHED, 1, 25.0), _row(EC, 1, 40.0), _row(AUTO, 1, 21.0),
                    _row(STRICT, 64, 1000.0), _row(BATCHED, 64, 500.0), _row(EC, 64, 350.0), _row(AUTO, 64, 351.0)])
    zipf = _run([_row(STRICT, 1, 18.0, routing="zipf"), _row(BATCHED, 1, 22.0, routing="zipf")], routing="zipf")
    md = report.crossover_markdown([uniform, zipf], names=["u.json", "z.json"])
    assert "### Crossover: qwen3-30b-a3b, uniform routing" in md and "### Crossover: qwen3-30b-a3b, zipf routing" in md
    assert md.index("uniform routing") < md.index("zipf routing")
    lines = md.splitlines()
    header = next(line for line in lines if line.startswith("| T |"))
    assert "strict µs (% roof)" in header and "auto vs best" in header and "auto's choice" in header
    rows = [line for line in lines if line.startswith("| ") and not line.startswith("| T |")]
    assert len(rows) == 3 and all(line.count("|") == header.count("|") for line in rows)
    row_1 = ("| 1 | **20.00 (125%)** | 25.00 (100%) | - | - | - | - | 40.00 (62%) | 21.00 (119%) | strict | - "
             "| +5.0 % ⚠ |")
    assert row_1 in rows
    assert "`u.json`: strict, batched, expert-centric, auto" in md and "`z.json`: strict, batched" in md
    assert "⚠ auto more than 3 % slower" in md and "†" not in md
    assert "auto within 3 % of the best at 1/2 points (slower at T=1: +5.0 %)" in md
    text = _text(report.crossover_rich(report.crossover_table([uniform, zipf], MODEL, "uniform"), names=["u.json"]))
    for needle in ("Crossover: qwen3-30b-a3b, uniform routing", "expert-centric", "+5.0 % ⚠", "+0.3 %",
                   "u.json: strict", "within 3 % of the best at 1/2"):
        assert needle in text, needle
    # one run: the rich report and its markdown carry its own crossover table (the bench's end-of-run output)
    assert "Crossover: qwen3-30b-a3b, uniform routing" in _text(report.renderables(uniform))
    assert "Crossover" not in _text(report.renderables(uniform, crossovers=False))
    assert "#### Crossover: qwen3-30b-a3b, uniform routing" in report.markdown(uniform)
    assert "Crossover" not in report.markdown(uniform, crossovers=False)


def test_crossover_readme_update_round_trips(tmp_path):
    uniform = _run([_row(STRICT, 1, 20.0), _row(BATCHED, 1, 25.0), _row(AUTO, 1, 20.1)])
    zipf = _run([_row(STRICT, 1, 18.0, routing="zipf"), _row(BATCHED, 1, 15.0, routing="zipf"),
                 _row(AUTO, 1, 18.0, routing="zipf")], routing="zipf")
    paths = [tmp_path / "runs" / "uniform.json", tmp_path / "runs" / "zipf.json"]
    paths[0].parent.mkdir()
    for path, run in zip(paths, (uniform, zipf), strict=True):
        path.write_text(json.dumps(run))
    readme = tmp_path / "docs" / "README.md"
    readme.parent.mkdir()
    readme.write_text("# t\n\n<!-- bench:begin -->\nold typed numbers\n<!-- bench:end -->\n\ntail\n")
    command = [sys.executable, "-m", "tools.report", *map(str, paths), "--update-readme", str(readme)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    first = readme.read_text()
    block = first[first.index(report.BEGIN):first.index(report.END)]
    assert "old typed numbers" not in block and first.endswith("<!-- bench:end -->\n\ntail\n")
    assert "| batch |" not in block  # no run's full rows: the JSON is the record, the report says how to print it
    assert f"`python -m tools.report {paths[0].parent}/<run>.json --markdown`" in block
    assert block.index("### bf16 weights") < block.index("#### qwen3-30b-a3b, uniform routing") \
        < block.index("#### qwen3-30b-a3b, zipf routing")
    assert "![Crossover: qwen3-30b-a3b, uniform routing: " in block  # the chart, beside the document by default
    assert "(plots/qwen3-30b-a3b-uniform-bf16-crossover.png)" in block
    assert "+20.0 % ⚠" in block and f"[{paths[1]}](../runs/zipf.json): strict, batched, auto" in block
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and readme.read_text() == first  # idempotent
    result = subprocess.run([sys.executable, "-m", "tools.report", *map(str, paths), "--markdown"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.count("### Crossover") == 2
    assert result.stdout.count("| batch |") == 2  # --markdown still prints every run in full
    result = subprocess.run([sys.executable, "-m", "tools.report", *map(str, paths)], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.count("Crossover: qwen3-30b-a3b") == 2


def test_report_markdown_sections_formats_and_links(tmp_path):
    """The report block: a section per weight format (bf16 first), its tables model by model (each routing under
    its model), the batch-invariant columns apart in a table of their own, figures linked from ``--plot DIR``
    relative to the document."""
    fp8 = {"cupy:warp-decode-fp8": "strict", "cupy:warp-decode-mma-fp8": "MMA"}
    rows = []
    for model in (MODEL, "qwen3-235b-a22b"):
        for routing in ("uniform", "zipf"):
            rows += [_row(STRICT, 1, 20.0, routing=routing, model=model), _row(AUTO, 1, 20.0, routing=routing,
                                                                              model=model)]
    rows += [_row(v, 1, 10.0 + i, model=MODEL) for i, v in enumerate(fp8)]
    rows += [_row("cupy:auto-invariant", 1, 21.0, model=MODEL)]
    block = report.report_markdown([_run(rows)], ["results/r.json"], tmp_path / "results" / "REPORT.md",
                                   plot_dir=tmp_path / "figures")
    headings = [line for line in block.splitlines() if line.startswith("#")]
    assert headings == ["## Crossover: which path is fastest at each T", "### bf16 weights",
                        "#### qwen3-30b-a3b, uniform routing", "#### qwen3-30b-a3b, zipf routing",
                        "#### qwen3-235b-a22b, uniform routing", "#### qwen3-235b-a22b, zipf routing",
                        "### fp8-block128 weights", "#### qwen3-30b-a3b, uniform routing",
                        "## Batch-invariance cost"]
    assert "(../figures/qwen3-30b-a3b-uniform-fp8-block128-crossover.png)" in block
    assert "batch-invariant µs" not in block and "costs T=1" not in block  # not in the crossover tables ...
    assert "| bf16 | qwen3-30b-a3b | uniform | +5.0 % |" in block  # ... but in its own, one run: no †
    assert report.figure_keys([_run(rows)])[-1] == (MODEL, "uniform", "fp8-block128")


def test_invariance_table_compares_within_one_run():
    """The invariant policy's cost is costed against auto timed in the same run where that run has one; against the
    crossover table's (later) auto cell, marked †, where not."""
    inv = "cupy:auto-invariant"
    first = _run([_row(AUTO, 1, 20.0), _row(inv, 1, 20.2), _row(inv, 8, 90.0)])
    later = _run([_row(STRICT, 1, 19.0), _row(AUTO, 1, 25.0), _row(AUTO, 8, 100.0)])
    record = report.crossover_table([first, later], MODEL, "uniform")
    assert _point(record, 1)["invariant_vs_auto"] == pytest.approx(20.2 / 25.0 - 1)  # the table's column: as shown
    assert _point(record, 1)["invariant_vs_own_auto"] == pytest.approx(0.01)
    assert _point(record, 8)["invariant_vs_own_auto"] is None
    text = report.invariance_markdown([record], ["a.json", "b.json"])
    assert f"| bf16 | {MODEL} | uniform | +1.0 % | -10.0 % † |" in text
    assert text.rstrip().endswith("bf16: `a.json`: invariant, auto; `b.json`: auto.")
    assert report.invariance_markdown([report.crossover_table([later], MODEL, "uniform")]) == ""


BENCH_RESULTS = sorted(p for p in (ROOT / "results").glob("*.json")
                       if json.loads(p.read_text()).get("schema") == "warp-decode-bench/1")


def _varied(datas: list[dict], most: int = 6) -> list[dict]:
    """The oldest run and the ``most`` runs with the most distinct variants: the ones that exercise the most
    columns (rich's layout of a whole table takes ~0.3 s per run on 2 cores, and every run goes through markdown)."""
    by_variety = sorted(datas[1:], key=lambda d: -len({row["variant"] for row in d["results"]}))
    return [datas[0], *by_variety[:most]]


def test_committed_bench_results_render():
    assert BENCH_RESULTS, "no committed bench JSON in results/"
    datas = [report.load(path) for path in BENCH_RESULTS]
    for data in datas:
        assert report.markdown(data)
    for data in _varied(datas):
        assert "Crossover" in _text(report.renderables(data)) or not report.crossover_keys([data])
    md = report.crossover_markdown(datas, names=[str(p.relative_to(ROOT)) for p in BENCH_RESULTS])
    assert "### Crossover: qwen3-30b-a3b, uniform routing" in md
    for record in report.crossover_tables(datas):
        assert record["points"] and record["summary"].startswith(f"{record['model']}, {record['routing']} routing: ")
        _text(report.crossover_rich(record))
    assert report.main([str(p) for p in BENCH_RESULTS] + ["--markdown"]) == 0


@pytest.mark.parametrize("width", [60, 80, 100, 140, 10_000])
def test_no_number_is_cut_at_any_width(data, width):
    """A narrow terminal gets a compact layout (optional columns left out, text wrapped at spaces); a pipe gets
    every column: never a number cut down to "2…"."""
    from tools.display import text_of

    text = text_of(report.renderables(data), width)
    assert "…" not in text
    timed = [row for row in data["results"] if row.get("median_us") is not None and row.get("status") == "ok"]
    assert timed and all(f"{row['median_us']:.2f}" in text for row in timed)
    if width >= 10_000:
        assert "narrow terminal" not in text and "IQR" in text
    elif width <= 100:
        assert "narrow terminal" in text


def test_fp8_crossover_is_its_own_table():
    """FP8 rows (the FP8 paths, the W8A8 baseline and peer, cupy:auto-fp8) make a table of their own, titled with the
    format, without a mixed column; they never enter the bf16 table."""
    fp8 = {"strict": "cupy:warp-decode-fp8", "batched": "cupy:warp-decode-batched-fp8",
           "MMA": "cupy:warp-decode-mma-fp8", "expert-centric": "cupy:expert-centric-w8a8"}
    rows = [_row(fp8["strict"], 1, 12.0), _row(fp8["batched"], 1, 14.0), _row(fp8["MMA"], 1, 16.0),
            _row(fp8["expert-centric"], 1, 40.0), _row("cupy:auto-fp8", 1, 12.1),
            _row("triton:fused-moe-w8a8", 1, 50.0),
            _row(fp8["strict"], 64, 150.0), _row(fp8["MMA"], 64, 100.0), _row(fp8["expert-centric"], 64, 120.0),
            _row("cupy:auto-fp8", 64, 101.0), _row("triton:fused-moe-w8a8", 64, 110.0),
            _row(STRICT, 1, 20.0), _row(AUTO, 1, 20.0)]
    run = _run(rows)
    assert report.crossover_keys([run]) == [(MODEL, "uniform")]
    assert report.crossover_keys([run], "fp8-block128") == [(MODEL, "uniform")]
    tables = report.crossover_tables([run])
    assert [t["weight_format"] for t in tables] == ["bf16", "fp8-block128"]
    bf16, record = tables
    assert {c for p in bf16["points"] for c, cell in p["cells"].items() if cell} == {"strict", "auto"}
    assert report.crossover_title(record) == f"Crossover: {MODEL}, uniform routing, fp8-block128 weights"
    assert "mixed" not in dict(report.crossover_titles(record)) and "peer" in dict(report.crossover_titles(record))
    p1, p64 = _point(record, 1), _point(record, 64)
    assert (p1["best"], p64["best"]) == ("strict", "MMA")
    assert p64["auto_vs_peer"] == pytest.approx(101.0 / 110.0 - 1)
    assert "batched not measured" not in record["summary"]  # measured at T=1
    text = report.crossover_markdown([run])
    assert "fp8-block128 weights" in text and text.count("### Crossover") == 2


def test_tiled_table_never_takes_a_borrowed_column_as_its_best():
    """A tiled format's table shows its row layout's baseline and peer beside its paths, but its best single path is
    one of its own: where none was measured there is no best (and no auto-vs-best), not the baseline."""
    ec = report.CROSSOVER_PATHS["expert-centric"]
    rows = [_row(ec, 1, 40.0), _row("cupy:auto-t16", 1, 22.0), _row("triton:fused-moe", 1, 32.0),
            _row(ec, 8, 180.0), _row("cupy:warp-decode-mma-t16", 8, 91.0), _row("cupy:auto-t16", 8, 93.0)]
    record = report.crossover_table([_run(rows)], MODEL, "uniform", "bf16-t16")
    p1, p8 = _point(record, 1), _point(record, 8)
    assert p1["cells"]["expert-centric"]["us"] == 40.0 and (p1["best"], p1["auto_vs_best"]) == (None, None)
    assert p8["best"] == "MMA" and p8["auto_vs_best"] == pytest.approx(93.0 / 91.0 - 1)
    assert report.crossover_cells(p1)["vs_best"] == "-" and record["fastest"]["expert-centric"] == []


def test_crossover_batch_invariant_column_and_cost():
    """cupy:auto-invariant rows (policy "batch_invariant") get a column and their cost over auto, per T."""
    run = _run([_row(STRICT, 1, 20.0), _row(AUTO, 1, 20.0), _row("cupy:auto-invariant", 1, 21.0),
                _row(BATCHED, 16, 100.0), _row(AUTO, 16, 100.0), _row("cupy:auto-invariant", 16, 101.5)])
    record = report.crossover_table([run], MODEL, "uniform")
    assert _point(record, 1)["invariant_vs_auto"] == pytest.approx(0.05)
    assert _point(record, 16)["invariant_vs_auto"] == pytest.approx(0.015)
    titles = dict(report.crossover_titles(record))
    assert titles["invariant"] == "batch-invariant µs (% roof)" and "invariant_cost" in titles
    assert "the batch-invariant policy costs T=1: +5.0 %, T=16: +1.5 % over auto" in record["summary"]
    plain = report.crossover_table([_run([_row(STRICT, 1, 20.0), _row(AUTO, 1, 20.0)])], MODEL, "uniform")
    assert "invariant" not in dict(report.crossover_titles(plain))


@pytest.mark.parametrize("fmt, auto, invariant", [
    ("fp8-block128", "cupy:auto-fp8", "cupy:auto-invariant-fp8"),
    ("fp8-block128-t16", "cupy:auto-fp8-t16", "cupy:auto-invariant-fp8-t16"),
    ("bf16-t16", "cupy:auto-t16", "cupy:auto-invariant-t16")])
def test_each_format_table_has_its_batch_invariant_column(fmt, auto, invariant):
    """Every format's invariant policy (cupy:auto-invariant-<format>) fills the invariant column of its own
    format's table, costed against that format's auto -- and never another format's."""
    run = _run([_row(auto, 16, 100.0), _row(invariant, 16, 102.0), _row("cupy:auto-invariant", 16, 90.0)])
    record = report.crossover_table([run], MODEL, "uniform", fmt)
    point = _point(record, 16)
    assert point["cells"]["invariant"]["us"] == 102.0 and point["invariant_vs_auto"] == pytest.approx(0.02)
    assert get_variant(invariant).weight_format == fmt


def test_load_fills_the_tuned_peer_rows_a_cut_run_lacks(tmp_path):
    """A peers run stopped by its time limit keeps its config rows but not the tuned rows it appends at its end:
    ``load`` adds the fastest checked config per point as the tuned peer, and leaves a point that has one alone."""
    peer = "triton:fused-moe-w8a8"
    rows = [_row("cupy:auto-fp8", 8, 70.0), _row(f"{peer}[A]", 8, 80.0), _row(f"{peer}[B]", 8, 75.0),
            _row(f"{peer}[C]", 8, 60.0, status="error"), _row(f"{peer}[A]", 16, 90.0), _row(f"{peer}[B]", 16, 95.0),
            _row(peer, 16, 91.0, tuned_from=f"{peer}[B]")]  # a tuned row written by the tool stays as it is
    path = tmp_path / "cut.json"
    path.write_text(json.dumps(_run(rows)))
    tuned = {r["batch"]: r for r in report.load(path)["results"] if r["variant"] == peer}
    assert (tuned[8]["median_us"], tuned[8]["tuned_from"]) == (75.0, f"{peer}[B]")
    assert (tuned[16]["median_us"], tuned[16]["tuned_from"]) == (91.0, f"{peer}[B]")
    assert len([r for r in report.load(path)["results"] if r["variant"] == peer]) == 2


# ------------------------------------------------------------------------------------------------
# Terminal widths, pipes and IPython
# ------------------------------------------------------------------------------------------------
WIDE_RUNS = ("h200-2026-12-02-candidates-uniform.json",  # two models, seven paths, a crossover table of its own
             "h200-2026-12-03-gate-up-hot-unroll-policies-peer-uniform.json",  # the peer's configs: long names
             "h200-2026-12-02-fp8-paths-uniform.json")  # the FP8 paths and their table


def _cpu_record() -> dict:
    """A run without a GPU, as the bench records it: simulator cases, the reference in four modes at seven batches,
    bytes (a mean of touched experts over routing draws) and compile rows named after long variants."""
    modes = ("warp_decode", "classical", "classical+fp8", "classical+mxfp8")
    compile_rows = [{"source": "s", "kernel": kernel, "params": {}, "registers": 128, "shared_bytes": 0,
                     "stack_bytes": 0, "spill_stores": 44, "spill_loads": 60, "threads_per_block": 256,
                     "warps_per_sm": 16, "occupancy": 0.25, "limiter": "registers", "variant": variant}
                    for variant, kernel in (("cupy:warp-decode-mma-grouped-fp8-t16", "moe_gate_up_3d_batched"),
                                            ("cupy:expert-centric, cupy:expert-centric-fp8, "
                                             "cupy:expert-centric-mxfp8", "gemm_fp8_scaled"),
                                            ("numba:warp-decode-fp8", "moe_gate_up_fp8_numba"))]
    return {"schema": "warp-decode-bench/1", "environment": {"date": "2026-12-04"}, "rooflines": None, "results": [],
            "config": {"variants": ["numba:warp-decode-fp8"], "routing": "uniform"},
            "cpu": {"reason": "no CUDA driver (libcuda not found)",
                    "simulator": {"status": "ok", "cases": [{"case": "numba:warp-decode-fp8 tiny T=1",
                                                             "rel_l2": 2.34e-3, "ulp": 0.0, "ok": True}]},
                    "reference": [{"mode": mode, "batch": batch, "rel_l2": 2.3e-3 * (1 + i), "max_abs": 1e-3}
                                  for i, mode in enumerate(modes) for batch in (1, 2, 4, 8, 16, 32, 64)],
                    "expected_bytes": [{"model": "qwen3-235b-a22b", "batch": 16,
                                        "bytes": {"unique_experts": 79.43, "weights": 7.5e8, "activation": 4096,
                                                  "intermediate": 24576, "output": 4096}, "us_at_4_8_tbps": 155.3}],
                    "compile_report": "summary", "compile": compile_rows}}


def _fit_tables(renderable):
    from rich.console import Group

    from tools.display import FitTable

    if isinstance(renderable, FitTable):
        yield renderable
    elif isinstance(renderable, Group):
        for part in renderable.renderables:
            yield from _fit_tables(part)


def _assert_fits(renderable, width: int) -> str:
    """``renderable`` laid out at ``width``: no line wider, and every word (a number, a name) of every cell of every
    column its tables keep shown whole on one line."""
    from tools.display import text_of

    text = text_of(renderable, width)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= width
    shown = {word for line in lines for word in line.split()}
    for table in _fit_tables(renderable):
        fit = table.fit(Console(width=width, file=io.StringIO()), width)
        assert fit.widths is not None, f"{table.title}: folds at {width}"
        for cells, _, _ in table.rows:
            for index in fit.kept:
                for word in cells[index].plain.split():
                    assert word in shown, f"{table.title} at {width}: {word!r} broken"
    return text


@pytest.mark.parametrize("width", [80, 100, 160])
def test_tables_fit_the_width_and_break_no_number_or_name(data, width):
    """At a terminal's width every table fits: optional columns are left out (least useful first) or titled short,
    one line under the table says so, and no number or name is split over two lines."""
    datas = [report.load(ROOT / "results" / name) for name in WIDE_RUNS]
    for run in (data, *datas, _cpu_record()):
        text = _assert_fits(report.renderables(run), width)
        notes = [line for line in text.splitlines() if line.startswith("(narrow terminal")]
        assert all(line.endswith(")") for line in notes)  # one line each
    for record in report.crossover_tables(datas):
        text = _assert_fits(report.crossover_rich(record), width)
        assert "narrow terminal" in text or width == 160
    cpu = report.renderables(_cpu_record())
    assert "79.4" in _assert_fits(cpu, width)  # a mean of touched experts: one decimal
    if width == 80:
        narrow = _assert_fits(report.crossover_rich(report.crossover_tables(datas)[0]), width)
        assert "auto" in narrow and "vs best" in narrow and "(narrow terminal: short titles; " in narrow


def test_narrow_note_is_one_line_naming_what_was_left_out():
    from tools.display import Column, FitTable

    table = FitTable([Column("name", "left"), Column("value"), *(Column(f"extra {i}", drop=i) for i in range(1, 9))])
    table.add_row("cupy:warp-decode-mma-grouped-fp8-t16", "1059.33", *[f"{i}.00e-03" for i in range(8)])
    text = _assert_fits(table, 60)
    note = text.splitlines()[-1]
    assert note.startswith("(narrow terminal: extra 1, extra 2") and note.endswith("more left out)")
    assert "narrow terminal" not in _assert_fits(table, 10_000)


def test_piped_output_has_no_trailing_spaces(data):
    """Rich pads a table's cells to their column's width; written to a pipe or a file, no line ends in a space (the
    report's and the bench's console, and the CLI's stdout)."""
    from tools.display import console

    out = io.StringIO()
    printer = console(out)
    printer.print(report.renderables(report.load(ROOT / "results" / WIDE_RUNS[1])))
    printer.print(BenchResult(data))
    lines = out.getvalue().splitlines()
    assert len(lines) > 50 and not [line for line in lines if line.endswith(" ")]
    assert "triton:fused-moe[M64-N128-K128-G16-w8-s3]" in out.getvalue()  # as wide as a line needs
    result = subprocess.run([sys.executable, "-m", "tools.report", str(FIXTURE)], cwd=ROOT, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0 and "cupy:warp-decode" in result.stdout
    assert not [line for line in result.stdout.splitlines() if line.endswith(" ")]


@pytest.mark.parametrize("columns", [80, 160])
def test_ipython_pretty_form_follows_the_terminal_width(data, monkeypatch, columns):
    monkeypatch.setenv("COLUMNS", str(columns))
    printed = []

    class Printer:
        def text(self, value):
            printed.append(value)

    BenchResult(data)._repr_pretty_(Printer(), False)
    lines = printed[0].splitlines()
    assert max(len(line) for line in lines) <= columns and "cupy:expert-centric" in printed[0]
    assert ("narrow terminal" in printed[0]) == (columns == 80)


# ------------------------------------------------------------------------------------------------
# results/REPORT.md: read in ten minutes; every run, chart and section it links exists
# ------------------------------------------------------------------------------------------------
def _slug(heading: str) -> str:
    """A markdown heading's anchor, as GitHub makes it."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_report_document_is_short_and_what_it_links_exists():
    path = ROOT / "results" / "REPORT.md"
    text = path.read_text()
    assert len(text.splitlines()) <= 800, "results/REPORT.md: a report a person reads in ten minutes"
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    files = [t for t in targets if not t.startswith("#")]
    assert any(t.endswith(".png") for t in files) and any(t.endswith(".json") for t in files)
    for target in files:
        assert (path.parent / target).is_file(), target
    for name in set(re.findall(r"results/[\w.-]+\.(?:json|log|png)", text)):
        assert (ROOT / name).is_file(), name
    anchors = {_slug(line.lstrip("#")) for line in text.splitlines() if line.startswith("#")}
    assert {t[1:] for t in targets if t.startswith("#")} <= anchors
    assert "`python -m tools.report results/<run>.json --markdown`" in text  # any run in full, on demand
    block = text[text.index(report.BEGIN):text.index(report.END)]
    tables = block.split("\n#### ")[1:]
    assert len(tables) >= 4
    for table in tables:  # each crossover table: its chart and the JSON its cells come from
        assert "![" in table and ".png)" in table and ".json)" in table, table[:80]
