"""``python -m tools.sweep VARIANT``: compile, check and time every point of a variant's parameter grid.

    python -m tools.sweep cupy:warp-decode --model qwen3-30b-a3b --batch 1,8,64
    python -m tools.sweep cupy:warp-decode --grid DN_SLOTS=2,4 --grid DN_UNROLL=1,3 --json results/sweep.json
    python -m tools.sweep cupy:warp-decode-mma-fp8 --model qwen3-235b-a22b --batch 8,16 --grid GB_KSPLIT=1,4 --rounds 2
    python -m tools.sweep --list          # every registered variant, one line each

VARIANT is any registered name (builtin or prototype; ``--list`` prints them). The grid is the variant's ``grid``
unless ``--grid`` is given (then only the ``--grid`` keys are swept; the rest keep the variant's params); a ``--grid``
key the variant does not know (see ``known_knobs``) is an error, so a typo never sweeps the defaults, and so is a
value outside the knob's limits (``grid_error``), before anything is compiled. Each point is
checked against the reference before it is timed (a wrong point is reported, never timed) and timed with
the bench's harness. The ranked table puts the offline compile report (registers, spill / stack bytes, theoretical
occupancy, via NVRTC -- when the variant's source is a ``kernels.compile.CudaSource``) beside µs, TB/s
and % of roofline; the knobs are resolved for each batch (auto knobs can compile other code at another T), the
columns show the worst batch and a line under the table names the batches whose spills differ. Without a GPU it
prints the grid with its compile columns and says no timing was taken.

A GPU drifts within a process (clocks, heat): on the H200 a point timed again minutes later has come back 0.5-4 %
slower, as much as many knobs' effects. ``--rounds N`` runs the whole grid N times in turn, so each knob set is timed
early and late; every row keeps its run order (the table's ``run`` column), and a line under the table gives the
largest spread between runs of the same knob set -- a difference between knob sets smaller than that is noise. A
value repeated in ``--grid`` (``KEY=0,1,0,1``) does the same for one key.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
from typing import Any

from kernels.contract import Dims
from kernels.shapes import DEFAULT_MODEL, PRESETS, get_shape
from tools import bench, harness
from tools.cli import examples, int_list, positive_int
from tools.registry import describe
from tools.registry import load as load_registry
from tools.roofline import bar, percent

DEFAULT_BATCHES = (1, 8, 64)


def parse_value(text: str) -> Any:
    """``--grid`` values: ints, floats, true/false, else the string."""
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text.strip()


def parse_grid(items: list[str] | None) -> dict[str, list[Any]]:
    grid: dict[str, list[Any]] = {}
    for item in items or []:
        key, sep, values = item.partition("=")
        if not sep or not key.strip() or not values.strip():
            raise ValueError(f"--grid takes KEY=v1,v2,..., got {item!r}")
        items = values.split(",")
        if not all(v.strip() for v in items):
            raise ValueError(f"--grid {key.strip()}: an empty value in {values!r} (KEY=v1,v2,...)")
        grid[key.strip()] = [parse_value(v) for v in items]
    return grid


def points(grid: dict[str, list[Any]]) -> list[dict[str, Any]]:
    """Every combination of the grid (one empty point for an empty grid)."""
    keys = list(grid)
    return [dict(zip(keys, combo, strict=True)) for combo in itertools.product(*(grid[k] for k in keys))]


def _key(params: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    """A knob set as a hashable key (the same knobs and values, in any order)."""
    return tuple(sorted((k, repr(v)) for k, v in params.items()))


def repeat_spread(entries: list[dict[str, Any]], batches: list[int]) -> dict[str, Any] | None:
    """The largest spread (max / min - 1, in %) between the timed runs of one knob set at one batch, over the knob
    sets run more than once, with where it was; None when no knob set has two timed runs at a batch."""
    runs: dict[tuple[tuple[str, str], ...], list[dict[str, Any]]] = {}
    for entry in entries:
        runs.setdefault(_key(entry["params"]), []).append(entry)
    worst: dict[str, Any] | None = None
    for same in runs.values():
        for tokens in batches:
            times = [r["median_us"] for e in same if (r := e["results"].get(str(tokens))) and r.get("status") == "ok"]
            if len(times) < 2:
                continue
            pct = (max(times) / min(times) - 1.0) * 100.0
            if worst is None or pct > worst["pct"]:
                worst = {"pct": pct, "batch": tokens, "params": dict(same[0]["params"]), "runs": len(times)}
    return worst


def known_knobs(variant: Any) -> set[str]:
    """The knob names ``--grid`` may set for ``variant``: its ``params`` and ``grid`` keys, its kernel family's
    knobs and the keyword parameters ``build`` names (after ``dims``)."""
    import inspect

    known = set(variant.params) | set(variant.grid)
    if variant.kernel_family is not None:
        known |= set(variant.kernel_family.defaults)
    try:
        parameters = list(inspect.signature(variant.build).parameters.values())[1:]
    except (TypeError, ValueError):  # a builtin or an odd callable: no signature to read
        parameters = []
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    known |= {p.name for p in parameters if p.kind in keyword}
    return known


def grid_error(variant: Any, grid: dict[str, list[Any]]) -> str | None:
    """The first ``--grid`` value the variant's kernel family cannot take, as one line naming the knob, the value and
    what the family allows (its ``limits``); None when every value is fine. Checked before anything is compiled or
    timed, so a typo is refused at once, GPU or not. Knobs outside the family (a ``build`` keyword) and variants
    without a family are left to ``build``. Combinations the family's rules refuse at some dims stay points (their
    compile column says why)."""
    family = getattr(variant, "kernel_family", None)
    if family is None:
        return None
    defaults = family.defaults
    for key, values in grid.items():
        if key not in defaults:
            continue
        low, high = family.limits.get(key, (None, None))
        allowed = (f"an int in {low}..{high}" if low is not None else "an int") + \
            (" (0 = auto)" if key in family.auto_knobs else "")
        for value in values:
            if isinstance(value, bool) or not isinstance(value, int):
                return f"--grid {key}: {value!r} is not an int; {variant.name} takes {key} as {allowed}"
            if low is not None and not low <= value <= high:
                return f"--grid {key}: {value} is out of range; {variant.name} takes {key} as {allowed}"
    return None


def compile_columns(variant: Any, params: dict[str, Any], dims: Any = None) -> dict[str, Any]:
    """Registers (max over kernels, and per kernel), spill bytes (sum), stack bytes (sum) and theoretical occupancy
    (min) of one point, offline: :func:`tools.compile_report.variant_rows` aggregated (knobs a variant resolves from the
    problem are resolved for ``dims`` first, so the columns describe what actually runs)."""
    from tools import compile_report as offline

    rows = offline.variant_rows(variant, dims, params)
    if not rows:
        return {"compile": "no kernels of its own"}
    failed = [row.error for row in rows if row.error]
    if failed:
        return {"compile": failed[0]}
    occupancies = [row.occupancy for row in rows if row.occupancy is not None]
    return {
        "compile": "ok",
        "registers": max(row.registers or 0 for row in rows),
        "registers_per_kernel": {row.kernel: row.registers for row in rows},
        "spills": sum(row.spills for row in rows),
        # local memory that is not a spill: an array ptxas could not keep in registers (a runtime index), which
        # costs like a spill (a 48-byte frame once made a kernel's tensor-core tail 8 us)
        "stack_bytes": sum(row.stack_bytes or 0 for row in rows),
        "shared_bytes": max(row.shared_bytes or 0 for row in rows),
        "occupancy": min(occupancies) if occupancies else None,
    }


def overridden(variant: Any, point: dict[str, Any], dims: Any) -> dict[str, Any]:
    """The grid knobs of ``point`` that the variant's rules resolve to another value at ``dims``: a column that does
    not run the value it names. Values 0 and -1 (the families' auto values) are left out; so is a point the rules
    refuse (its compile column says why)."""
    if dims is None or getattr(variant, "kernel_family", None) is None:
        return {}
    try:
        resolved = variant.resolve(dims, **point)
    except (TypeError, ValueError):
        return {}
    return {k: resolved[k] for k, v in point.items() if v not in (0, -1) and k in resolved and resolved[k] != v}


def merge_batches(by_batch: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One point's compile columns over the sweep's batches (each resolves its auto knobs for its own T, so a
    batch can compile other code -- a hot-tile pass exists only from some T on): the worst case of each column
    (registers and spills at their most, occupancy at its least), per kernel likewise; ``compile_by_batch`` keeps each
    batch's columns where they differ. A batch whose compile failed makes the point's ``compile`` that error."""
    failed = [(t, c["compile"]) for t, c in by_batch.items() if c.get("compile") != "ok"]
    if failed:
        return {"compile": f"T={failed[0][0]}: {failed[0][1]}"}
    columns = list(by_batch.values())
    per_kernel: dict[str, int] = {}
    for c in columns:
        for kernel, registers in c["registers_per_kernel"].items():
            per_kernel[kernel] = max(per_kernel.get(kernel, 0), registers or 0)
    occupancies = [c["occupancy"] for c in columns if c.get("occupancy") is not None]
    merged = {
        "compile": "ok", "registers": max(c["registers"] for c in columns), "registers_per_kernel": per_kernel,
        "spills": max(c["spills"] for c in columns), "stack_bytes": max(c["stack_bytes"] for c in columns),
        "shared_bytes": max(c["shared_bytes"] for c in columns),
        "occupancy": min(occupancies) if occupancies else None,
    }
    if any(c != columns[0] for c in columns[1:]):
        merged["compile_by_batch"] = by_batch
    changed = {t: c["overridden"] for t, c in by_batch.items() if c.get("overridden")}
    if changed:
        merged["overridden"] = changed
    return merged


def _all_compile_columns(variant: Any, grid_points: list[dict[str, Any]],
                         dims_list: list[Any]) -> list[dict[str, Any]]:
    """Compile columns of every point at every batch's dims (merged: :func:`merge_batches`), in threads; a
    compile whose report still came back empty (see ``kernels.compile.offline_report`` on NVRTC's cache) is compiled
    again on its own."""
    from concurrent.futures import ThreadPoolExecutor

    def one(job: tuple[dict[str, Any], Any]) -> dict[str, Any]:
        point, dims = job
        columns = compile_columns(variant, {**variant.params, **point}, dims)
        changed = overridden(variant, point, dims)
        return {**columns, "overridden": changed} if changed else columns

    jobs = [(point, dims) for point in grid_points for dims in dims_list]
    with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        columns = list(pool.map(one, jobs))
    columns = [one(job) if "no ptxas report" in str(c.get("compile", "")) else c
               for job, c in zip(jobs, columns, strict=True)]
    if not dims_list or dims_list[0] is None or not columns:
        return columns
    n = len(dims_list)
    return [merge_batches({str(d.tokens): c for d, c in zip(dims_list, columns[i * n:(i + 1) * n], strict=True)})
            for i in range(len(grid_points))]


def sweep(name: str, model: str = DEFAULT_MODEL, batch: list[int] | None = None,
          grid: dict[str, list[Any]] | None = None, routing: str = "uniform", repeats: int = 20, seed: int = 0,
          progress: bool = True, rounds: int = 1) -> dict[str, Any]:
    """Run the sweep, the grid ``rounds`` times in turn; returns the JSON record (``points`` ranked, fastest first,
    each with its ``run`` order; ``repeat_spread``: see :func:`repeat_spread`)."""
    from tools.display import Steps

    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds must be an int >= 1, got {rounds!r}")

    batches = batch or list(DEFAULT_BATCHES)
    shape = get_shape(model)
    with Steps(enabled=progress, description="looking for a CUDA GPU") as steps:
        gpu, why = harness.gpu_available()
        if not gpu:
            bench._enable_simulator()
        steps.start("loading the registered variants")
        registry, warnings = load_registry()
        if name not in registry:
            raise ValueError(f"unknown variant {name!r}; registered: {', '.join(registry) or 'none'}")
        variant = registry[name]
        grid = grid if grid else dict(variant.grid)
        error = grid_error(variant, grid)
        if error:
            raise ValueError(error)
        record: dict[str, Any] = {
            "schema": "warp-decode-sweep/1", "variant": name, "model": model, "batches": batches, "grid": grid,
            "routing": routing, "repeats": repeats, "rounds": rounds, "seed": seed,
            "environment": harness.environment(gpu),
            "load_warnings": warnings, "rooflines": None, "points": [], "repeat_spread": None,
        }
        record["date"] = record["environment"]["date"]  # at the top, as the bench's records have it
        grid_points = points(grid) * rounds
        dims_list = [Dims(t, shape.hidden, shape.intermediate, shape.experts, shape.top_k) for t in batches]
        steps.start(f"compiling {len(grid_points)} grid point(s) at {len(batches)} batch(es) for sm_90 (NVRTC, the "
                    "compile columns)")
        distinct = {_key(p): p for p in grid_points}  # a knob set run again is compiled once
        compiled = dict(zip(distinct, _all_compile_columns(variant, list(distinct.values()), dims_list), strict=True))
        columns = [compiled[_key(p)] for p in grid_points]  # auto knobs resolved for each batch
        entries = [{"params": p, "run": run, **c, "results": {}}
                   for run, (p, c) in enumerate(zip(grid_points, columns, strict=True), 1)]
        record["points"] = entries
        if not gpu:
            record["no_timing"] = f"no usable CUDA GPU ({why}): compile columns only, no timing taken"
            return record

        from tools import roofline

        steps.set_total(len(entries) * len(batches) + 1)
        steps.start("measuring the rooflines (streaming read, copies)")
        record["rooflines"] = roofline.measure()
        steps.advance()
        l2 = record["environment"]["gpu"]["l2_bytes"]
        for tokens in batches:
            steps.start(f"T={tokens}: generating the weights")
            work = harness.Workbench(shape, tokens, routing, seed, l2_bytes=l2,
                                     weight_formats=(getattr(variant, "weight_format", "bf16"),))
            try:
                for entry in entries:
                    label = f"T={tokens} {' '.join(f'{k}={v}' for k, v in entry['params'].items()) or '(defaults)'}"
                    row = work.measure(variant, repeats=repeats, params=entry["params"], stages=False,
                                       on_step=lambda what, label=label: steps.start(f"{label}: {what}"))
                    entry["results"][str(tokens)] = row
                    steps.log(f"{label}: " + (f"{row['median_us']:.2f} µs" if row.get("status") == "ok"
                                              else f"{str(row.get('status')).upper()} {row.get('error') or ''}"))
                    steps.advance()
            finally:
                work.free()
    for entry in entries:
        rows = list(entry["results"].values())
        ok = rows and all(r.get("status") == "ok" for r in rows)
        entry["status"] = "ok" if ok else next((r["status"] for r in rows if r.get("status") != "ok"), "not run")
        entry["geomean_us"] = math.exp(sum(math.log(r["median_us"]) for r in rows) / len(rows)) if ok else None
    entries.sort(key=lambda e: (e["geomean_us"] is None, e["geomean_us"] or 0.0))
    record["repeat_spread"] = repeat_spread(entries, batches)
    return record


def render(record: dict[str, Any]) -> Any:
    from rich.console import Group
    from rich.text import Text

    from tools.display import Column, FitTable

    roof = (record.get("rooflines") or {}).get("read_tbps")
    columns = [Column("#"), Column("run", drop=1), Column("params", "left"), Column("regs"), Column("spills/stack"),
               Column("occ", drop=1)]
    for tokens in record["batches"]:
        columns += [Column(f"T={tokens} µs"), Column("TB/s", drop=2), Column("% roof", "left", drop=3)]
    table = FitTable(columns, title=f"sweep {record['variant']} on {record['model']} ({record['routing']})")
    for rank, entry in enumerate(record["points"], 1):
        cells = [str(rank), str(entry.get("run", "-")),
                 " ".join(f"{k}={v}" for k, v in entry["params"].items()) or "(defaults)",
                 "/".join(str(r) for r in entry["registers_per_kernel"].values())
                 if entry.get("registers_per_kernel") else str(entry.get("registers", "-")),
                 f"{entry.get('spills', '-')}/{entry.get('stack_bytes', '-')}",
                 "-" if entry.get("occupancy") is None else f"{entry['occupancy']:.0%}"
                 if entry["occupancy"] <= 1 else f"{entry['occupancy']:.0f}"]
        for tokens in record["batches"]:
            row = entry["results"].get(str(tokens))
            if row is None:
                cells += ["-", "-", ""]
            elif row.get("status") != "ok":
                cells += [row.get("status", "?").upper(), "-", ""]
            else:
                pct = percent(row.get("tbps"), roof)
                cells += [f"{row['median_us']:.2f}", f"{row['tbps']:.2f}",
                          f"{bar(pct, 8)} {pct:.0f}%" if pct is not None else ""]
        table.add_row(*cells, style=None if entry.get("status", "ok") in ("ok", None) or not entry["results"]
                      else "red")
    parts: list[Any] = [table]
    spread = record.get("repeat_spread")
    if spread:
        knobs = " ".join(f"{k}={v}" for k, v in spread["params"].items()) or "(defaults)"
        parts.append(Text(f"repeated knob sets: runs differ by up to {spread['pct']:.1f} % ({knobs}, "
                          f"T={spread['batch']}, {spread['runs']} runs) -- smaller differences between knob sets are "
                          "within the drift"))
    for entry in record["points"]:
        bad = [f"T={t}: {r.get('error')}" for t, r in entry["results"].items() if r.get("status") != "ok"]
        if entry.get("compile") not in ("ok", None):
            bad.append(f"compile: {entry['compile']}")
        by_batch = entry.get("compile_by_batch") or {}
        if len({(c.get("spills"), c.get("stack_bytes")) for c in by_batch.values()}) > 1:
            parts.append(Text(f"{entry['params']}: spills/stack by batch: " + ", ".join(
                f"T={t} {c['spills']}/{c['stack_bytes']}" for t, c in by_batch.items()), style="yellow"))
        if bad:
            parts.append(Text(f"{entry['params']}: " + "; ".join(bad), style="red"))
        for t, knobs in (entry.get("overridden") or {}).items():
            parts.append(Text(f"{entry['params']}: at T={t} the rules run " + ", ".join(
                f"{k}={v}" for k, v in knobs.items()) + ": this row does not measure the value it names", style="red"))
    if record.get("no_timing"):
        parts.append(Text(f"NO TIMING TAKEN: {record['no_timing']}", style="bold yellow"))
    return Group(*parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.sweep", description="Sweep a variant's parameter grid.",
        usage="%(prog)s [-h] [--list] VARIANT [--model MODEL] [--batch T,...] [--grid KEY=v1,v2 ...] "
              "[--routing ROUTING] [--repeats N] [--rounds N] [--seed SEED] [--json PATH]",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=examples(
            "python -m tools.sweep --list                        # the variant names, one line each",
            "python -m tools.sweep cupy:warp-decode --model tiny --batch 1 --grid DN_SLOTS=1,2   # no GPU: compile "
            "columns only",
            "python -m tools.sweep cupy:warp-decode --batch 1,8,64 --grid DN_SLOTS=2,4 --grid DN_UNROLL=1,3 "
            "--json results/sweep.json",
            "python -m tools.sweep cupy:warp-decode-mma-fp8 --model qwen3-235b-a22b --batch 8,16 --grid GB_KSPLIT=1,4 "
            "--rounds 2"))
    # optional here, required below: so an unknown option is reported before a missing VARIANT
    parser.add_argument("variant", nargs="?", metavar="VARIANT",
                        help="a registered variant name (builtin or prototype; --list names them)")
    parser.add_argument("--list", action="store_true",
                        help="print every registered variant's name and description, then exit (no GPU needed)")
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"one preset (default %(default)s); known: {', '.join(PRESETS)}")
    parser.add_argument("--batch", type=int_list, default=list(DEFAULT_BATCHES), metavar="T,...",
                        help=f"comma list of batch sizes T (default {','.join(map(str, DEFAULT_BATCHES))})")
    parser.add_argument("--grid", action="append", metavar="KEY=v1,v2",
                        help="sweep KEY (a knob the variant knows) over these values (repeatable; default: the "
                             "variant's own grid)")
    parser.add_argument("--routing", choices=bench.ROUTINGS, default="uniform",
                        help="how tokens pick experts (default %(default)s)")
    parser.add_argument("--repeats", type=positive_int, default=20, metavar="N",
                        help="timed samples per point (default %(default)s)")
    parser.add_argument("--rounds", type=positive_int, default=1, metavar="N",
                        help="run the whole grid this many times in turn (drift shows as the spread between runs; "
                             "default %(default)s)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the weights, activations and routing, an int >= 0 (default %(default)s)")
    parser.add_argument("--json", metavar="PATH", help="also write the sweep record here (default: not written)")
    args = parser.parse_args(argv)
    if args.list:
        if args.variant is not None:
            parser.error("--list lists every variant: leave VARIANT out")
        if not harness.gpu_available()[0]:
            bench._enable_simulator()
        registry, warnings = load_registry()
        print("\n".join(describe(registry)))
        for warning in warnings:
            print(f"warning: not loaded: {warning}", file=sys.stderr)
        return 0
    if args.variant is None:
        parser.error("the following arguments are required: VARIANT (--list names them)")
    if args.model not in PRESETS:
        parser.error(f"--model: unknown preset {args.model!r}; known: {', '.join(PRESETS)}")
    if args.seed < 0:
        parser.error(f"--seed must be an int >= 0, got {args.seed}")
    try:
        grid = parse_grid(args.grid)
    except ValueError as exc:
        parser.error(str(exc))
    gpu, _ = harness.gpu_available()
    if not gpu:
        bench._enable_simulator()
    registry, _ = load_registry()
    if args.variant not in registry:
        parser.error(f"unknown variant {args.variant!r}; registered: {', '.join(registry) or 'none'}")
    known = known_knobs(registry[args.variant])
    unknown = sorted(set(grid) - known)
    if unknown:
        parser.error(f"--grid: unknown knob(s) {', '.join(unknown)} for {args.variant}; "
                     f"known: {', '.join(sorted(known)) or 'none (it takes no knobs)'}")
    error = grid_error(registry[args.variant], grid)
    if error:
        parser.error(error)
    from tools.display import console

    record = sweep(args.variant, args.model, args.batch, grid, args.routing, args.repeats, args.seed,
                   rounds=args.rounds)
    if args.json:
        from pathlib import Path

        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(record, indent=1, default=bench._json_default))
        print(f"wrote {args.json}", file=sys.stderr)
    console().print(render(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
