"""Figures drawn from committed bench JSON with matplotlib (Agg: no display needed); ``tools.report --plot`` calls it.

    python -m tools.report results/A.json results/B.json --plot results/plots              # PNG
    python -m tools.report results/A.json --plot results/plots --plot-format svg           # PNG and SVG

Per (model, routing, weight format), :func:`paths_figure`: µs per layer and % of the streaming-read roofline against
T, a line per path (``cupy:auto*`` thick, the Triton peer dashed with triangles), and :func:`roofline_figure`: the
weight bytes each point touched against its time per layer, under the roofline measured in the runs (bytes = roofline
x time). :func:`headline_figure` is the README's chart: auto, the strict and expert-centric baselines and the peer;
:func:`crossover_figure` the chart of one crossover table (its columns), the ones ``tools.report --update-readme FILE
--plot DIR`` draws (:func:`write_crossover`) and links from FILE.

Cells come from ``tools.runs.latest_rows`` (a later file wins a cell, as in the crossover tables); only timed rows
are drawn, and a peer's configs (``triton:fused-moe[...]``) only through the tuned peer row. A tiled format's figures
show its row layout's baseline and peer beside its own paths, as its crossover table does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, NullFormatter, NullLocator

from tools import runs
from tools.roofline import percent

FORMATS = runs.PLOT_FORMATS
Series = dict[str, list[dict[str, Any]]]  # variant -> its points in T order: batch, us, pct, weights, roof


# ------------------------------------------------------------------------------------------------
# Data
# ------------------------------------------------------------------------------------------------
def groups(datasets: list[dict[str, Any]]) -> dict[tuple[str, str, str], Series]:
    """(model, routing, weight format) -> the timed points of each path, from the merged runs (first-seen order)."""
    out: dict[tuple[str, str, str], Series] = {}
    for (model, routing, variant, batch), latest in runs.latest_rows(datasets).items():
        row = latest["row"]
        if variant.endswith("]") or row.get("status") != "ok" or row.get("median_us") is None:
            continue
        point = {"batch": batch, "us": row["median_us"], "pct": percent(row.get("tbps"), latest["roof"]),
                 "weights": (row.get("bytes") or {}).get("weights"), "roof": latest["roof"]}
        weight_format = str((row.get("bytes") or {}).get("weight_format") or "bf16")
        formats = [weight_format] + [fmt for fmt, borrowed in runs.CROSSOVER_BORROWED.items() if variant in borrowed]
        for fmt in formats:
            out.setdefault((model, routing, fmt), {}).setdefault(variant, []).append(point)
    for series in out.values():
        for points in series.values():
            points.sort(key=lambda p: p["batch"])
    borrowed = runs.CROSSOVER_BORROWED  # a tiled format's figure needs a path of its own, not only borrowed rows
    return {key: series for key, series in out.items() if any(v not in borrowed.get(key[2], ()) for v in series)}


file_stem = runs.figure_stem  # ``qwen3-30b-a3b``, ``uniform``, ``bf16`` -> ``qwen3-30b-a3b-uniform-bf16``


def crossover_series(datasets: list[dict[str, Any]], model: str, routing: str, weight_format: str = "bf16") -> Series:
    """The timed points of the columns of the crossover table of ``weight_format`` for ``model`` under ``routing``
    (its paths, auto and the peer; not the batch-invariant policy, whose cost has a table of its own), from the same
    merge as the table (``tools.runs.latest_rows``), in the table's column order."""
    columns = {variant: column for variant, column in runs.CROSSOVER_SETS[weight_format].items()
               if column != "invariant"}
    found: dict[str, list[dict[str, Any]]] = {}
    for (row_model, routed, variant, batch), latest in runs.latest_rows(datasets).items():
        row = latest["row"]
        if (row_model, routed) != (model, routing) or variant not in columns or row.get("status") != "ok" \
                or row.get("median_us") is None:
            continue
        found.setdefault(variant, []).append({
            "batch": batch, "us": row["median_us"], "pct": percent(row.get("tbps"), latest["roof"]),
            "weights": (row.get("bytes") or {}).get("weights"), "roof": latest["roof"]})
    order = {column: index for index, column in enumerate(runs.CROSSOVER_COLUMNS)}
    return {variant: sorted(found[variant], key=lambda p: p["batch"])
            for variant in sorted(found, key=lambda v: order[columns[v]])}


# ------------------------------------------------------------------------------------------------
# Style
# ------------------------------------------------------------------------------------------------
def _style(variant: str, index: int) -> dict[str, Any]:
    """``cupy:auto*`` thick and on top, the peer (``triton:*``) dashed with triangles, every other path thin."""
    if variant.startswith("cupy:auto"):
        colors = ("black", "tab:purple", "tab:brown", "tab:olive")
        return {"color": colors[index % len(colors)], "linewidth": 3.0, "marker": "o", "markersize": 5, "zorder": 5}
    if variant.startswith("triton:"):
        return {"color": "tab:red", "linewidth": 2.0, "linestyle": "--", "marker": "^", "markersize": 7, "zorder": 4}
    colors = ("tab:blue", "tab:orange", "tab:green", "tab:cyan", "tab:pink", "tab:gray", "gold", "navy", "teal")
    return {"color": colors[index % len(colors)], "linewidth": 1.3, "marker": ".", "markersize": 6, "zorder": 3}


