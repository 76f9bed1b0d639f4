"""``python -m tools.dispatch_table``: measure which warp-decode path wins per (shape, T) on this GPU.

    python -m tools.dispatch_table --json kernels/dispatch_tables/nvidia-h200.json
    python -m tools.dispatch_table --json kernels/dispatch_tables/nvidia-h200.json --model qwen3-30b-a3b --batch 1,8
    python -m tools.dispatch_table --json ... --also cupy:expert-centric      # record other paths too (never chosen)
    python -m tools.dispatch_table --json kernels/dispatch_tables/nvidia-h200.json --from-bench results/x.json

``--from-bench`` builds the table from a bench run's JSON instead of timing again (no GPU needed): every
(model, batch) where the bench measured the candidates (uniform routing) becomes a point, with the bench's
medians, statuses and environment -- the same measurements the README's tables come from.

For every preset (``--model``, default all but ``tiny``) and T in 1, 2, 4, ..., 64 (``--batch``), each
candidate (``kernels.dispatch.CANDIDATES``) is timed with ``tools.harness.Workbench.measure`` -- CUDA-graph
replays, weights rotated past 3x L2, uniform routing, output checked against the reference before and
after timing -- and the fastest correct one is recorded as the point's ``choice``. An existing file for the
same GPU is updated in place (entries of other shapes / points kept), so a long sweep can be split into
several commands (``--model`` one at a time). The file records the GPU's name, the date and the environment.
``kernels.dispatch`` reads it at run time (``kernels/dispatch_tables/<gpu slug>.json``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kernels import dispatch
from kernels.contract import Dims
from kernels.shapes import PRESETS, get_shape
from kernels.variants import get_variant

DEFAULT_MODELS = tuple(name for name in PRESETS if name != "tiny")
DEFAULT_REPEATS = 15


def winner(records: dict[str, dict[str, Any]]) -> str | None:
    """The candidate with the lowest median among those measured correctly (status "ok"), or None."""
    ok = {name: r["median_us"] for name, r in records.items()
          if name in dispatch.CANDIDATES and r.get("status") == "ok" and r.get("median_us") is not None}
    if not ok:
        return None
    return min(sorted(ok), key=lambda name: ok[name])  # ties -> the alphabetically first name (stable)


def point_record(records: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """One table point from the measurements of a (shape, T): choice, medians, status of every path."""
    choice = winner(records)
    if choice is None:
        return None
    best = records[choice]["median_us"]
    return {
        "choice": choice,
        "median_us": {name: r.get("median_us") for name, r in records.items()},
        "status": {name: r.get("status") for name, r in records.items()},
        "tbps": {name: r.get("tbps") for name, r in records.items()},
        "unique_experts": next(iter(records.values())).get("bytes", {}).get("unique_experts"),
        "slowdown_of_others": {name: (r["median_us"] / best if r.get("median_us") else None)
                               for name, r in records.items() if name != choice},
    }


def merge(table: dict[str, Any] | None, gpu: str, env: dict[str, Any], model: str, dims: Dims,
          tokens: int, point: dict[str, Any]) -> dict[str, Any]:
    """``table`` (or a new one) with ``point`` written at (shape of ``dims``, ``tokens``)."""
    if table is None or table.get("gpu") != gpu:
        table = {"schema": dispatch.SCHEMA, "gpu": gpu, "slug": dispatch.gpu_slug(gpu),
                 "candidates": list(dispatch.CANDIDATES), "entries": {}}
    table["date"] = env.get("date")
    table["environment"] = env
    key = dispatch.shape_key(dims)
    entry = table["entries"].setdefault(key, {"model": model, "hidden": dims.hidden, "intermediate": dims.intermediate,
                                              "experts": dims.experts, "top_k": dims.top_k, "points": {}})
    entry["points"][str(tokens)] = point
    entry["points"] = {str(t): entry["points"][str(t)] for t in sorted(int(t) for t in entry["points"])}
    return table


def from_bench(bench: dict[str, Any], table: dict[str, Any] | None = None) -> dict[str, Any]:
    """A dispatch table (or ``table`` updated) from a ``tools.bench`` JSON: one point per (model, batch)."""
    env = bench["environment"]
    gpu = env["gpu"]["name"]
    if bench.get("config", {}).get("routing", "uniform") != "uniform":
        raise ValueError("a dispatch table is measured with uniform routing; this bench run used another")
    grouped: dict[tuple[str, int], dict[str, dict[str, Any]]] = {}
    for row in bench["results"]:
        grouped.setdefault((row["model"], int(row["batch"])), {})[row["variant"]] = row
    for (model, tokens), records in sorted(grouped.items()):
        if not all(name in records for name in dispatch.CANDIDATES):
            continue
        point = point_record(records)
        if point is None:
            continue
        shape = get_shape(model)
        dims = Dims(tokens, shape.hidden, shape.intermediate, shape.experts, shape.top_k)
        table = merge(table, gpu, env, model, dims, tokens, point)
    if table is None:
        raise ValueError(f"the bench run measured no point with every candidate {dispatch.CANDIDATES}")
    return dispatch.validate_table(table)


def _parse_batches(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"--batch needs positive ints, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.dispatch_table", description=__doc__.split("\n")[0])
    parser.add_argument("--json", required=True,
                        help="table file to write / update (kernels/dispatch_tables/<slug>.json)")
    parser.add_argument("--model", default=",".join(DEFAULT_MODELS), help="comma-separated presets")
    parser.add_argument("--batch", type=_parse_batches, default=list(dispatch.TABLE_POINTS))
    parser.add_argument("--repeats", type=int, default=DEFAULT_REPEATS)
    parser.add_argument("--also", default="", help="comma-separated variants to time and record, never chosen")
    parser.add_argument("--from-bench", metavar="BENCH_JSON", help="build the table from a bench run's JSON")
    args = parser.parse_args(argv)

    if args.from_bench:
        path = Path(args.json)
        bench_run = json.loads(Path(args.from_bench).read_text())
        table = from_bench(bench_run, json.loads(path.read_text()) if path.is_file() else None)
        if path.stem != table["slug"]:
            print(f"warning: {path.name} does not match the bench GPU's slug {table['slug']!r}", file=sys.stderr)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(table, indent=1) + "\n")
        for entry in table["entries"].values():
            print(entry["model"], {t: p["choice"] for t, p in entry["points"].items()})
        return 0

    from tools import harness

    ok, why = harness.gpu_available()
    if not ok:
        print(f"no GPU ({why}): a dispatch table can only be measured on the GPU it describes", file=sys.stderr)
        return 2
    env = harness.environment(True)
    gpu = env["gpu"]["name"]
    path = Path(args.json)
    if path.stem != dispatch.gpu_slug(gpu):
        print(f"warning: {path.name} does not match this GPU's slug {dispatch.gpu_slug(gpu)!r}; "
              "kernels.dispatch will not find it", file=sys.stderr)
    table = json.loads(path.read_text()) if path.is_file() else None
    names = list(dispatch.CANDIDATES) + [n for n in args.also.split(",") if n]
    variants = {name: get_variant(name) for name in names}
    for model in [m for m in args.model.split(",") if m]:
        shape = get_shape(model)
        for tokens in args.batch:
            dims = Dims(tokens, shape.hidden, shape.intermediate, shape.experts, shape.top_k)
            bench = harness.Workbench(shape, tokens, routing="uniform", seed=0)
            try:
                records = {}
                for name, variant in variants.items():
                    if name == dispatch.BATCHED and not dispatch.batched_supported(dims):
                        records[name] = {"status": "unsupported", "median_us": None}
                        continue
                    records[name] = bench.measure(variant, repeats=args.repeats, stages=False)
            finally:
                bench.free()
            point = point_record(records)
            line = "  ".join(f"{n}: {r.get('median_us') or float('nan'):9.1f} us ({r.get('status')})"
                             for n, r in records.items())
            print(f"{model:24s} T={tokens:3d}  -> {point['choice'] if point else 'NO CORRECT PATH'}   {line}",
                  flush=True)
            if point is None:
                continue
            table = merge(table, gpu, env, model, dims, tokens, point)
            dispatch.validate_table(table)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(table, indent=1) + "\n")  # after every point: a killed run keeps its work
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
