"""``tools.report --plot``: figures drawn from committed bench JSON (matplotlib's Agg backend, no display, no GPU)."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tools import report

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "data" / "bench_sample.json"
PNG = b"\x89PNG\r\n\x1a\n"


def _row(variant: str, batch: int, us: float, weight_format: str = "bf16", routing: str = "uniform",
         status: str = "ok") -> dict:
    return {"model": "qwen3-30b-a3b", "variant": variant, "batch": batch, "routing": routing, "status": status,
            "median_us": us if status == "ok" else None, "tbps": 75e-3 * batch / us if status == "ok" else None,
            "bytes": {"weights": 75e6 * batch, "unique_experts": 8.0 * batch, "weight_format": weight_format}}


def _run(rows: list[dict], read_tbps: float = 4.5) -> dict:
    return {"schema": "warp-decode-bench/1", "config": {"routing": "uniform"}, "rooflines": {"read_tbps": read_tbps},
            "results": rows}


def test_groups_merge_runs_later_file_wins():
    """Per (model, routing, weight format), every timed path's points: a later run wins a cell whatever its status
    (as in the crossover tables), a peer's configs show only through the tuned peer, per-run rooflines."""
    from tools import plot

    first = _run([_row("cupy:warp-decode", 1, 20.0), _row("cupy:warp-decode", 8, 100.0),
                  _row("cupy:expert-centric", 1, 40.0), _row("cupy:warp-decode-fp8", 1, 12.0, "fp8-block128")])
    later = _run([_row("cupy:warp-decode", 1, 30.0), _row("cupy:expert-centric", 1, 0.0, status="error"),
                  _row("triton:fused-moe[M16-N64]", 1, 31.0), _row("triton:fused-moe", 1, 31.0),
                  _row("cupy:auto", 1, 19.0, routing="zipf")], read_tbps=4.0)
    groups = plot.groups([first, later])
    assert list(groups) == [("qwen3-30b-a3b", "uniform", "bf16"), ("qwen3-30b-a3b", "uniform", "fp8-block128"),
                            ("qwen3-30b-a3b", "zipf", "bf16")]
    bf16 = groups[("qwen3-30b-a3b", "uniform", "bf16")]
    assert [(p["batch"], p["us"]) for p in bf16["cupy:warp-decode"]] == [(1, 30.0), (8, 100.0)]
    assert "cupy:expert-centric" not in bf16  # its later row failed: the older timing is hidden
    assert set(bf16) == {"cupy:warp-decode", "triton:fused-moe"}
    assert bf16["cupy:warp-decode"][0]["pct"] == pytest.approx(100 * 75e-3 / 30.0 / 4.0)
    assert plot.file_stem("qwen3-30b-a3b", "uniform", "fp8-block128") == "qwen3-30b-a3b-uniform-fp8-block128"


def test_plot_writes_a_png_per_group(tmp_path, capsys):
    """--plot writes a figure pair per (model, routing, format) and the headline chart, and prints their paths."""
    fp8 = copy.deepcopy(report.load(FIXTURE))
    for row in fp8["results"]:
        row["routing"] = "zipf"
        row["variant"] = {"cupy:warp-decode": "cupy:warp-decode-fp8",
                          "cupy:expert-centric": "cupy:expert-centric-w8a8"}.get(row["variant"], row["variant"])
        (row.get("bytes") or {})["weight_format"] = "fp8-block128"
    extra = tmp_path / "fp8.json"
    extra.write_text(json.dumps(fp8))
    started = time.perf_counter()
    assert report.main([str(FIXTURE), str(extra), "--plot", str(tmp_path / "plots")]) == 0
    assert time.perf_counter() - started < 10
    printed = capsys.readouterr().out.split()
    names = sorted(Path(p).name for p in printed)
    assert names == sorted(["qwen3-30b-a3b-uniform-bf16.png", "qwen3-30b-a3b-uniform-bf16-roofline.png",
                            "qwen3-30b-a3b-zipf-fp8-block128.png", "qwen3-30b-a3b-zipf-fp8-block128-roofline.png",
                            "qwen3-30b-a3b-uniform-headline.png"])
    for path in printed:
        data = Path(path).read_bytes()
        assert data.startswith(PNG) and len(data) > 10_000, path


def test_plot_format_svg_writes_both(tmp_path):
    from tools import plot

    written = plot.write([_run([_row("cupy:warp-decode", 1, 20.0), _row("cupy:warp-decode", 2, 38.0)])], tmp_path,
                         "svg")
    assert [p.name for p in written] == ["qwen3-30b-a3b-uniform-bf16.png", "qwen3-30b-a3b-uniform-bf16.svg",
                                         "qwen3-30b-a3b-uniform-bf16-roofline.png",
                                         "qwen3-30b-a3b-uniform-bf16-roofline.svg"]
    assert b"<svg" in written[1].read_bytes() and written[0].read_bytes().startswith(PNG)