def _styles(series: Series) -> dict[str, dict[str, Any]]:
    """A style per variant of ``series``, the autos and the other paths each numbered in their own colour cycle."""
    counts = {"auto": 0, "other": 0}
    styles = {}
    for variant in series:
        kind = "auto" if variant.startswith("cupy:auto") else "other"
        styles[variant] = _style(variant, counts[kind])
        counts[kind] += not variant.startswith("triton:")
    return styles


def _batch_axis(ax: Any, batches: list[int]) -> None:
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(batches))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticklabels([str(b) for b in batches])
    ax.set_xlabel("T (tokens in the decode batch)")
    ax.grid(True, which="both", alpha=0.3)


def _log_axis(axis: Any) -> None:
    """A log axis labelled 1, 2, 5, 10, 20, ... in plain numbers."""
    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    axis.set_minor_formatter(NullFormatter())


def _legend_order(series: Series) -> list[str]:
    """The autos first, then the peer, then the other paths (each in first-seen order)."""
    rank = {True: 0, False: 2}
    return sorted(series, key=lambda v: 1 if v.startswith("triton:") else rank[v.startswith("cupy:auto")])


def _figure(width: float, height: float) -> Figure:
    figure = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    return figure


# ------------------------------------------------------------------------------------------------
# Figures
# ------------------------------------------------------------------------------------------------
def paths_figure(series: Series, title: str, labels: dict[str, str] | None = None,
                 colors: dict[str, str] | None = None) -> Figure:
    """µs per layer (log) and % of the read roofline against T (log2), a line per path of ``series``; ``colors``:
    a colour per variant, in place of the one its place in the series gives it."""
    labels = labels or {}
    figure = _figure(13, 4.8)
    time_ax, roof_ax = figure.subplots(1, 2)
    styles = _styles(series)
    for variant, color in (colors or {}).items():
        if variant in styles:
            styles[variant] = {**styles[variant], "color": color}
    batches = sorted({p["batch"] for points in series.values() for p in points})
    for variant in _legend_order(series):
        points, label = series[variant], labels.get(variant, variant)
        time_ax.plot([p["batch"] for p in points], [p["us"] for p in points], label=label, **styles[variant])
        timed = [p for p in points if p["pct"] is not None]
        roof_ax.plot([p["batch"] for p in timed], [p["pct"] for p in timed], label=label, **styles[variant])
    for ax in (time_ax, roof_ax):
        _batch_axis(ax, batches)
    time_ax.set_yscale("log")
    _log_axis(time_ax.yaxis)
    time_ax.set_ylabel("µs per layer (median)")
    roof_ax.set_ylabel("% of the streaming-read roofline")
    roof_ax.set_ylim(0, 105)
    roof_ax.axhline(100, color="gray", linewidth=0.8)
    roof_ax.legend(loc="center left", bbox_to_anchor=(1.02, 0.5), fontsize="small", frameon=False)
    figure.suptitle(title)
    return figure


