"""``python -m tools.dispatch_table``: measure which MoE decode path wins per (shape, T) on this GPU.

    python -m tools.dispatch_table --json kernels/dispatch_tables/nvidia-h200.json
    python -m tools.dispatch_table --json kernels/dispatch_tables/nvidia-h200.json --model qwen3-30b-a3b --batch 1,8
    python -m tools.dispatch_table --json ... --also numba:warp-decode     # record other paths too (never chosen)
    python -m tools.dispatch_table --json kernels/dispatch_tables/nvidia-h200.json --from-bench a.json b.json
    python -m tools.dispatch_table --json kernels/dispatch_tables/nvidia-h200.json --weight-format fp8-block128
    python -m tools.dispatch_table --json kernels/dispatch_tables/nvidia-h200.json --check   # no GPU: the picks' cost

Every point records each candidate's (``kernels.dispatch.CANDIDATES``: strict, batched, MMA, the per-pair and
grouped tensor-core forms, expert-centric) median, status and TB/s under uniform routing (the point's own
``median_us`` / ``status`` / ``tbps``) and under each skewed routing measured (``routings``: ``{"zipf": {...}}``).
``kernels.dispatch`` cannot see the routing when it picks, so it picks by the worst case: per policy ("fastest": all
six; "warp_decode": the five warp-decode paths; "batch_invariant": the per-pair and grouped forms), the candidate
with status "ok" under every routing whose largest slowdown against each routing's fastest is least
(``worst_slowdown`` records it per candidate). The point's ``choices`` (per policy) and ``choice`` (policy "fastest")
say what that gives, for people reading the file. A table keeps what it measured of variants since removed (the
mixed path, ``cupy:warp-decode-mixed``): history, never picked nor checked; the tool names them on stderr
(:func:`unregistered`), and skips a bench run's rows of them.

``--check`` measures nothing: for each point of the table it prints the pick and how much slower it is than the
fastest candidate under each routing the point recorded (a routing-blind choice can lose under one routing what it
wins under another).

``--from-bench`` builds the table from one or more bench runs' JSON instead of timing again (no GPU needed):
rows of the candidates are collected per (model, batch, routing: the row's ``routing``, else the run's config)
in file order -- a later file overrides the same variant at the same model, batch and routing -- and every
(model, batch) where all candidates have a uniform-routing row becomes a point, with the bench's medians and
statuses; a skewed routing joins the point where all candidates have a row under it. The files must come from
one GPU; each file's name and date is recorded (``sources``, and per point which file each candidate's
uniform row came from).

Measuring (no ``--from-bench``): for every preset (``--model``, default all but ``tiny``), T in 1, 2, 4, ..., 64
(``--batch``) and routing (``--routing``, default ``kernels.dispatch.TABLE_ROUTINGS``: uniform and Zipf), each
candidate is timed with ``tools.harness.Workbench.measure`` -- CUDA-graph replays, weights rotated past 3x L2,
output checked against the reference before and after timing -- a candidate that cannot run the dims is
recorded as "unsupported". An existing file for the same GPU is
updated in place (entries of other shapes / points kept), so a long sweep can be split into several commands
(``--model`` one at a time). The file records the GPU's name, the date and the environment.
``kernels.dispatch`` reads it at run time (``kernels/dispatch_tables/<gpu slug>.json``).

``--weight-format fp8-block128`` measures (or collects from the bench runs) the FP8 paths instead
(``kernels.dispatch.FORMAT_CANDIDATES``), on fp8 copies of the weights, into the shape's FP8 entries (key
``H..-K..-fp8-block128``): ``kernels.moe_decode`` on FP8 weights reads those; ``--weight-format fp8-block128-t16``
the tensor-core FP8 paths on tiles into the ``...-fp8-block128-t16`` entries, ``--weight-format bf16-t16`` the
tensor-core bf16 paths on tiles into the ``...-bf16-t16`` ones.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kernels import dispatch
from kernels.contract import Dims
from kernels.routing import GENERATORS
from kernels.shapes import PRESETS, get_shape
from kernels.variants import get_variant
from tools.cli import examples, int_list, positive_int

DEFAULT_MODELS = tuple(name for name in PRESETS if name != "tiny")
DEFAULT_REPEATS = 15


def winner(records: dict[str, dict[str, Any]], policy: str = dispatch.FASTEST,
           weight_format: str = "bf16") -> str | None:
    """The candidate of ``policy`` with the lowest median among those measured correctly (status "ok"), or
    None (ties -> the alphabetically first name); the same rule ``kernels.dispatch`` applies to a point."""
    point = {"median_us": {n: r.get("median_us") for n, r in records.items()},
             "status": {n: r.get("status") for n, r in records.items()}}
    return dispatch.point_choice(point, policy, weight_format=weight_format)


def candidates(weight_format: str = "bf16") -> tuple[str, ...]:
    """Every path the table measures for ``weight_format`` (its policies' candidates, in order)."""
    pools = dispatch.FORMAT_CANDIDATES[dispatch.check_weight_format(weight_format)]
    return tuple(dict.fromkeys(name for names in pools.values() for name in names))


def _measurements(records: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One routing's part of a point: every path's median, status and TB/s, and the routing's unique experts."""
    return {
        "median_us": {name: r.get("median_us") for name, r in records.items()},
        "status": {name: r.get("status") for name, r in records.items()},
        "tbps": {name: r.get("tbps") for name, r in records.items()},
        "unique_experts": next(iter(records.values())).get("bytes", {}).get("unique_experts"),
    }


def point_record(records: dict[str, dict[str, Any]], sources: dict[str, str] | None = None,
                 skewed: dict[str, dict[str, dict[str, Any]]] | None = None,
                 weight_format: str = "bf16") -> dict[str, Any] | None:
    """One table point from the measurements of a (shape, T): under uniform routing (``records``) and each skewed
    routing (``skewed``: routing -> records), every path's median, status and TB/s; the choice per policy by the
    worst case over the routings (``choices``; ``choice`` = policy "fastest"; ``worst_slowdown`` per candidate);
    None when no candidate was measured correctly under every routing."""
    point: dict[str, Any] = _measurements(records)
    if skewed:
        point["routings"] = {routing: _measurements(recs) for routing, recs in skewed.items()}
    choices = {policy: choice for policy in dispatch.POLICIES  # the policies whose candidates were measured
               if (choice := dispatch.point_choice(point, policy, weight_format=weight_format)) is not None}
    choice = choices.get(dispatch.FASTEST)
    if choice is None:
        return None
    best = records[choice]["median_us"]
    point = {
        "choice": choice,
        "choices": choices,
        **point,
        "worst_slowdown": dispatch.worst_slowdowns(point, list(records)),
        "slowdown_of_others": {name: (r["median_us"] / best if r.get("median_us") else None)
                               for name, r in records.items() if name != choice},
    }
    if sources is not None:
        point["sources"] = dict(sources)
    return point


def merge(table: dict[str, Any] | None, gpu: str, env: dict[str, Any], model: str, dims: Dims,
          tokens: int, point: dict[str, Any], weight_format: str = "bf16") -> dict[str, Any]:
    """``table`` (or a new one) with ``point`` written at (shape of ``dims`` in ``weight_format``, ``tokens``)."""
    if table is None or table.get("gpu") != gpu:
        table = {"schema": dispatch.SCHEMA, "gpu": gpu, "slug": dispatch.gpu_slug(gpu), "entries": {}}
    table["candidates"] = list(dispatch.CANDIDATES)
    table["policies"] = {policy: list(names) for policy, names in dispatch.POLICY_CANDIDATES.items()}
    table["formats"] = {fmt: {policy: list(names) for policy, names in pools.items()}
                        for fmt, pools in dispatch.FORMAT_CANDIDATES.items()}
    table["date"] = env.get("date")
    table["environment"] = env
    key = dispatch.shape_key(dims, weight_format)
    entry = table["entries"].setdefault(key, {"model": model, "hidden": dims.hidden, "intermediate": dims.intermediate,
                                              "experts": dims.experts, "top_k": dims.top_k,
                                              "weight_format": weight_format, "points": {}})
    entry["points"][str(tokens)] = point
    entry["points"] = {str(t): entry["points"][str(t)] for t in sorted(int(t) for t in entry["points"])}
    return table


def _env_order(env: dict[str, Any]) -> str:
    return str(env.get("date") or "")


def from_benches(benches: list[tuple[str, dict[str, Any]]], table: dict[str, Any] | None = None,
                 weight_format: str = "bf16") -> dict[str, Any]:
    """A dispatch table (or ``table`` updated) from ``[(file name, tools.bench JSON), ...]``: the candidates' rows
    (of ``weight_format``'s paths) per routing, later files overriding the same variant at the same (model, batch,
    routing); one point per (model, batch) where every candidate has a uniform-routing row, joined by each skewed
    routing where every candidate has a row. ValueError for runs of different GPUs, or no such point."""
    if not benches:
        raise ValueError("from_benches needs at least one bench run")
    names = candidates(weight_format)
    required = dispatch.FORMAT_CANDIDATES[weight_format][dispatch.FASTEST]  # the others join where measured
    gpu: str | None = None
    grouped: dict[tuple[str, int, str], dict[str, dict[str, Any]]] = {}
    origin: dict[tuple[str, int], dict[str, str]] = {}
    sources = []
    env_of: dict[tuple[str, int, str, str], dict[str, Any]] = {}  # the run each kept row came from
    for name, bench in benches:
        env = bench["environment"]
        if env.get("gpu") is None and not bench.get("results"):  # the bench's CPU path: checks, no timing
            reason = (bench.get("cpu") or {}).get("reason") or "no GPU"
            raise ValueError(f"{name} took no timing (run without a GPU: {reason}); a dispatch table needs a "
                             "tools.bench run on the GPU it describes")
        run_gpu = env["gpu"]["name"]
        if gpu is None:
            gpu = run_gpu
        elif run_gpu != gpu:
            raise ValueError(f"bench runs of different GPUs: {name} on {run_gpu!r}, {benches[0][0]} on {gpu!r}")
        sources.append({"file": name, "date": env.get("date"), "gpu": run_gpu})
        run_routing = bench.get("config", {}).get("routing", "uniform")
        for row in bench["results"]:
            if row["variant"] not in names:
                continue
            routing = row.get("routing", run_routing)
            grouped.setdefault((row["model"], int(row["batch"]), routing), {})[row["variant"]] = row
            env_of[(row["model"], int(row["batch"]), routing, row["variant"])] = env
            if routing == "uniform":
                origin.setdefault((row["model"], int(row["batch"])), {})[row["variant"]] = name
    complete = {key: {name: records[name] for name in names if name in records} for key, records in grouped.items()
                if all(name in records for name in required)}
    points = []
    for (model, tokens, routing), ordered in sorted(complete.items()):
        if routing != "uniform":
            continue
        skewed = {r: recs for (m, t, r), recs in sorted(complete.items()) if (m, t) == (model, tokens) and r != routing}
        point = point_record(ordered, {name: origin[(model, tokens)][name] for name in ordered}, skewed, weight_format)
        if point is not None:
            points.append((model, tokens, point, [env_of[(model, tokens, r, n)] for r in ("uniform", *skewed)
                                                  for n in required]))
    used = [env for *_, envs in points for env in envs]
    env = max(used, key=_env_order) if used else {}  # the header of the latest run that counted
    for model, tokens, point, _ in points:
        shape = get_shape(model)
        dims = Dims(tokens, shape.hidden, shape.intermediate, shape.experts, shape.top_k)
        table = merge(table, str(gpu), env, model, dims, tokens, point, weight_format)
    written = len(points)
    if table is None or not written:
        raise ValueError(f"the bench run(s) measured no point with every candidate {required} under uniform routing")
    new_files = {s["file"] for s in sources}
    table["sources"] = [s for s in table.get("sources", []) if s.get("file") not in new_files] + sources
    return dispatch.validate_table(table)


def from_bench(bench: dict[str, Any], table: dict[str, Any] | None = None, name: str = "bench.json",
               weight_format: str = "bf16") -> dict[str, Any]:
    """:func:`from_benches` of one bench run (recorded as ``name``)."""
    return from_benches([(name, bench)], table, weight_format)


def pick_costs(table: dict[str, Any], policy: str = dispatch.FASTEST) -> list[dict[str, Any]]:
    """Per entry and point: the pick of ``policy`` and, under each recorded routing, how much slower it is than that
    routing's fastest candidate of the policy (``slowdown``: 1.0 = the fastest) -- whether the routing-blind choice
    holds under each routing the table measured."""
    rows = []
    for key, entry in table["entries"].items():
        fmt = dispatch.key_format(key)
        pool = dispatch.FORMAT_CANDIDATES[fmt][policy]
        for tokens, point in entry["points"].items():
            pick = dispatch.point_choice(point, policy, weight_format=fmt)
            if pick is None:
                continue
            per_routing = dispatch.routing_slowdowns(point, pool)
            slowdown = {routing: ratios[pick] for routing, ratios in per_routing.items()}
            fastest = {routing: min(ratios, key=ratios.get) for routing, ratios in per_routing.items()}
            rows.append({"model": entry["model"], "weight_format": fmt, "batch": int(tokens), "pick": pick,
                         "slowdown": slowdown, "fastest": fastest})
    return rows


def print_check(table: dict[str, Any], policy: str, limit: float) -> int:
    """The :func:`pick_costs` of ``table`` a line each; returns how many points are more than ``limit`` slower."""
    over = 0
    for row in pick_costs(table, policy):
        worst = max(row["slowdown"].values())
        over += worst > limit
        costs = "  ".join(f"{routing} {100 * (value - 1):+5.1f} %"
                          + (f" (fastest {row['fastest'][routing]})" if value > limit else "")
                          for routing, value in row["slowdown"].items())
        print(f"{row['model']:16s} {row['weight_format']:16s} T={row['batch']:<3d} {row['pick']:36s} {costs}"
              + ("  OVER" if worst > limit else ""))
    print(f"{over} point(s) where the pick is more than {100 * (limit - 1):.0f} % slower than the fastest under some "
          "routing")
    return over


def unregistered(table: dict[str, Any]) -> list[str]:
    """The variants ``table`` names (candidates, medians, choices) that are no longer registered -- removed paths
    such as ``cupy:warp-decode-mixed``, whose measurements a table keeps as history: ``kernels.dispatch`` never picks
    them and ``--check`` never weighs them."""
    names = set(table.get("candidates") or [])
    for pools in (table.get("formats") or {}).values():
        names.update(name for pool in (pools or {}).values() for name in pool or [])
    for entry in table.get("entries", {}).values():
        for point in entry.get("points", {}).values():
            names.update(n for n in (point.get("choice"), *(point.get("choices") or {}).values()) if n)
            for run in dispatch.point_routings(point).values():
                names.update(run.get("median_us") or {})
    return sorted(name for name in names if isinstance(name, str) and not dispatch.registered(name))


def note_unregistered(table: dict[str, Any], where: str) -> None:
    """A line on stderr naming the variants :func:`unregistered` finds in ``table`` (``where``: its file)."""
    names = unregistered(table)
    if names:
        print(f"note: {where} names {len(names)} variant(s) no longer registered ({', '.join(names)}): their "
              "measurements stay in the table as history, never picked nor checked", file=sys.stderr)


def _print_choices(table: dict[str, Any]) -> None:
    for key, entry in table["entries"].items():
        fmt = dispatch.key_format(key)
        for policy in dispatch.POLICIES:
            print(f"{entry['model']:24s} {fmt:13s} {policy:12s}",
                  {t: dispatch.point_choice(p, policy, weight_format=fmt) for t, p in entry["points"].items()})


def _source_name(path: Path) -> str:
    """How a table cites a bench file: its path from the working directory (the repository root, where the
    toolkit runs: ``results/h200-....json``) when it lies below it, else its file name."""
    try:
        return path.resolve().relative_to(Path.cwd().resolve()).as_posix()
    except ValueError:
        return path.name


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.dispatch_table", description=__doc__.split("\n")[0],
                                     usage="%(prog)s [-h] --json PATH [--model M,...] [--batch T,...] [--repeats N] "
                                           "[--routing R,...] [--also VARIANT,...] [--weight-format F] "
                                           "[--from-bench BENCH_JSON ...] [--check [--policy P]]",
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=examples(
                                         "python -m tools.dispatch_table --json /tmp/nvidia-h200.json --from-bench "
                                         "results/h200-2026-12-02-candidates-uniform.json   # no GPU needed",
                                         "python -m tools.dispatch_table --json kernels/dispatch_tables/"
                                         "nvidia-h200.json --model qwen3-30b-a3b --batch 1,8   # on the GPU",
                                         "python -m tools.dispatch_table --json kernels/dispatch_tables/"
                                         "nvidia-h200.json --weight-format fp8-block128 --model qwen3-30b-a3b",
                                         "python -m tools.dispatch_table --json kernels/dispatch_tables/"
                                         "nvidia-h200.json --check   # does each pick hold under every routing?"))
    # not required=True: an unknown option is reported before a missing --json (checked below)
    parser.add_argument("--json", metavar="PATH",
                        help="table file to write / update (kernels/dispatch_tables/<slug>.json); required")
    parser.add_argument("--model", default=",".join(DEFAULT_MODELS), metavar="M,...",
                        help="comma-separated presets (default: every preset but tiny)")
    parser.add_argument("--batch", type=int_list, default=list(dispatch.TABLE_POINTS), metavar="T,...",
                        help=f"comma list of batch sizes T (default {','.join(map(str, dispatch.TABLE_POINTS))})")
    parser.add_argument("--repeats", type=positive_int, default=DEFAULT_REPEATS, metavar="N",
                        help="timed samples per candidate and point (default %(default)s)")
    parser.add_argument("--routing", default=",".join(dispatch.TABLE_ROUTINGS), metavar="R,...",
                        help="comma-separated routings, uniform first (the choice is the best worst case over them; "
                             "default %(default)s)")
    parser.add_argument("--also", default="", metavar="VARIANT,...",
                        help="comma-separated variants to time and record, never chosen (default: none)")
    parser.add_argument("--weight-format", choices=tuple(dispatch.FORMAT_CANDIDATES), default="bf16",
                        help="the weights' format: its paths are the candidates (default %(default)s)")
    parser.add_argument("--from-bench", metavar="BENCH_JSON", nargs="+",
                        help="build the table from bench runs' JSON, timed on a GPU (later files override earlier "
                             "ones; default: measure on this GPU)")
    parser.add_argument("--check", action="store_true",
                        help="no measuring: print, for the table at --json, each point's pick and how much slower it "
                             "is than the fastest candidate under each routing the table recorded (default: off)")
    parser.add_argument("--policy", choices=dispatch.POLICIES, default=dispatch.FASTEST,
                        help="--check: the policy whose picks are checked (default fastest)")
    args = parser.parse_args(argv)
    if not args.json:
        parser.error("the following arguments are required: --json")
    if args.check:
        try:
            table = dispatch.validate_table(json.loads(Path(args.json).read_text()))
        except (OSError, ValueError) as exc:
            parser.error(f"--check: {' '.join(str(exc).split())}")
        note_unregistered(table, args.json)
        print_check(table, args.policy, 1.03)
        return 0
    routings = [r.strip() for r in args.routing.split(",") if r.strip()]
    if not routings or routings[0] != "uniform" or any(r not in GENERATORS for r in routings) \
            or len(set(routings)) != len(routings):
        parser.error(f"--routing: distinct names of {', '.join(GENERATORS)}, uniform first; got {args.routing!r}")
    models = [m.strip() for m in args.model.split(",") if m.strip()]
    unknown = [m for m in models if m not in PRESETS]
    if unknown or not models:
        parser.error(f"--model: unknown preset(s) {', '.join(map(repr, unknown)) or 'none given'}; "
                     f"known: {', '.join(PRESETS)}")

    if args.from_bench:
        path = Path(args.json)
        try:
            runs = [(_source_name(Path(f)), json.loads(Path(f).read_text())) for f in args.from_bench]
            for name, run in runs:
                retired = sorted({row.get("variant") for row in run.get("results") or [] if isinstance(row, dict)
                                  and isinstance(row.get("variant"), str) and not dispatch.registered(row["variant"])})
                if retired:
                    print(f"note: {name} measured {len(retired)} variant(s) no longer registered "
                          f"({', '.join(retired)}): their rows are skipped", file=sys.stderr)
            table = from_benches(runs, json.loads(path.read_text()) if path.is_file() else None, args.weight_format)
        except (OSError, ValueError) as exc:  # unreadable, not JSON, runs of different GPUs, no complete point
            parser.error(f"--from-bench: {' '.join(str(exc).split())}")
        except (KeyError, TypeError) as exc:  # a JSON that is not a tools.bench run
            parser.error(f"--from-bench: not a tools.bench result ({type(exc).__name__}: {exc})")
        if path.stem != table["slug"]:
            print(f"warning: {path.name} does not match the bench GPU's slug {table['slug']!r}", file=sys.stderr)
        note_unregistered(table, args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(table, indent=1) + "\n")
        _print_choices(table)
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
    if table is not None:
        note_unregistered(table, args.json)
    pool = candidates(args.weight_format)
    names = list(pool) + [n for n in args.also.split(",") if n and n not in pool]
    try:
        variants = {name: get_variant(name) for name in names}
    except ValueError as exc:
        parser.error(f"--also: {exc}")
    for model in models:
        shape = get_shape(model)
        for tokens in args.batch:
            dims = Dims(tokens, shape.hidden, shape.intermediate, shape.experts, shape.top_k)
            by_routing: dict[str, dict[str, dict[str, Any]]] = {}
            for routing in routings:
                formats = tuple(dict.fromkeys(v.weight_format for v in variants.values()))
                bench = harness.Workbench(shape, tokens, routing=routing, seed=0, weight_formats=formats)
                try:
                    records = by_routing[routing] = {}
                    for name, variant in variants.items():
                        if name in pool and not dispatch.supported(name, dims):
                            records[name] = {"status": "unsupported", "median_us": None}
                            continue
                        records[name] = bench.measure(variant, repeats=args.repeats, stages=False)
                finally:
                    bench.free()
                line = "  ".join(f"{n}: {r.get('median_us') or float('nan'):9.1f} us ({r.get('status')})"
                                 for n, r in records.items())
                print(f"{model:24s} T={tokens:3d} {routing:8s} {line}", flush=True)
            point = point_record(by_routing.pop("uniform"), skewed=by_routing, weight_format=args.weight_format)
            print(f"{model:24s} T={tokens:3d}  -> {point['choices'] if point else 'NO CORRECT PATH'}", flush=True)
            if point is None:
                continue
            table = merge(table, gpu, env, model, dims, tokens, point, args.weight_format)
            dispatch.validate_table(table)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(table, indent=1) + "\n")  # after every point: a killed run keeps its work
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
