"""What a set of bench runs measured, merged: which variant is which column of a crossover table (per weight format),
and the one merge of several runs, a later file winning a cell. Shared by the tables (``tools.report``) and the
figures (``tools.plot``), so neither imports the other's module for it."""

from __future__ import annotations

import re
from typing import Any

PLOT_FORMATS = ("png", "svg")  # --plot-format: PNG always, SVG beside it on request (tools.plot.FORMATS)

CROSSOVER_PATHS = {"strict": "cupy:warp-decode", "batched": "cupy:warp-decode-batched",
                   "mixed": "cupy:warp-decode-mixed", "MMA": "cupy:warp-decode-mma",
                   "per-pair": "cupy:warp-decode-mma-pairs", "grouped": "cupy:warp-decode-mma-grouped",
                   "expert-centric": "cupy:expert-centric"}
CROSSOVER_AUTO = "cupy:auto"
# the serving engines' design, re-implemented in Triton (tools/peers): shown beside the lab's paths when measured
CROSSOVER_PEER = "triton:fused-moe"
CROSSOVER_INVARIANT = "cupy:auto-invariant"  # kernels.moe_decode(policy="batch_invariant"), beside auto when measured
# every single-path column any format's table may have, in table order (a format shows those it has paths for)
PATH_COLUMNS = ("strict", "batched", "mixed", "MMA", "per-pair", "grouped", "expert-centric")
CROSSOVER_COLUMNS = (*PATH_COLUMNS, "auto", "peer", "invariant")
_CROSSOVER_VARIANTS = {**{v: k for k, v in CROSSOVER_PATHS.items()}, CROSSOVER_AUTO: "auto", CROSSOVER_PEER: "peer",
                       CROSSOVER_INVARIANT: "invariant"}
# the same table for fp8-block128 weights: the FP8 paths, the W8A8 expert-centric baseline and the W8A8 peer
# (and the per-pair and grouped tensor-core forms, candidates of every policy)
CROSSOVER_FP8_PATHS = {"strict": "cupy:warp-decode-fp8", "batched": "cupy:warp-decode-batched-fp8",
                       "MMA": "cupy:warp-decode-mma-fp8", "per-pair": "cupy:warp-decode-mma-pairs-fp8",
                       "grouped": "cupy:warp-decode-mma-grouped-fp8", "expert-centric": "cupy:expert-centric-w8a8"}
CROSSOVER_SETS: dict[str, dict[str, str]] = {  # weight format -> variant -> column
    "bf16": _CROSSOVER_VARIANTS,
    "fp8-block128": {**{v: k for k, v in CROSSOVER_FP8_PATHS.items()}, "cupy:auto-fp8": "auto",
                     "triton:fused-moe-w8a8": "peer", "cupy:auto-invariant-fp8": "invariant"},
    # fp8-block128-t16: the tensor-core FP8 paths on tiles, their auto, beside the same W8A8 baseline and peer
    "fp8-block128-t16": {"cupy:warp-decode-mma-fp8-t16": "MMA", "cupy:warp-decode-mma-pairs-fp8-t16": "per-pair",
                         "cupy:warp-decode-mma-grouped-fp8-t16": "grouped",
                         "cupy:expert-centric-w8a8": "expert-centric", "cupy:auto-fp8-t16": "auto",
                         "triton:fused-moe-w8a8": "peer", "cupy:auto-invariant-fp8-t16": "invariant"},
    # bf16-t16: the tensor-core bf16 paths on tiles, their auto, beside the same bf16 baseline and peer
    "bf16-t16": {"cupy:warp-decode-mma-t16": "MMA", "cupy:warp-decode-mma-pairs-t16": "per-pair",
                 "cupy:warp-decode-mma-grouped-t16": "grouped", CROSSOVER_PATHS["expert-centric"]: "expert-centric",
                 "cupy:auto-t16": "auto", CROSSOVER_PEER: "peer", "cupy:auto-invariant-t16": "invariant"},
}
# the columns a tiled format's table borrows from its row layout (its baseline and peer read rows): shown beside its
# paths, never its "best single path" (a point where no path of its own was measured has no best)
CROSSOVER_BORROWED: dict[str, set[str]] = {
    "fp8-block128-t16": {"cupy:expert-centric-w8a8", "triton:fused-moe-w8a8"},
    "bf16-t16": {CROSSOVER_PATHS["expert-centric"], CROSSOVER_PEER},
}


def row_routing(data: dict[str, Any], row: dict[str, Any]) -> str:
    """The routing a row was measured with: the row's own key, else the run's config, else "unknown"."""
    return str(row.get("routing") or (data.get("config") or {}).get("routing") or "unknown")


def latest_rows(datasets: list[dict[str, Any]]) -> dict[tuple[str, str, str, int], dict[str, Any]]:
    """Every (model, routing, variant, batch) that ``datasets`` (bench records, in order) measured, the LATER run
    winning whatever its status (a later failure hides an older timing: the kernel changed): its ``row``, the index
    of its run (``source``) and that run's streaming-read roofline (``roof``, TB/s; None where not measured).

    The one merge of several runs: the crossover tables and the plots (``tools.plot``) read their cells from it."""
    found: dict[tuple[str, str, str, int], dict[str, Any]] = {}
    for index, data in enumerate(datasets):
        roof = (data.get("rooflines") or {}).get("read_tbps")
        for row in data.get("results", []):
            key = (row["model"], row_routing(data, row), row["variant"], int(row["batch"]))
            found[key] = {"row": row, "source": index, "roof": roof}
    return found


def figure_stem(*parts: str) -> str:
    """``qwen3-30b-a3b``, ``uniform``, ``bf16`` -> ``qwen3-30b-a3b-uniform-bf16``: a figure's file name without its
    suffix (anything but [A-Za-z0-9._-] to _). Here, not in ``tools.plot``, so that a document can link a figure
    without importing matplotlib."""
    return "-".join(re.sub(r"[^A-Za-z0-9._-]+", "_", part) for part in parts)


def crossover_figure_stem(model: str, routing: str, weight_format: str) -> str:
    """The file name (no suffix) of the chart of one crossover table (``tools.plot.crossover_figure``)."""
    return figure_stem(model, routing, weight_format, "crossover")