def roofline_figure(series: Series, title: str) -> Figure:
    """Weight bytes touched (GB) against µs per layer, log-log, a line per path through its T points, under the
    streaming-read roofline of each run that measured them (GB = TB/s x µs / 1000)."""
    figure = _figure(9, 6)
    ax = figure.subplots()
    styles = _styles(series)
    drawn = [p for points in series.values() for p in points if p["weights"]]
    for variant in _legend_order(series):
        counted = [p for p in series[variant] if p["weights"]]
        ax.plot([p["us"] for p in counted], [p["weights"] / 1e9 for p in counted], label=variant, **styles[variant])
    if drawn:
        low, high = min(p["us"] for p in drawn) / 1.5, max(p["us"] for p in drawn) * 1.5
        for roof in sorted({round(p["roof"], 2) for p in drawn if p["roof"]}):
            ax.plot([low, high], [roof * low / 1e3, roof * high / 1e3], color="gray", linewidth=1.2, linestyle=":",
                    label=f"streaming-read roofline, {roof:.2f} TB/s", zorder=1)
        ax.set_xlim(low, high)
        gigabytes = [p["weights"] / 1e9 for p in drawn]
        ax.set_ylim(min(gigabytes) / 1.5, max(gigabytes) * 1.5)
    ax.set_xscale("log")
    ax.set_yscale("log")
    _log_axis(ax.xaxis)
    _log_axis(ax.yaxis)
    ax.set_xlabel("µs per layer (median)")
    ax.set_ylabel("expert weight bytes touched per layer (GB)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="upper left", fontsize="small", frameon=False)
    ax.set_title(title)
    return figure


HEADLINE = {"auto": "auto", "strict": "strict warp decode", "expert-centric": "expert-centric", "peer": "Triton peer"}


def headline_series(merged: dict[tuple[str, str, str], Series], model: str, routing: str,
                    weight_format: str = "bf16") -> Series:
    """The lines of :func:`headline_figure` that ``merged`` (:func:`groups`) holds, in :data:`HEADLINE` order."""
    columns = {column: variant for variant, column in runs.CROSSOVER_SETS[weight_format].items()}
    series = merged.get((model, routing, weight_format), {})
    return {columns[c]: series[columns[c]] for c in HEADLINE if c in columns and columns[c] in series}


def headline_figure(datasets: list[dict[str, Any]], model: str, routing: str, weight_format: str = "bf16",
                    merged: dict[tuple[str, str, str], Series] | None = None) -> Figure:
    """The README's chart for ``model`` under ``routing``: auto, the strict and the expert-centric baselines and the
    Triton peer against T, in µs per layer and % of the read roofline (the variants of the crossover table of
    ``weight_format``; a line the runs did not measure is left out). ``merged``: :func:`groups` of ``datasets``,
    where already made."""
    series = headline_series(groups(datasets) if merged is None else merged, model, routing, weight_format)
    columns = runs.CROSSOVER_SETS[weight_format]
    labels = {variant: f"{HEADLINE[columns[variant]]} ({variant})" for variant in series}
    fmt = "" if weight_format == "bf16" else f", {weight_format} weights"
    return paths_figure(series, f"{model}, {routing} routing{fmt}", labels)


# a crossover chart's colour per column, the same in every format's chart (auto and the peer keep their styles)
COLUMN_COLORS = {"strict": "tab:blue", "batched": "tab:orange", "mixed": "tab:green", "MMA": "tab:cyan",
                 "per-pair": "tab:pink", "grouped": "tab:gray", "expert-centric": "gold"}


def crossover_figure(datasets: list[dict[str, Any]], model: str, routing: str, weight_format: str = "bf16") -> Figure:
    """The chart of one crossover table (``tools.report.crossover_table``): its columns' µs per layer and % of the
    read roofline against T, labelled by column (``strict (cupy:warp-decode)``)."""
    series = crossover_series(datasets, model, routing, weight_format)
    columns = runs.CROSSOVER_SETS[weight_format]
    peer = "Triton peer" if weight_format in ("bf16", "bf16-t16") else "Triton W8A8 peer"
    labels = {variant: f"{peer if columns[variant] == 'peer' else columns[variant]} ({variant})" for variant in series}
    colors = {variant: COLUMN_COLORS[columns[variant]] for variant in series if columns[variant] in COLUMN_COLORS}
    return paths_figure(series, f"{model}, {routing} routing, {weight_format} weights", labels, colors)


# ------------------------------------------------------------------------------------------------
# Files
# ------------------------------------------------------------------------------------------------
def write(datasets: list[dict[str, Any]], directory: str | Path, plot_format: str = "png") -> list[Path]:
    """Every figure of ``datasets`` as PNG under ``directory`` (and SVG too where ``plot_format`` is "svg"): per
    (model, routing, format) ``MODEL-ROUTING-FORMAT.png`` and ``MODEL-ROUTING-FORMAT-roofline.png``, and per
    (model, routing) with two or more of the headline's lines in bf16, ``MODEL-ROUTING-headline.png``. Returns the
    paths written, in order."""
    if plot_format not in FORMATS:
        raise ValueError(f"plot format must be one of {FORMATS}, got {plot_format!r}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    suffixes = dict.fromkeys(("png", plot_format))
    written: list[Path] = []

    def save(figure: Figure, stem: str) -> None:
        for suffix in suffixes:
            path = directory / f"{stem}.{suffix}"
            figure.savefig(path)
            written.append(path)

    merged = groups(datasets)
    for (model, routing, fmt), series in merged.items():
        title = f"{model}, {routing} routing, {fmt} weights"
        save(paths_figure(series, title), file_stem(model, routing, fmt))
        save(roofline_figure(series, title), file_stem(model, routing, fmt, "roofline"))
    for model, routing in dict.fromkeys((m, r) for m, r, fmt in merged if fmt == "bf16"):
        if len(headline_series(merged, model, routing)) >= 2:
            save(headline_figure(datasets, model, routing, merged=merged), file_stem(model, routing, "headline"))
    return written


def write_crossover(datasets: list[dict[str, Any]], directory: str | Path, keys: list[tuple[str, str, str]],
                    plot_format: str = "png") -> list[Path]:
    """The chart of each crossover table ``keys`` names ((model, routing, weight format)), as
    ``MODEL-ROUTING-FORMAT-crossover.png`` under ``directory`` (and SVG too where ``plot_format`` is "svg"): the
    figures a report generated by ``tools.report --update-readme`` links. Returns the paths written, in order."""
    if plot_format not in FORMATS:
        raise ValueError(f"plot format must be one of {FORMATS}, got {plot_format!r}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for model, routing, fmt in keys:
        figure = crossover_figure(datasets, model, routing, fmt)
        for suffix in dict.fromkeys(("png", plot_format)):
            path = directory / f"{runs.crossover_figure_stem(model, routing, fmt)}.{suffix}"
            figure.savefig(path)
            written.append(path)
    return written