def test_headline_figure_draws_auto_the_baselines_and_the_peer():
    from tools import plot

    run = _run([_row(v, t, us * t) for v, us in (("cupy:auto", 20.0), ("cupy:warp-decode", 21.0),
                                                  ("cupy:expert-centric", 40.0), ("triton:fused-moe", 30.0),
                                                  ("cupy:warp-decode-mma", 25.0)) for t in (1, 8, 64)])
    figure = plot.headline_figure([run], "qwen3-30b-a3b", "uniform")
    time_ax, roof_ax = figure.axes
    labels = [line.get_label() for line in time_ax.get_lines()]
    assert labels == ["auto (cupy:auto)", "Triton peer (triton:fused-moe)", "strict warp decode (cupy:warp-decode)",
                      "expert-centric (cupy:expert-centric)"]
    assert time_ax.get_xscale() == "log" and list(time_ax.get_xticks()) == [1, 8, 64]
    assert time_ax.get_lines()[0].get_linewidth() > time_ax.get_lines()[2].get_linewidth()  # auto stands out
    assert time_ax.get_lines()[1].get_linestyle() == "--" and roof_ax.get_ylim()[1] >= 100


@pytest.mark.parametrize("argv, message", [
    (["--plot", "out"], "--plot: give the JSON files"),
    ([str(FIXTURE), "--plot", "out", "--plot-format", "pdf"], "invalid choice: 'pdf'"),
    ([str(FIXTURE), "--plot-format", "svg"], "--plot-format: give --plot DIR too"),
])
def test_plot_cli_errors_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        report.main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_plot_without_matplotlib_exits_2_with_one_line(tmp_path, monkeypatch, capsys):
    for name in [n for n in sys.modules if n == "matplotlib" or n.startswith("matplotlib.")] or ["matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)  # importing it raises ImportError, as where it is not installed
    monkeypatch.delitem(sys.modules, "tools.plot", raising=False)
    monkeypatch.delattr(sys.modules["tools"], "plot", raising=False)  # imported by an earlier test: import afresh
    assert report.main([str(FIXTURE), "--plot", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--plot needs matplotlib>=3.7" in err
    assert not list(tmp_path.iterdir())


def test_the_report_alone_needs_no_matplotlib():
    code = "import sys, tools.report; sys.exit('matplotlib' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=60).returncode == 0


def test_update_readme_with_plot_draws_the_charts_it_links(tmp_path, capsys):
    """--update-readme FILE --plot DIR (the runs from FILE's own command): a chart per crossover table, the ones the
    document links (relative to it), and nothing else."""
    doc = tmp_path / "results" / "REPORT.md"
    doc.parent.mkdir()
    doc.write_text(f"`python -m tools.report {FIXTURE} --update-readme results/REPORT.md --plot results/plots`\n"
                   "<!-- bench:begin -->\n<!-- bench:end -->\n")
    assert report.main(["--update-readme", str(doc), "--plot", str(doc.parent / "plots")]) == 0
    printed = [Path(p) for p in capsys.readouterr().out.split() if p.endswith(".png")]
    assert [p.name for p in printed] == ["qwen3-30b-a3b-uniform-bf16-crossover.png"]
    assert sorted(p.name for p in (doc.parent / "plots").iterdir()) == [printed[0].name]
    assert printed[0].read_bytes().startswith(PNG)
    assert "](plots/qwen3-30b-a3b-uniform-bf16-crossover.png)" in doc.read_text()


def test_crossover_figure_draws_the_table_columns_in_fixed_colours():
    """A crossover table's chart: its paths, auto and the peer (not the batch-invariant policy), labelled by column,
    each path in its column's colour whatever the format."""
    from tools import plot

    rows = [_row(v, t, us * t, "fp8-block128-t16") for v, us in (("cupy:auto-fp8-t16", 10.0),
                                                                 ("cupy:warp-decode-mma-fp8-t16", 11.0),
                                                                 ("cupy:auto-invariant-fp8-t16", 10.5))
            for t in (1, 8)]
    rows += [_row("triton:fused-moe-w8a8", t, 12.0 * t, "fp8-block128") for t in (1, 8)]
    figure = plot.crossover_figure([_run(rows)], "qwen3-30b-a3b", "uniform", "fp8-block128-t16")
    lines = {line.get_label(): line for line in figure.axes[0].get_lines()}
    assert list(lines) == ["auto (cupy:auto-fp8-t16)", "Triton W8A8 peer (triton:fused-moe-w8a8)",
                           "MMA (cupy:warp-decode-mma-fp8-t16)"]
    assert lines["MMA (cupy:warp-decode-mma-fp8-t16)"].get_color() == plot.COLUMN_COLORS["MMA"]
