"""Render a bench result (the JSON ``tools.bench`` writes) as rich tables or markdown; no GPU needed.

    python -m tools.report results/h200.json                      # the rich report
    python -m tools.report results/h200.json --markdown           # markdown tables for a PR
    python -m tools.report results/*.json --update-readme results/REPORT.md   # the report's tables, regenerated
    python -m tools.report results/uniform.json --headline README.md          # the README's crossover tables
    python -m tools.report results/uniform.json results/zipf.json  # several runs: + crossover tables over all
    python -m tools.report --update-readme results/REPORT.md       # again from the runs its own command names
    python -m tools.report --update-readme results/REPORT.md --plot results/plots   # and the charts it links
    python -m tools.report results/uniform.json results/zipf.json --plot results/plots  # figures (PNG; matplotlib)

``--update-readme`` replaces the text between ``<!-- bench:begin -->`` and ``<!-- bench:end -->`` with a report
(``report_markdown``): per weight format, model and routing the crossover table and a link to its chart, the
batch-invariant policy's cost over auto, Numba against CuPy, every run a link to its JSON -- not every run's rows: the
JSON is the record, and ``python -m tools.report RUN.json --markdown`` prints one run's full tables (the report says
so). With ``--plot DIR`` it also draws the charts it links (``DIR/MODEL-ROUTING-FORMAT-crossover.png``; without it the
links point at ``plots/`` beside the document). ``--headline`` replaces the text between ``<!-- headline:begin -->``
and ``<!-- headline:end -->`` with the bf16 crossover tables alone, in a compact form. Every number in a document is
regenerated from committed JSON, never typed. A generated
document names the command that made it (``python -m tools.report A.json B.json ... --update-readme FILE``); given no
JSON and one of the two options, the tool regenerates FILE from the runs that command names (``named_runs``): add a
run by adding it to the document's command, then run the tool on the document alone.

TB/s = unique expert weight bytes of the call (experts touched by this routing x 3*H*I*2) / median time.
"% roof" is that figure as a percentage of the streaming-read roofline measured in the same run.

``--plot DIR`` draws the runs instead of printing them (``tools.plot``: per model, routing and weight format, µs per
layer and % of the roofline against T and a roofline view; the README's headline chart), as PNG, and SVG too with
``--plot-format svg``, and prints the paths written; with ``--update-readme`` it draws that document's charts instead
(one per crossover table). It needs matplotlib, which nothing else here does.

Given several files (say a uniform and a Zipf run), the report also prints one crossover table per (model, routing):
strict warp decode, batched warp decode (FMA, mixed and tensor-core MMA), expert-centric and ``cupy:auto`` per batch,
the fastest single path, and how far auto is from it (``crossover_table``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console, Group
from rich.text import Text

from tools.cli import examples
from tools.display import Column, FitTable
from tools.display import console as output_console
from tools.roofline import bar, percent
from tools.runs import (
    CROSSOVER_BORROWED,
    CROSSOVER_COLUMNS,
    CROSSOVER_PATHS,
    CROSSOVER_SETS,
    PATH_COLUMNS,
    PLOT_FORMATS,
    crossover_figure_stem,
    latest_rows,
    row_routing,
)

BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"
HEADLINE = ("<!-- headline:begin -->", "<!-- headline:end -->")
DIVISOR_NOTE = (
    "TB/s = unique expert weight bytes touched by the routing, in each row's weight format ({formats}; bf16: "
    "experts x 3*H*I*2 bytes, a scaled format counts its scales) / median time per layer; % roof = that / the "
    "streaming-read roofline measured in the same run."
)


def divisor_note(data: dict[str, Any]) -> str:
    """:data:`DIVISOR_NOTE` naming the weight formats the rows of ``data`` were counted in."""
    formats = sorted({(row.get("bytes") or {}).get("weight_format", "bf16") for row in data.get("results") or []})
    return DIVISOR_NOTE.format(formats="here: " + ", ".join(formats or ["bf16"]))


# ------------------------------------------------------------------------------------------------
# Derived figures
# ------------------------------------------------------------------------------------------------
def tuned_rows(data: dict[str, Any], peer: str) -> list[dict[str, Any]]:
    """Per (model, batch, routing), the fastest checked ``peer[config]`` row of ``data``, renamed to ``peer`` (the
    tuned peer; ``tuned_from`` names the config)."""
    best: dict[tuple[Any, ...], dict[str, Any]] = {}
    for row in data.get("results", []):
        if not row["variant"].startswith(peer + "[") or row.get("status") != "ok":
            continue
        key = (row["model"], row["batch"], row.get("routing"))
        if key not in best or row["median_us"] < best[key]["median_us"]:
            best[key] = row
    return [{**row, "variant": peer, "tuned_from": row["variant"]} for row in best.values()]


def load(path: str | Path) -> dict[str, Any]:
    """A bench record; a ``tools.peers`` run cut short (by a time limit) before it appended its tuned peer rows gets
    them here, from the config rows it did write -- the rows the peers tool appends at its end."""
    data = json.loads(Path(path).read_text())
    results = data.get("results") if isinstance(data, dict) else None
    if not isinstance(results, list) or not all(isinstance(r, dict) and isinstance(r.get("variant"), str)
                                                for r in results):
        return data  # not a bench record: main says so
    families = {row["variant"].split("[")[0] for row in results if row["variant"].endswith("]")}
    for peer in sorted(families):
        have = {(r["model"], r["batch"], r.get("routing")) for r in results if r["variant"] == peer}
        results.extend(row for row in tuned_rows(data, peer) if (row["model"], row["batch"], row.get("routing"))
                       not in have)
    return data


def models(data: dict[str, Any]) -> list[str]:
    seen: list[str] = []
    for row in data.get("results", []):
        if row["model"] not in seen:
            seen.append(row["model"])
    return seen


def _timed(row: dict[str, Any]) -> bool:
    return row.get("status") == "ok" and row.get("median_us") is not None


def baseline_name(rows: list[dict[str, Any]]) -> str | None:
    """The variant speedups are measured against: ``baseline=True``, unquantized preferred."""
    candidates = [r for r in rows if r.get("baseline")]
    if not candidates:
        return None
    plain = [r for r in candidates if not r.get("quant")]
    return (plain or candidates)[0]["variant"]


def speedup(data: dict[str, Any], row: dict[str, Any]) -> float | None:
    """baseline median / this median at the same model and batch (> 1: faster than the baseline)."""
    rows = [r for r in data.get("results", []) if r["model"] == row["model"]]
    base = baseline_name(rows)
    if base is None or not _timed(row):
        return None
    for r in rows:
        if r["variant"] == base and r["batch"] == row["batch"] and _timed(r):
            return r["median_us"] / row["median_us"]
    return None


def _is_warp(row: dict[str, Any]) -> bool:
    return str(row.get("family", "")).startswith("warp-decode") and not row.get("baseline")


def _format(row: dict[str, Any]) -> str:
    return str((row.get("bytes") or {}).get("weight_format", "bf16"))


def crossover(data: dict[str, Any], model: str) -> dict[str, Any]:
    """The first batch at which the baseline beats the fastest warp-decode variant, if it does (variants reading
    the baseline's weight format only: a format with fewer bytes is another race)."""
    rows = [r for r in data.get("results", []) if r["model"] == model]
    base = baseline_name(rows)
    base_format = next((_format(r) for r in rows if r["variant"] == base), "bf16")
    rows = [r for r in rows if _format(r) == base_format]
    record: dict[str, Any] = {"model": model, "baseline": base, "batch": None, "compared": []}
    if base is None:
        record["text"] = f"{model}: no baseline variant measured, no crossover computed"
        return record
    batches = sorted({r["batch"] for r in rows})
    for batch in batches:
        base_row = next((r for r in rows if r["variant"] == base and r["batch"] == batch and _timed(r)), None)
        warps = [r for r in rows if r["batch"] == batch and _is_warp(r) and _timed(r)]
        if base_row is None or not warps:
            continue
        best = min(warps, key=lambda r: r["median_us"])
        record["compared"].append({"batch": batch, "baseline_us": base_row["median_us"], "warp": best["variant"],
                                   "warp_us": best["median_us"]})
        if record["batch"] is None and base_row["median_us"] < best["median_us"]:
            record["batch"] = batch
            record["warp"] = best["variant"]
    if not record["compared"]:
        record["text"] = f"{model}: crossover unknown (need timed {base} and warp-decode rows at a common batch)"
    elif record["batch"] is None:
        last = record["compared"][-1]["batch"]
        record["text"] = f"{model}: {base} never overtakes warp decode up to batch {last}"
    else:
        record["text"] = (f"{model}: {base} overtakes warp decode ({record['warp']}) at batch {record['batch']}")
    return record


# ------------------------------------------------------------------------------------------------
# The crossover table: strict vs batched vs expert-centric vs auto, per model and routing, over several runs
# ------------------------------------------------------------------------------------------------
AUTO_SLACK = 0.03  # the issue's bar: auto may be at most 3 % slower than the best single path


def crossover_keys(datasets: list[dict[str, Any]], weight_format: str = "bf16") -> list[tuple[str, str]]:
    """Every (model, routing) with rows of at least two of strict / batched / expert-centric / auto (first-seen order)
    among the paths of ``weight_format`` (:data:`CROSSOVER_SETS`).

    One path alone has no crossover, so a run of the strict kernel only over many presets adds no table; nor do
    columns that several formats' tables share (the W8A8 baseline and peer) without a path of the format's own.
    """
    variants = CROSSOVER_SETS[weight_format]
    shared = {v for fmt, other in CROSSOVER_SETS.items() if fmt != weight_format for v in other}
    columns: dict[tuple[str, str], set[str]] = {}
    own: set[tuple[str, str]] = set()  # keys with a row of this format's own paths (not only a shared baseline / peer)
    for data in datasets:
        for row in data.get("results", []):
            if row.get("variant") in variants:
                key = (row["model"], row_routing(data, row))
                columns.setdefault(key, set()).add(variants[row["variant"]])
                if row["variant"] not in shared:
                    own.add(key)
    return [key for key, seen in columns.items() if len(seen) >= 2 and key in own]


def _short(variant: str | None) -> str | None:
    if variant is None:
        return None
    return next((v[variant] for v in CROSSOVER_SETS.values() if variant in v), variant)


def _signed_percent(fraction: float) -> str:
    """0.004 -> "+0.4 %" (never "-0.0 %")."""
    text = f"{100 * fraction:+.1f} %"
    return "+0.0 %" if text == "-0.0 %" else text


def _t_ranges(batches: list[int], everything: list[int]) -> str:
    """``[1, 2, 4, 16]`` within ``[1, 2, 4, 8, 16]`` -> "1-4, 16": runs of consecutive measured batches."""
    runs: list[list[int]] = []
    for batch in batches:
        if runs and everything.index(batch) == everything.index(runs[-1][-1]) + 1:
            runs[-1].append(batch)
        else:
            runs.append([batch])
    return ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


def crossover_table(datasets: list[dict[str, Any]], model: str, routing: str,
                    weight_format: str = "bf16") -> dict[str, Any]:
    """Strict, batched, expert-centric and auto per batch for ``model`` under ``routing``, over several bench runs.

    ``datasets``: bench JSON records in order. When several of them measured the same (variant, model, batch,
    routing), the LATER one wins, whatever its status (a later failure hides an older timing: the kernel changed).
    Each cell's "% roof" uses the read roofline of the run that measured that row. Only status-"ok" timed rows are
    compared: ``best`` is the fastest single path at that batch (not a column the table borrows,
    :data:`CROSSOVER_BORROWED`), ``auto_vs_best`` =
    auto / best - 1 and ``flag`` is set when that exceeds ``AUTO_SLACK`` (3 %). ``choice`` is the variant auto
    picked when its row records one (key ``choice``; ``choice_source``: "table" / "heuristic"), else None.
    ``mixed_runs``: the timed cells of that batch come from different files. ``summary``: the batch ranges where
    each path is fastest and how often auto is within 3 % of the best. ``weight_format``: the table of that format's
    paths (:data:`CROSSOVER_SETS`; fp8-block128: the FP8 paths, the W8A8 baseline and the W8A8 peer).
    ``invariant_vs_auto``: the batch-invariant cell over the auto cell; ``invariant_vs_own_auto``: over the auto row
    of the run that measured the invariant cell (one process), None where that run timed no auto there.
    """
    variants = CROSSOVER_SETS[weight_format]
    paths = {column: variant for variant, column in variants.items() if column in PATH_COLUMNS}
    auto_variant = next(v for v, c in variants.items() if c == "auto")
    found: dict[tuple[str, int], dict[str, Any]] = {}
    for (row_model, routed, variant, batch), latest in latest_rows(datasets).items():
        column = variants.get(variant)
        if column is None or row_model != model or routed != routing:
            continue
        row = latest["row"]
        timed = _timed(row)
        tbps = row.get("tbps") if timed else None
        found[(column, batch)] = {
            "variant": variant, "status": row.get("status"), "source": latest["source"],
            "us": row["median_us"] if timed else None, "tbps": tbps, "pct": percent(tbps, latest["roof"]),
            "choice": row.get("choice"), "choice_source": row.get("choice_source"),
        }
    batches = sorted({batch for _, batch in found})
    points = []
    for batch in batches:
        point_cells = {column: found.get((column, batch)) for column in CROSSOVER_COLUMNS}
        timed = {c: cell for c, cell in point_cells.items() if cell is not None and cell["us"] is not None}
        singles = {c: cell for c, cell in timed.items()
                   if c in PATH_COLUMNS and cell["variant"] not in CROSSOVER_BORROWED.get(weight_format, ())}
        best = min(singles, key=lambda c: singles[c]["us"]) if singles else None
        auto = timed.get("auto")
        auto_cell = point_cells["auto"]
        vs_best = auto["us"] / singles[best]["us"] - 1.0 if auto is not None and best is not None else None
        peer = timed.get("peer")
        vs_peer = auto["us"] / peer["us"] - 1.0 if auto is not None and peer is not None else None
        invariant = timed.get("invariant")
        invariant_cost = invariant["us"] / auto["us"] - 1.0 if auto is not None and invariant is not None else None
        own_auto = (_run_row(datasets[invariant["source"]], model, routing, auto_variant, batch)
                    if invariant is not None else None)
        points.append({
            "batch": batch, "cells": point_cells, "best": best,
            "best_us": singles[best]["us"] if best is not None else None,
            "choice": auto_cell.get("choice") if auto_cell is not None else None,
            "choice_source": auto_cell.get("choice_source") if auto_cell is not None else None,
            "auto_vs_best": vs_best, "flag": vs_best is not None and vs_best > AUTO_SLACK, "auto_vs_peer": vs_peer,
            "invariant_vs_auto": invariant_cost,
            "invariant_vs_own_auto": invariant["us"] / own_auto["median_us"] - 1.0 if own_auto is not None else None,
            "mixed_runs": len({cell["source"] for cell in timed.values()}) > 1,
        })
    fastest = {c: [p["batch"] for p in points if p["best"] == c] for c in paths}
    compared = [p for p in points if p["auto_vs_best"] is not None]
    record: dict[str, Any] = {
        "model": model, "routing": routing, "weight_format": weight_format, "paths": paths, "auto": auto_variant,
        "batches": batches, "points": points, "fastest": fastest,
        "auto_compared": len(compared), "auto_within": sum(not p["flag"] for p in compared),
        "sources": sorted({cell["source"] for cell in found.values()}),
    }
    record["summary"] = _crossover_summary(record)
    return record


def _run_row(data: dict[str, Any], model: str, routing: str, variant: str, batch: int) -> dict[str, Any] | None:
    """The timed row of ``variant`` at (``model``, ``routing``, ``batch``) in one run, if it has one."""
    return next((row for row in data.get("results", []) if row["variant"] == variant and row["model"] == model
                 and int(row["batch"]) == batch and row_routing(data, row) == routing and _timed(row)), None)


def _crossover_summary(record: dict[str, Any], invariant: bool = True) -> str:
    """The line under a crossover table: which path is fastest where, how auto stands against the best single path
    and the peer, and (``invariant``) what the batch-invariant policy costs over auto."""
    timed_batches = [p["batch"] for p in record["points"] if p["best"] is not None]
    if not timed_batches:
        parts = ["no timed single path of its own"]
    else:
        order = sorted((b, c) for c, b in ((c, bs[0]) for c, bs in record["fastest"].items() if bs))
        parts = [", ".join(f"{c} T={_t_ranges(record['fastest'][c], timed_batches)}" for _, c in order)]
    measured = {column for p in record["points"] for column, cell in p["cells"].items() if cell is not None}
    columns = [*record.get("paths", CROSSOVER_PATHS), "auto"]  # the peer and the invariant policy are optional
    missing = [c for c in columns if c not in measured]
    if missing:
        parts[0] += f" ({', '.join(missing)} not measured)"
    if record["auto_compared"]:
        text = (f"auto within {100 * AUTO_SLACK:.0f} % of the best at {record['auto_within']}/"
                f"{record['auto_compared']} points")
        slow = [p for p in record["points"] if p["flag"]]
        if slow:
            slower = ", ".join(f"T={p['batch']}: {_signed_percent(p['auto_vs_best'])}" for p in slow)
            text += f" (slower at {slower})"
        parts.append(text)
    elif "auto" not in missing:
        parts.append("auto not compared (no timed auto and single-path rows at a common T)")
    versus = [p for p in record["points"] if p.get("auto_vs_peer") is not None]
    if versus:
        behind = [p for p in versus if p["auto_vs_peer"] > 0]
        text = f"auto at least as fast as the Triton peer at {len(versus) - len(behind)}/{len(versus)} points"
        if behind:
            text += " (slower at " + ", ".join(f"T={p['batch']}: {_signed_percent(p['auto_vs_peer'])}"
                                               for p in behind) + ")"
        parts.append(text)
    costs = [p for p in record["points"] if p.get("invariant_vs_auto") is not None]
    if costs and invariant:
        parts.append("the batch-invariant policy costs " + ", ".join(
            f"T={p['batch']}: {_signed_percent(p['invariant_vs_auto'])}" for p in costs) + " over auto")
    return f"{record['model']}, {record['routing']} routing: " + "; ".join(parts)


def crossover_tables(datasets: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``crossover_table`` for every (model, routing) of ``crossover_keys``, bf16 first, then each other format's."""
    return [crossover_table(datasets, model, routing, fmt) for fmt in CROSSOVER_SETS
            for model, routing in crossover_keys(datasets, fmt)]


def crossover_cells(point: dict[str, Any]) -> dict[str, str]:
    """One crossover row as text (shared by rich and markdown): "µs (% roof)" per path, best, choice, vs best."""
    out = {"batch": str(point["batch"])}
    for column in CROSSOVER_COLUMNS:
        cell = point["cells"][column]
        if cell is None:
            out[column] = "-"
        elif cell["us"] is None:
            out[column] = str(cell["status"] or "?").upper()
        else:
            pct = "" if cell["pct"] is None else f" ({cell['pct']:.0f}%)"
            out[column] = f"{cell['us']:.2f}{pct}"
    out["best"] = point["best"] or "-"
    out["choice"] = _short(point["choice"]) or "-"
    if point["choice"] and point.get("choice_source"):
        out["choice"] += f" ({point['choice_source']})"
    vs = point["auto_vs_best"]
    out["vs_best"] = "-" if vs is None else _signed_percent(vs) + (" ⚠" if point["flag"] else "")
    if point["mixed_runs"] and vs is not None:
        out["vs_best"] += " †"
    vs_peer = point.get("auto_vs_peer")
    out["vs_peer"] = "-" if vs_peer is None else _signed_percent(vs_peer)
    cost = point.get("invariant_vs_auto")
    out["invariant_cost"] = "-" if cost is None else _signed_percent(cost)
    return out


CROSSOVER_TITLES = (("batch", "T"), ("strict", "strict µs (% roof)"), ("batched", "batched µs (% roof)"),
                    ("mixed", "mixed µs (% roof)"), ("MMA", "MMA µs (% roof)"), ("per-pair", "per-pair µs (% roof)"),
                    ("grouped", "grouped µs (% roof)"), ("expert-centric", "expert-centric µs (% roof)"),
                    ("auto", "auto µs (% roof)"), ("peer", "Triton peer µs (% roof)"),
                    ("best", "best single path"), ("choice", "auto's choice"), ("vs_best", "auto vs best"),
                    ("vs_peer", "auto vs peer"), ("invariant", "batch-invariant µs (% roof)"),
                    ("invariant_cost", "batch-invariant vs auto"))


def crossover_titles(record: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    """:data:`CROSSOVER_TITLES`, without the peer's two columns where no peer row was measured and without the
    paths the record's weight format has none of (FP8: no mixed path)."""
    has_peer = any(p["cells"].get("peer") is not None for p in record["points"])
    has_invariant = any(p["cells"].get("invariant") is not None for p in record["points"])
    absent = set(PATH_COLUMNS) - set(record.get("paths", CROSSOVER_PATHS))
    if not has_peer:
        absent |= {"peer", "vs_peer"}
    if not has_invariant:
        absent |= {"invariant", "invariant_cost"}
    return tuple(t for t in CROSSOVER_TITLES if t[0] not in absent)


def crossover_title(record: dict[str, Any]) -> str:
    fmt = record.get("weight_format", "bf16")
    return f"Crossover: {record['model']}, {record['routing']} routing" + ("" if fmt == "bf16" else f", {fmt} weights")


def link(name: str, base: str | Path | None = None) -> str:
    """A file ``name`` (as given on the command line) in markdown: a link relative to the folder ``base`` (the
    document's), else code."""
    if base is None:
        return f"`{name}`"
    target = Path(os.path.relpath(os.path.abspath(name), os.path.abspath(base))).as_posix()
    return f"[{name}]({target})"


def crossover_notes(record: dict[str, Any], names: list[str] | None = None, code: bool = True,
                    link_base: str | Path | None = None, hide: tuple[str, ...] = ()) -> list[str]:
    """Where the cells come from (file -> columns; ``names``: the files, else "run 1"...) and what the marks mean.
    ``link_base``: each file a markdown link relative to that folder; ``hide``: columns not shown (not listed)."""
    quote = "`" if code else ""
    if names and link_base is not None:
        label = lambda i: link(names[i], link_base)  # noqa: E731
    else:
        label = (lambda i: f"{quote}{names[i]}{quote}") if names else (lambda i: f"run {i + 1}")
    by_source: dict[int, list[str]] = {}
    for point in record["points"]:
        for column, cell in point["cells"].items():
            if cell is not None and column not in hide and column not in by_source.setdefault(cell["source"], []):
                by_source[cell["source"]].append(column)
    by_source = {source: columns for source, columns in by_source.items() if columns}
    notes = ["Cells: median µs per layer (% of the read roofline of the run that measured the cell); "
             + "; ".join(f"{label(i)}: {', '.join(cols)}" for i, cols in sorted(by_source.items())) + "."]
    marks = []
    if any(p["flag"] for p in record["points"]):
        marks.append(f"⚠ auto more than {100 * AUTO_SLACK:.0f} % slower than the best single path")
    if any(p["mixed_runs"] for p in record["points"]):
        marks.append("† this T's cells come from different runs")
    if marks:
        notes.append("; ".join(marks) + ".")
    return notes


# A narrow terminal's crossover table: (drop, short title) per column. It keeps T, auto and how far auto is from the
# best single path and from the peer longest; then the baselines (expert-centric, strict) and the tensor-core paths;
# the batch-invariant policy and auto's choice (the summary line names the fastest paths) go first.
CROSSOVER_FIT = {
    "batch": (0, None), "auto": (0, "auto"), "vs_best": (1, "vs best"), "best": (2, "best"), "peer": (3, "peer"),
    "vs_peer": (4, "vs peer"), "expert-centric": (5, "EC"), "strict": (6, "strict"), "MMA": (7, "MMA"),
    "grouped": (8, "grouped"), "per-pair": (9, "per-pair"), "batched": (10, "batched"), "mixed": (11, "mixed"),
    "invariant": (12, "invariant"), "invariant_cost": (13, "inv. cost"), "choice": (14, "choice"),
}


def crossover_rich(record: dict[str, Any], names: list[str] | None = None) -> Group:
    titles = crossover_titles(record)
    table = FitTable([Column(title, "left" if key in ("best", "choice") else "right", CROSSOVER_FIT[key][0],
                             short=CROSSOVER_FIT[key][1], wrap=key not in ("vs_best", "vs_peer", "invariant_cost"))
                      for key, title in titles], title=crossover_title(record))
    for point in record["points"]:
        c = crossover_cells(point)
        texts = [Text(c[key], style="bold" if key == point["best"] else "") for key, _ in titles]
        table.add_row(*texts, style="red" if point["flag"] else None)
    notes = [Text(note, style="dim") for note in crossover_notes(record, names, code=False)]
    return Group(table, *notes, Text(record["summary"], style="bold"))


# the README's compact headline: the baselines, auto and the peer, and how auto stands against the best and the peer
HEADLINE_COLUMNS = ("batch", "strict", "expert-centric", "auto", "peer", "best", "choice", "vs_best", "vs_peer")


INVARIANT_KEYS = ("invariant", "invariant_cost")  # the batch-invariant policy's two columns


def crossover_record_markdown(record: dict[str, Any], names: list[str] | None = None, level: str = "###",
                              columns: tuple[str, ...] | None = None, title: str | None = None,
                              link_base: str | Path | None = None, invariant: bool = True,
                              figure: str | None = None) -> str:
    """One crossover table in markdown: heading (``title``, default :func:`crossover_title`), the chart where
    ``figure`` (an image path) is given, the table, where its cells come from, and the summary line.
    ``columns``: only these of :data:`CROSSOVER_TITLES`; ``link_base``: the runs as links relative to that folder;
    ``invariant`` False: without the batch-invariant policy's columns, sources and cost (a table of their own:
    :func:`invariance_markdown`)."""
    titles = tuple(t for t in crossover_titles(record) if (columns is None or t[0] in columns)
                   and (invariant or t[0] not in INVARIANT_KEYS))
    heading = title or crossover_title(record)
    lines = [f"{level} {heading}", ""]
    if figure is not None:
        lines += [f"![{crossover_title(record)}: µs per layer and % of the roofline against T]({figure})", ""]
    lines += ["| " + " | ".join(text for _, text in titles) + " |",
              "|" + "|".join("---" if key in ("best", "choice") else "---:" for key, _ in titles) + "|"]
    for point in record["points"]:
        c = crossover_cells(point)
        if point["best"] is not None:
            c[point["best"]] = f"**{c[point['best']]}**"
        lines.append("| " + " | ".join(c[key].replace("|", "\\|") for key, _ in titles) + " |")
    notes = crossover_notes(record, names, link_base=link_base, hide=() if invariant else ("invariant",))
    summary = record["summary"] if invariant else _crossover_summary(record, invariant=False)
    lines += ["", *notes, "", summary]
    return "\n".join(lines) + "\n"


def crossover_markdown(datasets: list[dict[str, Any]], names: list[str] | None = None, level: str = "###",
                       columns: tuple[str, ...] | None = None, formats: tuple[str, ...] | None = None) -> str:
    """One markdown table per (model, routing) with a summary line; "" when no run has two of the paths.
    ``columns``: only these of :data:`CROSSOVER_TITLES` (the compact headline: :data:`HEADLINE_COLUMNS`);
    ``formats``: only the tables of these weight formats."""
    return "\n".join(crossover_record_markdown(record, names, level, columns)
                     for record in crossover_tables(datasets)
                     if formats is None or record.get("weight_format", "bf16") in formats)


# ------------------------------------------------------------------------------------------------
# Cells
# ------------------------------------------------------------------------------------------------
def _fmt(value: float | None, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def _gb(n: float | None) -> str:
    return "-" if n is None else f"{n / 1e9:.2f} GB"


def experts_text(counted: dict[str, Any]) -> str:
    """The experts a row's routing touched (``bytes.unique_experts``): a count, or the mean over several routing
    draws (a float) to one decimal; "-" where not recorded."""
    experts = counted.get("unique_experts")
    if experts is None:
        return "-"
    return f"{experts:.1f}" if isinstance(experts, float) else str(experts)


def cells(data: dict[str, Any], row: dict[str, Any], width: int = 16) -> dict[str, str]:
    """Every table cell of one result row as text (shared by rich and markdown)."""
    roof = (data.get("rooflines") or {}).get("read_tbps")
    timed = _timed(row)
    tb = row.get("tbps") if timed else None
    pct = percent(tb, roof)
    sp = speedup(data, row)
    err = row.get("error_vs_fp64") or {}
    check = row.get("check") or row.get("precheck") or {}
    if row.get("status") == "ok":
        check_text = f"ok {_fmt(check.get('max_ulp'), '.0f')} ulp"
        if row.get("timing_mode") == "eager":
            check_text += " (eager: graph capture failed)"
    else:
        check_text = str(row.get("status", "?")).upper()
    return {
        "variant": row["variant"],
        "batch": str(row["batch"]),
        "us": _fmt(row.get("median_us") if timed else None, ".2f"),
        "spread": (f"{row['min_us']:.2f}–{row['max_us']:.2f} (IQR {row['iqr_us']:.2f})" if timed else "-"),
        "tbps": _fmt(tb, ".2f"),
        "pct": _fmt(pct, ".0f") + ("%" if pct is not None else ""),
        "bar": bar(pct, width) if pct is not None else "",
        "speedup": ("" if sp is None else f"{sp:.2f}x"),
        "rel_l2": _fmt(err.get("rel_l2"), ".1e"),
        "max_abs": _fmt(err.get("max_abs"), ".1e"),
        "check": check_text,
        "experts": experts_text(row.get("bytes") or {}),
        "weights": _gb((row.get("bytes") or {}).get("weights")),
        "copies": f"{row.get('copies', '-')}/{(row.get('rotation') or {}).get('copies_needed', '-')}",
        "mode": row.get("timing_mode") or "",
    }


# (key, title, justify, drop): in a narrow terminal the columns with the highest drop are left out first
COLUMNS = (
    ("batch", "batch", "right", 0), ("variant", "variant", "left", 0), ("us", "µs/layer", "right", 0),
    ("spread", "min–max", "right", 6), ("tbps", "TB/s", "right", 0), ("pct", "% roof", "right", 0),
    ("bar", "", "left", 9), ("speedup", "vs base", "right", 1), ("rel_l2", "rel-L2 fp64", "right", 2),
    ("max_abs", "max-abs", "right", 7), ("check", "check", "left", 3), ("experts", "experts", "right", 5),
    ("weights", "weights", "right", 4), ("copies", "copies", "right", 8),
)


SHORT_TITLES = {"batch": "T", "us": "µs", "pct": "roof", "rel_l2": "rel-L2"}  # a narrow terminal's titles


def _model_rows(data: dict[str, Any], model: str) -> list[dict[str, Any]]:
    rows = [r for r in data.get("results", []) if r["model"] == model]
    order = {name: i for i, name in enumerate(dict.fromkeys(r["variant"] for r in rows))}
    return sorted(rows, key=lambda r: (r["batch"], order[r["variant"]]))


# ------------------------------------------------------------------------------------------------
# rich
# ------------------------------------------------------------------------------------------------
def header(data: dict[str, Any]) -> FitTable:
    env = data.get("environment") or {}
    gpu = env.get("gpu") or {}
    roof = data.get("rooflines") or {}
    table = FitTable([Column("", "left", style="bold"), Column("", "left")], title="warp-decode bench",
                     table_box=box.SIMPLE, show_header=False)
    if data.get("synthetic"):
        table.add_row("NOTE", Text(str(data.get("note", "synthetic data, not a measurement")), style="bold red"))
    if gpu:
        clocks = f"SM {_fmt(gpu.get('sm_clock_mhz'), '.0f')} MHz, memory {_fmt(gpu.get('memory_clock_mhz'), '.0f')} MHz"
        l2_mib, mem_gib = gpu.get("l2_bytes", 0) / 2**20, gpu.get("memory_bytes", 0) / 2**30
        table.add_row("GPU", f"{gpu.get('name')} (cc {gpu.get('compute_capability', '?')}), {gpu.get('sms')} SMs, "
                             f"L2 {l2_mib:.0f} MiB, {mem_gib:.0f} GiB")
        table.add_row("clocks", clocks)
        table.add_row("CUDA", f"driver {gpu.get('driver')}, runtime {gpu.get('cuda_runtime')}")
    else:
        table.add_row("GPU", "none (no timing taken)")
    table.add_row("versions", f"CuPy {env.get('cupy')} ({env.get('cupy_dist')}), Numba {env.get('numba')}, "
                              f"numba-cuda {env.get('numba_cuda')}, NumPy {env.get('numpy')}, "
                              f"Python {env.get('python')}")
    if cfg := data.get("config"):
        table.add_row("variants", ", ".join(cfg.get("variants") or []) or "none registered")
    for warning in data.get("load_warnings") or []:
        table.add_row("load error", Text(warning, style="red"))
    table.add_row("date", str(env.get("date", data.get("date", "?"))))
    cfg = data.get("config") or {}
    if cfg:
        table.add_row("run", f"routing {cfg.get('routing')}, seed {cfg.get('seed')}, repeats {cfg.get('repeats')}")
    if roof:
        ds = roof.get("datasheet_tbps")
        table.add_row("rooflines", f"streaming read {_fmt(roof.get('read_tbps'), '.2f')} TB/s, "
                                   f"D2D memcpy (graph, r+w) {_fmt(roof.get('d2d_memcpy_tbps'), '.2f')} TB/s, "
                                   f"copy16 kernel (r+w) {_fmt(roof.get('copy16_tbps'), '.2f')} TB/s, "
                                   f"datasheet {'unknown' if ds is None else f'{ds:.2f} TB/s'}")
    table.add_row("bytes", divisor_note(data))
    return table


def model_table(data: dict[str, Any], model: str) -> Group:
    """One model's rows (a section per batch, stage times under their row), then the failed rows' errors."""
    table = FitTable([Column(title, justify, drop, short=SHORT_TITLES.get(key))
                      for key, title, justify, drop in COLUMNS], title=model)
    errors = []
    previous = None
    for row in _model_rows(data, model):
        if previous is not None and row["batch"] != previous:
            table.add_section()
        previous = row["batch"]
        c = cells(data, row)
        style = None if row.get("status") == "ok" else "red"
        table.add_row(*[c[key] for key, _, _, _ in COLUMNS], style=style)
        if row.get("status") != "ok" and row.get("error"):
            errors.append(Text(f"{row['variant']} T={row['batch']}: {row['error']}"[:400], style="red"))
        for stage in row.get("stages") or []:
            text = (f"  └ {stage['name']}: {stage['median_us']:.2f} µs alone" if stage.get("samples_us")
                    else f"  └ {stage['name']}: {stage.get('error', 'not timed')}")
            if stage.get("in_chain_us") is not None:
                text += f", {stage['in_chain_us']:.2f} µs in the layer's chain"
            table.add_row("", Text(text, style="dim"), *[""] * (len(COLUMNS) - 2))
    return Group(table, *errors)


def cpu_section(data: dict[str, Any]) -> list[Any]:
    """The CPU-only run: simulator self-check, reference errors, expected bytes, compile report."""
    cpu = data.get("cpu")
    if not cpu:
        return []
    parts: list[Any] = [Text(f"NO TIMING TAKEN: {cpu.get('reason', 'no CUDA GPU')}", style="bold yellow")]
    sim = cpu.get("simulator") or {}
    table = FitTable([Column("case", "left"), Column("rel-L2 vs fp64"), Column("ulp vs warp_decode"),
                      Column("ok", "left")], title="Numba kernels on the CUDA simulator")
    for case in sim.get("cases") or []:
        table.add_row(str(case.get("case", case.get("name", "?"))), _fmt(case.get("rel_l2"), ".2e"),
                      str(case.get("ulp", case.get("max_ulp", "-"))), "ok" if case.get("ok") else "FAILED",
                      style=None if case.get("ok") else "red")
    if sim.get("cases"):
        parts.append(table)
    else:
        parts.append(Text(f"CUDA simulator: {sim.get('status', 'skipped')} -- {sim.get('message', '')}", style="dim"))
    if sim.get("status") in ("failed", "error") and sim.get("message"):
        parts.append(Text(f"simulator check {sim['status']}: {sim['message']}", style="red"))
    by_batch: dict[int, dict[str, Any]] = {}  # a row per batch, a column per mode: as narrow as the modes are few
    for case in cpu.get("reference") or []:
        by_batch.setdefault(case["batch"], {})[case["mode"]] = case.get("rel_l2")
    modes = list(dict.fromkeys(mode for values in by_batch.values() for mode in values))
    ref = FitTable([Column("T"), *(Column(mode) for mode in modes)],
                   title="reference vs the fp64 oracle (tiny; rel-L2)")
    for batch in sorted(by_batch):
        ref.add_row(str(batch), *(_fmt(by_batch[batch].get(mode), ".1e") for mode in modes))
    parts.append(ref)
    expected = FitTable([Column(col) for col in ("model", "batch", "experts", "weights", "act+inter+out",
                                                 "roofline µs @ datasheet")], title="bytes per layer (this routing)")
    for case in cpu.get("expected_bytes") or []:
        b = case["bytes"]
        expected.add_row(case["model"], str(case["batch"]), experts_text(b), _gb(b["weights"]),
                         f"{(b['activation'] + b['intermediate'] + b['output']) / 1e6:.2f} MB",
                         _fmt(case.get("us_at_4_8_tbps"), ".1f"))
    parts.append(expected)
    if cpu.get("compile"):
        from tools import compile_report as offline

        known = {f.name for f in dataclasses.fields(offline.Row)}
        rows = [offline.Row(**{k: v for k, v in row.items() if k in known}) for row in cpu["compile"]]
        title = ("offline compile report, every registered source (sm_90)" if cpu.get("compile_report") == "full"
                 else "offline compile report of the selected variants (sm_90, the knobs they run)")
        parts.append(offline.render(rows, title))
    elif cpu.get("inspect"):  # runs recorded before the report became rows
        parts.append(Text(cpu["inspect"]))
    parts.append(Text("NO TIMING TAKEN (no GPU): the figures above are correctness checks and byte counts only.",
                      style="bold yellow"))
    return parts


def renderables(data: dict[str, Any], crossovers: bool = True) -> Group:
    """The rich report of one run; ``crossovers``: append its crossover tables (``crossover_rich``)."""
    parts: list[Any] = [header(data)]
    for model in models(data):
        parts.append(model_table(data, model))
        parts.append(Text(crossover(data, model)["text"], style="bold"))
    if crossovers:
        parts.extend(crossover_rich(record) for record in crossover_tables([data]))
    parts.extend(cpu_section(data))
    return Group(*parts)


def render(data: dict[str, Any], console: Console | None = None, crossovers: bool = True) -> None:
    (console or Console()).print(renderables(data, crossovers))


# ------------------------------------------------------------------------------------------------
# markdown
# ------------------------------------------------------------------------------------------------
def markdown(data: dict[str, Any], crossovers: bool = True) -> str:
    """Markdown tables (one per model) with the run's header line; for PRs and the README.

    ``crossovers``: append the run's crossover tables (``crossover_markdown``; off when several runs are combined).
    """
    env = data.get("environment") or {}
    gpu = env.get("gpu") or {}
    roof = data.get("rooflines") or {}
    lines = []
    if data.get("synthetic"):
        lines.append(f"> **{data.get('note', 'synthetic data, not a measurement')}**\n")
    lines.append(
        f"GPU: {gpu.get('name', 'none')}, {env.get('date', '?')}, CuPy {env.get('cupy')}, Numba {env.get('numba')}; "
        f"streaming-read roofline {_fmt(roof.get('read_tbps'), '.2f')} TB/s "
        f"(D2D memcpy {_fmt(roof.get('d2d_memcpy_tbps'), '.2f')} TB/s r+w, datasheet "
        f"{_fmt(roof.get('datasheet_tbps'), '.2f', 'unknown')} TB/s). {divisor_note(data)}"
    )
    keys = ("batch", "variant", "us", "spread", "tbps", "pct", "bar", "speedup", "rel_l2", "max_abs", "check")
    titles = {key: title for key, title, _, _ in COLUMNS}
    titles["bar"] = "roofline"
    for model in models(data):
        lines.append(f"\n**{model}**\n")
        lines.append("| " + " | ".join(titles[k] for k in keys) + " |")
        lines.append("|" + "|".join("---:" if k not in ("variant", "bar", "check") else "---" for k in keys) + "|")
        for row in _model_rows(data, model):
            c = cells(data, row, width=10)
            c["bar"] = c["bar"].rstrip() or " "
            lines.append("| " + " | ".join(c[k].replace("|", "\\|") for k in keys) + " |")
        lines.append(f"\n{crossover(data, model)['text']}")
    if crossovers and (cross := crossover_markdown([data], level="####")):
        lines.append("\n" + cross.rstrip("\n"))
    if data.get("cpu"):
        lines.append("\nNo timing taken (no GPU).")
    return "\n".join(lines) + "\n"


def ratio_markdown(datas: list[dict[str, Any]], slow: str = "numba:warp-decode", fast: str = "cupy:warp-decode",
                   names: list[str] | None = None, link_base: str | Path | None = None) -> str:
    """Markdown table of median-time ratios ``slow / fast`` per (model, batch), both medians from the same run (a
    later run that measured both wins the point); "" if none. ``names``: the runs' files, named under the table
    (links relative to ``link_base`` where given)."""
    points: dict[tuple[str, int], tuple[float, int]] = {}
    for index, data in enumerate(datas):
        medians: dict[tuple[str, int], dict[str, float]] = {}
        for row in data.get("results", []):
            if row.get("status") == "ok" and row.get("median_us") and row["variant"] in (slow, fast):
                medians.setdefault((row["model"], int(row["batch"])), {})[row["variant"]] = row["median_us"]
        points.update({key: (m[slow] / m[fast], index) for key, m in medians.items() if slow in m and fast in m})
    if not points:
        return ""
    batches = sorted({b for _, b in points})
    lines = [f"Time of `{slow}` / time of `{fast}` (median µs per layer, same run):", "",
             "| model | " + " | ".join(f"T={b}" for b in batches) + " |", "|---|" + "---:|" * len(batches)]
    for model in dict.fromkeys(m for m, _ in sorted(points)):
        lines.append(f"| {model} | " + " | ".join(f"{points[(model, b)][0]:.2f}" if (model, b) in points else "-"
                                                 for b in batches) + " |")
    if names:
        sources = sorted({index for _, index in points.values()})
        lines += ["", "From " + ", ".join(link(names[i], link_base) for i in sources) + "."]
    return "\n".join(lines) + "\n"


FORMAT_NOTES = {  # a sentence under each weight format's heading in a generated report
    "bf16": "bf16 weights in rows, as checkpoints ship them; the expert-centric baseline and the Triton peer "
            "(`triton:fused-moe`, the serving engines' design) read the same weights.",
    "fp8-block128": "e4m3 weights with a float32 scale per 128 x 128 block, as FP8 checkpoints ship them; warp decode "
                    "keeps bf16 activations (W8A16), the expert-centric baseline and the Triton peer quantize them "
                    "to FP8 too (W8A8).",
    "fp8-block128-t16": "the same FP8 values in 16-row x 64-value tiles (1 KB per tensor-core k block) for the "
                        "tensor-core paths; the expert-centric and peer columns are the row layout's W8A8 ones, shown "
                        "beside them, never the best single path.",
    "bf16-t16": "bf16 in the same 1 KB tiles (16 x 32 values) for the tensor-core paths; the expert-centric and peer "
                "columns are the row layout's, shown beside them, never the best single path.",
}
CROSSOVER_LEGEND = (
    "Each table: median µs per layer at T decode tokens (% of the streaming-read roofline measured in the same run), "
    "the fastest single path in bold; auto = `kernels.moe_decode` (policy \"fastest\": its dispatch table's pick, "
    "`auto's choice`); auto vs best / vs peer = auto's time over theirs - 1; ⚠ auto more than "
    f"{100 * AUTO_SLACK:.0f} % slower than the best single path; † that T's cells come from different runs. "
    "The chart above each table draws the same cells against T.")
INVARIANCE_LEGEND = (
    "What `kernels.moe_decode(..., policy=\"batch_invariant\")` (a token's output bits the same in any batch; "
    "variants `cupy:auto-invariant`, `-fp8`, `-fp8-t16`, `-t16`) costs over the default policy \"fastest\" (auto) "
    "on the same weights: invariant µs / auto µs - 1 at each T, both timed in one run (one process); † where that "
    "run timed no auto there, against the crossover table's auto cell, from another run (so the spread between runs "
    "is in the figure too). Negative: the invariant policy measured faster.")


def invariance_markdown(records: list[dict[str, Any]], names: list[str] | None = None,
                        link_base: str | Path | None = None) -> str:
    """The batch-invariant policy's cost over auto, a row per crossover table (``records``) that measured it and a
    column per T, and the runs each format's cells come from; "" where no table has both."""
    rows = [r for r in records if any(p.get("invariant_vs_auto") is not None for p in r["points"])]
    if not rows:
        return ""
    batches = sorted({p["batch"] for r in rows for p in r["points"] if p.get("invariant_vs_auto") is not None})
    lines = [INVARIANCE_LEGEND, "", "| weights | model | routing | " + " | ".join(f"T={b}" for b in batches) + " |",
             "|---|---|---|" + "---:|" * len(batches)]
    sources: dict[str, dict[int, list[str]]] = {}  # format -> run -> the columns it gave
    for record in rows:
        by_batch = {p["batch"]: p for p in record["points"]}
        texts = []
        for batch in batches:
            point = by_batch.get(batch)
            if point is None or point.get("invariant_vs_auto") is None:
                texts.append("-")
                continue
            invariant, auto = point["cells"]["invariant"], point["cells"]["auto"]
            own = point.get("invariant_vs_own_auto")
            texts.append(_signed_percent(point["invariant_vs_auto"]) + " †" if own is None else _signed_percent(own))
            runs = sources.setdefault(record["weight_format"], {})
            used = (("invariant", invariant["source"]), ("auto", invariant["source"] if own is not None
                                                         else auto["source"]))
            for column, source in used:
                if column not in runs.setdefault(source, []):
                    runs[source].append(column)
        lines.append(f"| {record['weight_format']} | {record['model']} | {record['routing']} | "
                     + " | ".join(texts) + " |")
    label = (lambda i: link(names[i], link_base)) if names else (lambda i: f"run {i + 1}")
    lines.append("")
    lines += [f"{fmt}: " + "; ".join(f"{label(i)}: {', '.join(columns)}" for i, columns in sorted(runs.items())) + "."
              for fmt, runs in sources.items()]
    return "\n".join(lines) + "\n"


def full_tables_line(names: list[str]) -> str:
    """How to print any one run's full tables (a generated report holds the crossover tables, not every row)."""
    example = Path(names[0]).parent / "<run>.json" if names else Path("<run>.json")
    return (f"Any run's full tables (every variant and T, its spread, check and error against fp64): "
            f"`python -m tools.report {example.as_posix()} --markdown` (without `--markdown`: the rich report); "
            "the JSON is the record.")


def report_markdown(datasets: list[dict[str, Any]], names: list[str], document: str | Path | None = None,
                    plot_dir: str | Path | None = None) -> str:
    """The block ``--update-readme`` writes: per weight format, model and routing the crossover table and its chart
    (``plot_dir``/MODEL-ROUTING-FORMAT-crossover.png, linked relative to the ``document``'s folder; default
    ``plots/`` beside it), the batch-invariant policy's cost, Numba against CuPy, and how to print any one run in
    full. Every run is a link to its JSON, relative to the document."""
    base = Path(document).parent if document is not None else None
    plots = Path(plot_dir) if plot_dir is not None else (base or Path(".")) / "plots"
    records = crossover_tables(datasets)
    order = {model: index for index, model in enumerate(dict.fromkeys(r["model"] for r in records))}
    records.sort(key=lambda r: (list(CROSSOVER_SETS).index(r["weight_format"]), order[r["model"]]))  # stable
    lines = [full_tables_line(names), ""]
    if records:
        lines += ["## Crossover: which path is fastest at each T", "", CROSSOVER_LEGEND, ""]
    else:
        lines += ["These runs have no crossover table (each needs two of the paths of one weight format).", ""]
    seen_formats = set()
    for record in records:
        fmt = record["weight_format"]
        if fmt not in seen_formats:
            seen_formats.add(fmt)
            lines += [f"### {fmt} weights", ""] + ([FORMAT_NOTES[fmt], ""] if fmt in FORMAT_NOTES else [])
        figure = None
        if figure_drawn(record):
            target = plots / f"{crossover_figure_stem(record['model'], record['routing'], fmt)}.png"
            figure = Path(os.path.relpath(os.path.abspath(target), os.path.abspath(base or "."))).as_posix()
        lines.append(crossover_record_markdown(record, names, level="####",
                                               title=f"{record['model']}, {record['routing']} routing",
                                               link_base=base or Path("."), invariant=False, figure=figure))
    invariance = invariance_markdown(records, names, base or Path("."))
    if invariance:
        lines += ["## Batch-invariance cost", "", invariance]
    ratios = ratio_markdown(datasets, names=names, link_base=base or Path("."))
    if ratios:
        lines += ["## Numba vs CuPy, strict warp decode", "", ratios]
    return "\n".join(lines)


def figure_drawn(record: dict[str, Any]) -> bool:
    """Whether a crossover table has a chart (``tools.plot.crossover_figure``): a timed cell in a column it draws."""
    return any(cell is not None and cell["us"] is not None for point in record["points"]
               for column, cell in point["cells"].items() if column != "invariant")


def figure_keys(datasets: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    """(model, routing, weight format) of every crossover table with a chart: the figures a report links."""
    return [(r["model"], r["routing"], r["weight_format"]) for r in crossover_tables(datasets) if figure_drawn(r)]


def replace_between_markers(text: str, block: str, begin: str = BEGIN, end: str = END) -> str:
    """``text`` with everything between the markers (default: the bench's) replaced by ``block``."""
    start, stop = text.find(begin), text.find(end)
    if start < 0 or stop < 0 or stop < start:
        raise ValueError(f"README markers {begin} ... {end} not found (in that order)")
    return text[: start + len(begin)] + "\n" + block.strip("\n") + "\n" + text[stop:]


def update_readme(path: str | Path, block: str, begin: str = BEGIN, end: str = END) -> None:
    path = Path(path)
    path.write_text(replace_between_markers(path.read_text(), block, begin, end))


def named_runs(text: str, option: str, document: str | Path) -> list[str]:
    """The JSON files, in order, of the ``python -m tools.report JSON... OPTION .../DOCUMENT`` command that a
    generated document's ``text`` names as its own (OPTION ``--update-readme`` or ``--headline``; the command may
    wrap over lines). ValueError where the text names no such command."""
    name = re.escape(Path(document).name)
    found = re.search(rf"python -m tools\.report ((?:\S+\.json\s+)+){re.escape(option)} (?:\S*/)?{name}\b", text)
    if not found:
        raise ValueError(f"{document} names no `python -m tools.report JSON... {option} {Path(document).name}` "
                         f"command to regenerate it from; give the JSON files")
    return found.group(1).split()


def _not_a_bench_result(data: Any) -> str | None:
    """What a loaded JSON is when it is not a ``tools.bench`` result (the CLI refuses it), else None."""
    if not isinstance(data, dict):
        return f"a JSON {type(data).__name__}"
    schema = data.get("schema")
    if schema is not None and not str(schema).startswith("warp-decode-bench/"):
        return f"a {schema!r} record"
    if "results" not in data:
        return "a JSON object without 'results'"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.report", description=__doc__.split("\n")[0],
                                     usage="%(prog)s [-h] [--markdown] [--update-readme FILE] [--headline FILE] "
                                           "[--plot DIR [--plot-format {png,svg}]] JSON [JSON ...]\n"
                                           "       %(prog)s (--update-readme FILE [--plot DIR] | --headline FILE)",
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=examples(
                                         "python -m tools.report results/h200-2026-12-02-candidates-uniform.json",
                                         "python -m tools.report results/h200-2026-12-02-candidates-uniform.json "
                                         "results/h200-2026-12-02-candidates-zipf.json --markdown",
                                         "python -m tools.report results/h200-2026-12-02-candidates-uniform.json "
                                         "--plot results/plots",
                                         "python -m tools.report --update-readme results/REPORT.md --plot "
                                         "results/plots   # again from the runs its own command names"))
    # "*" here, at least one below: so an unknown option is reported before a missing JSON
    parser.add_argument("json", nargs="*", metavar="JSON",
                        help="result files written by python -m tools.bench --json (in order; default with one of "
                             "--update-readme / --headline alone: the runs that document's command names)")
    parser.add_argument("--markdown", action="store_true",
                        help="print markdown tables instead of the rich report (default: the rich report)")
    parser.add_argument("--update-readme", metavar="FILE",
                        help="replace the bench block of this file with the report: the crossover tables and their "
                             "charts' links, the batch-invariance cost, Numba vs CuPy, each linked to its runs "
                             "(default: no file changed)")
    parser.add_argument("--headline", metavar="FILE", help="replace the headline block of this file with the "
                                                           "crossover tables (default: no file changed)")
    parser.add_argument("--plot", metavar="DIR", help="draw the runs as figures under DIR (results/plots/ by "
                                                      "convention) and print their paths; with --update-readme, the "
                                                      "charts that document links; needs matplotlib "
                                                      "(default: no figures)")
    parser.add_argument("--plot-format", choices=PLOT_FORMATS, help="png (default) or svg: SVG beside each PNG")
    args = parser.parse_args(argv)
    if args.plot_format and not args.plot:
        parser.error("--plot-format: give --plot DIR too")
    if args.plot and not args.json and not args.update_readme:
        parser.error("--plot: give the JSON files to draw (python -m tools.report RUN.json ... --plot DIR)")
    if not args.json and bool(args.update_readme) != bool(args.headline):  # one document: the runs it names
        option, document = ("--update-readme", args.update_readme) if args.update_readme else ("--headline",
                                                                                                 args.headline)
        try:
            args.json = named_runs(Path(document).read_text(), option, document)
        except (OSError, ValueError) as exc:
            parser.error(f"{option}: {' '.join(str(exc).split())}")
    if not args.json:
        parser.error("the following arguments are required: JSON (one or more tools.bench result files)")
    datas = []
    for path in args.json:
        try:
            data = load(path)
        except (OSError, ValueError) as exc:  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
            parser.error(f"cannot read {path}: {' '.join(str(exc).split())}")
        problem = _not_a_bench_result(data)
        if problem:
            parser.error(f"{path} is {problem}, not a tools.bench result (python -m tools.bench --json)")
        datas.append(data)
    if args.plot:
        try:
            from tools import plot
        except ImportError as exc:
            print(f"{parser.prog}: error: --plot needs matplotlib>=3.7 (pip install 'matplotlib>=3.7'): {exc}",
                  file=sys.stderr)
            return 2
        if args.update_readme:  # the document's figures: a chart per crossover table, the ones it links
            written = plot.write_crossover(datas, args.plot, figure_keys(datas), args.plot_format or "png")
        else:
            written = plot.write(datas, args.plot, args.plot_format or "png")
        if not written:
            print(f"{parser.prog}: nothing to draw: no timed rows in {', '.join(args.json)}", file=sys.stderr)
            return 1
        print("\n".join(str(path) for path in written))
    if args.headline:
        compact = crossover_markdown(datas, names=args.json, level="####", columns=HEADLINE_COLUMNS,
                                     formats=("bf16",))
        if not compact:
            parser.error("--headline: these runs have no bf16 crossover table (each needs two of the paths)")
        try:
            update_readme(args.headline, compact, *HEADLINE)
        except (OSError, ValueError) as exc:
            parser.error(f"--headline: {exc}")
        print(f"updated the headline of {args.headline} from {', '.join(args.json)}")
    if args.update_readme:
        # the answers (which path where, what invariance costs), each linked to its runs; a run in full on demand
        block = report_markdown(datas, args.json, args.update_readme, args.plot)
        try:
            update_readme(args.update_readme, block)
        except (OSError, ValueError) as exc:
            parser.error(str(exc))
        print(f"updated {args.update_readme} from {', '.join(args.json)}")
    elif args.headline or (args.plot and not args.markdown):
        pass
    elif args.markdown:
        crossovers = crossover_markdown(datas, names=args.json)
        sys.stdout.write("\n".join([*(markdown(data, crossovers=False) for data in datas), crossovers]))
    else:
        console = output_console()
        for data in datas:
            render(data, console, crossovers=False)
        for record in crossover_tables(datas):
            console.print(crossover_rich(record, names=args.json))
    return 0


if __name__ == "__main__":
    sys.exit(main())
