"""``python -m tools.bench``: time the lab's MoE decode paths on real model shapes against the measured roofline.

    python -m tools.bench                                     # qwen3-30b-a3b, T = 1..64: auto, strict, baseline, peer
    python -m tools.bench --all                               # every path of the library
    python -m tools.bench --model qwen3-30b-a3b,deepseek-v3 --batch 1,8,64 --variants 'cupy:*' --json results/h200.json
    python -m tools.bench --prototypes                        # the experiments in prototypes/ too
    python -m tools.bench --list                              # the registered variants, a line each
    python -m tools.bench --markdown                          # markdown tables for a PR

From IPython::

    from tools import bench
    r = bench.run("qwen3-30b-a3b", batch=[1, 8])    # renders as the rich table; r.to_json(), r.markdown()
    # edit a kernel: kernels.compile.SOURCES[...].code = ...; bench.run(...) again recompiles it

Variants come only from the registry (``tools.registry.load``: the library and the prototypes). By default the
bench answers a newcomer's question in about a minute on an H200 -- how fast is warp decode here against the
conventional baseline and, when the peers extra is installed, the serving engines' design: :data:`QUICK_VARIANTS`
(auto-dispatch, strict warp decode, the expert-centric baseline, the Triton peer), without per-stage timing;
``variants="all"`` / ``--all`` times every path of the library, ``prototypes=True`` / ``--prototypes`` adds the
experiments. Without a GPU the same command checks
what a CPU can: the selected Numba variants on Numba's CUDA simulator at the ``tiny`` shape and the smallest
requested batch, the reference in the selected variants' modes at ``tiny`` for every requested batch, the bytes
of every requested point, and a one-line-per-kernel sm_90 compile report of the selected variants -- and says that
no timing was taken.

Import order matters: nothing here imports numba before the GPU check, so ``NUMBA_ENABLE_CUDASIM=1`` can
still be set when there is no GPU.
"""

from __future__ import annotations

import argparse
import fnmatch
import io
import json
import os
import sys
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kernels.contract import check_int
from kernels.routing import GENERATORS
from kernels.shapes import DEFAULT_MODEL, PRESETS, get_shape
from tools import display, harness, report
from tools.cli import examples, int_list, positive_int
from tools.registry import describe
from tools.registry import load as load_registry

SCHEMA = "warp-decode-bench/1"
DEFAULT_BATCHES = (1, 2, 4, 8, 16, 32, 64)
ROUTINGS = GENERATORS  # the routing generators of kernels.routing
DEFAULT_REPEATS = 30
ALL = "all"  # variants="all": every path of the library
# the default selection: auto-dispatch, the strict warp decode it started from, the conventional baseline and the peer
# (registered only where the peers extra runs); without a GPU the Numba strict kernels, which the simulator runs
QUICK_VARIANTS = ("cupy:auto", "cupy:warp-decode", "cupy:expert-centric", "triton:fused-moe")
QUICK_VARIANTS_CPU = ("numba:warp-decode",)
COMPILE_REPORTS = ("summary", "full", "none")
SIM_SHAPE = "tiny"  # the shape the CPU path simulates and checks the reference at

# ------------------------------------------------------------------------------------------------
# The registry
# ------------------------------------------------------------------------------------------------
def is_peer(variant: Any) -> bool:
    """Whether ``variant`` is one of the peers (``tools.peers``): not a path of the library."""
    from tools.registry import peers

    return variant.name in peers()[0]


def select_variants(registry: dict[str, Any], patterns: Iterable[Any] | None, prototypes: bool = True,
                    gpu: bool = True) -> list[Any]:
    """Variants matching names or fnmatch globs (registry order); ValueError for a pattern matching none.

    ``patterns`` None: :data:`QUICK_VARIANTS` that are registered (without a ``gpu``, plus
    :data:`QUICK_VARIANTS_CPU`), and with ``prototypes`` every prototype; ``"all"`` (or ``["all"]``): every variant,
    or with ``prototypes=False`` the library's only (a pattern may still name a prototype)."""
    if patterns is None:
        quick = QUICK_VARIANTS if gpu else (*QUICK_VARIANTS, *QUICK_VARIANTS_CPU)
        return [v for name, v in registry.items() if name in quick or (prototypes and getattr(v, "prototype", False))]
    if isinstance(patterns, str):
        patterns = [patterns]
    if list(patterns) == [ALL]:
        return [v for v in registry.values() if not is_peer(v) and (prototypes or not getattr(v, "prototype", False))]
    chosen: list[Any] = []
    for pattern in patterns:
        if not isinstance(pattern, str):  # a Variant object passed directly
            chosen.append(pattern)
            continue
        matches = [v for name, v in registry.items() if fnmatch.fnmatchcase(name, pattern)]
        if not matches:
            raise ValueError(f"no registered variant matches {pattern!r}; registered: {', '.join(registry) or 'none'}")
        chosen.extend(m for m in matches if m not in chosen)
    return chosen


# ------------------------------------------------------------------------------------------------
# The result object (IPython)
# ------------------------------------------------------------------------------------------------
class BenchResult:
    """A bench run: ``data`` is the JSON record; renders as the rich report in a terminal or IPython."""

    def __init__(self, data: dict[str, Any]) -> None:
        self.data = data

    @property
    def rows(self) -> list[dict[str, Any]]:
        return self.data.get("results", [])

    def to_json(self, path: str | Path | None = None) -> str:
        text = json.dumps(self.data, indent=1, default=_json_default)
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(text)
        return text

    def markdown(self) -> str:
        return report.markdown(self.data)

    def __rich__(self) -> Any:
        return report.renderables(self.data)

    def _text(self, width: int = 160) -> str:
        return display.text_of(self.__rich__(), width)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text("BenchResult(...)" if cycle else self._text(display.terminal_width()))

    def _repr_html_(self) -> str:
        from rich.console import Console

        console = Console(record=True, file=io.StringIO(), width=160)
        console.print(self.__rich__())
        return console.export_html(inline_styles=True)

    def summary(self) -> str:
        """A few lines: what ran, where, and the fastest path per (model, batch) -- or why nothing was timed."""
        config = self.data.get("config") or {}
        lines = [f"BenchResult: {len(self.rows)} rows; models {', '.join(config.get('models') or []) or '-'}; "
                 f"batches {', '.join(map(str, config.get('batches') or [])) or '-'}; "
                 f"{len(config.get('variants') or [])} variants; routing {config.get('routing', '?')}"]
        cpu = self.data.get("cpu")
        if cpu:
            sim = cpu.get("simulator") or {}
            cases = sim.get("cases") or []
            lines.append(f"  NO TIMING TAKEN: {cpu.get('reason')}")
            lines.append(f"  simulator: {sim.get('status')} ({sum(bool(c.get('ok')) for c in cases)}/{len(cases)} "
                         f"cases ok); reference rows: {len(cpu.get('reference') or [])}; "
                         f"compile rows: {len(cpu.get('compile') or [])}")
        best: dict[tuple[str, int, str], dict[str, Any]] = {}  # per weight format: bytes differ between them
        for row in self.rows:
            if row.get("status") == "ok" and row.get("median_us") is not None:
                key = (row["model"], row["batch"], (row.get("bytes") or {}).get("weight_format", "bf16"))
                if key not in best or row["median_us"] < best[key]["median_us"]:
                    best[key] = row
        for (model, batch, fmt), row in sorted(best.items()):
            weights = "" if fmt == "bf16" else f" ({fmt} weights)"
            lines.append(f"  {model} T={batch}{weights}: fastest {row['variant']} {row['median_us']:.1f} µs")
        failed = [r for r in self.rows if r.get("status") not in ("ok", "unsupported")]
        if failed:
            lines.append(f"  {len(failed)} rows failed: " + ", ".join(f"{r['variant']} T={r['batch']} ({r['status']})"
                                                                      for r in failed[:5]))
        lines.append("  (r.to_json() for the samples, r.markdown() for tables; r renders as the full report)")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.summary()


def _json_default(value: Any) -> Any:
    import numpy as np

    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return str(value)


# ------------------------------------------------------------------------------------------------
# Runs
# ------------------------------------------------------------------------------------------------
def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, str):
        return [v for v in value.split(",") if v]
    return list(value)


def _check_args(models: list[str], batches: list[Any], routing: str, repeats: Any, seed: Any,
                compile_report: str) -> None:
    if not models:
        raise ValueError("model: give at least one preset")
    for model in models:
        get_shape(model)  # ValueError naming the presets
    if not batches:
        raise ValueError("batch: give at least one batch size")
    for value in batches:
        check_int("batch", value, 1)
    if routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
    check_int("repeats", repeats, 1)
    check_int("seed", seed, 0)
    if compile_report not in COMPILE_REPORTS:
        raise ValueError(f"compile_report must be one of {COMPILE_REPORTS}, got {compile_report!r}")


class SelectionError(ValueError):
    """A ``variants`` pattern that matches no registered variant."""


def run(
    model: str | Sequence[str] = DEFAULT_MODEL,
    batch: Sequence[int] = DEFAULT_BATCHES,
    variants: Sequence[Any] | str | None = None,
    routing: str = "uniform",
    repeats: int = DEFAULT_REPEATS,
    seed: int = 0,
    progress: bool = True,
    stages: bool = False,
    json_path: str | Path | None = None,
    prototypes: bool = False,
    compile_report: str = "summary",
) -> BenchResult:
    """Measure ``variants`` (names, globs or Variant objects; default :data:`QUICK_VARIANTS`, ``"all"`` every path of
    the library; ``prototypes=True`` adds the experiments) on ``model`` at each ``batch``. ``repeats`` samples per
    point, each on fresh routing draws (``tools.harness``); ``stages``: also time each stage of a launch.

    Without a GPU it runs the CPU checks instead (no timing; ``compile_report``: "summary" of the selected
    variants' kernels, "full" for every registered source, or "none"). Every call compiles afresh (launches are
    built per run), so editing a ``CudaSource.code`` and calling ``run`` again measures the edited kernel.
    ``json_path``: rewritten after every (model, batch), so a run cut short still leaves its results.
    ``progress``: show each step on stderr.
    """
    models = _as_list(model)
    batches = [int(b) if isinstance(b, str) else b for b in _as_list(batch)]
    _check_args(models, batches, routing, repeats, seed, compile_report)
    batches, repeats, seed = [int(b) for b in batches], int(repeats), int(seed)
    with display.Steps(enabled=progress, description="looking for a CUDA GPU") as steps:
        gpu, why = harness.gpu_available()
        if not gpu:
            _enable_simulator()
            steps.log(f"no usable CUDA GPU: {why}; checking on the CPU, no timing")
        steps.start("loading the registered variants")
        registry, warnings = load_registry()
        try:
            chosen = select_variants(registry, variants, prototypes, gpu)
        except ValueError as exc:
            raise SelectionError(str(exc)) from None
        config = {"models": models, "batches": batches, "variants": [v.name for v in chosen], "routing": routing,
                  "repeats": repeats, "seed": seed, "prototypes": prototypes,
                  "argv": sys.argv if __name__ == "__main__" else None}
        data: dict[str, Any] = {
            "schema": SCHEMA, "synthetic": False, "environment": harness.environment(gpu), "config": config,
            "load_warnings": warnings, "rooflines": None, "results": [], "complete": False,
        }
        data["date"] = data["environment"]["date"]
        if not gpu:
            data["cpu"] = cpu_checks(models, batches, routing, seed, why, chosen, compile_report, steps)
            if json_path is not None:
                BenchResult(data).to_json(json_path)
            return BenchResult(data)

        def checkpoint() -> None:
            data["crossover"] = {m: report.crossover(data, m) for m in models}
            if json_path is not None:
                BenchResult(data).to_json(json_path)

        _measure_all(data, models, batches, chosen, routing, repeats, seed, steps, stages, checkpoint)
        data["complete"] = True
        checkpoint()
    return BenchResult(data)


def _row_line(row: dict[str, Any], roof_tbps: float | None) -> str:
    """One measured point as a line of the progress log."""
    head = f"{row['model']} T={row['batch']} {row['variant']}"
    if row.get("status") != "ok" or row.get("median_us") is None:
        return f"{head}: {str(row.get('status', '?')).upper()} {row.get('error') or ''}".rstrip()
    from tools.roofline import percent

    pct = percent(row.get("tbps"), roof_tbps)
    return (f"{head}: {row['median_us']:.2f} µs, {row['tbps']:.2f} TB/s"
            + (f" ({pct:.0f} % of roofline)" if pct is not None else "") + ", check ok")


def _measure_all(data: dict[str, Any], models: list[str], batches: list[int], chosen: list[Any], routing: str,
                 repeats: int, seed: int, steps: display.Steps, stages: bool, checkpoint: Any = None) -> None:
    from tools import roofline

    steps.set_total(len(models) * len(batches) * len(chosen) + 1)
    steps.start("measuring the rooflines (streaming read, copies)")
    data["rooflines"] = roofline.measure()
    roof = data["rooflines"].get("read_tbps")
    steps.log(f"streaming-read roofline: {roof:.2f} TB/s" if roof else "streaming-read roofline: not measured")
    steps.advance()
    l2 = data["environment"]["gpu"]["l2_bytes"]
    formats = tuple(dict.fromkeys(getattr(v, "weight_format", "bf16") for v in chosen))
    for model in models:
        shape = get_shape(model)
        for tokens in batches:
            steps.start(f"{model} T={tokens}: generating the weights ({', '.join(formats)})")
            try:
                bench = harness.Workbench(shape, tokens, routing, seed, l2_bytes=l2, weight_formats=formats)
            except Exception as exc:  # noqa: BLE001 - e.g. out of memory for this preset
                for variant in chosen:
                    data["results"].append({"model": model, "batch": tokens, "variant": variant.name,
                                            "family": variant.family, "baseline": variant.baseline,
                                            "status": "error", "error": f"{type(exc).__name__}: {exc}",
                                            "samples_us": []})
                    steps.advance()
                steps.log(f"{model} T={tokens}: ERROR {type(exc).__name__}: {exc}")
                continue
            try:
                for variant in chosen:
                    label = f"{model} T={tokens} {variant.name}"
                    row = bench.measure(variant, repeats=repeats, stages=stages,
                                        on_step=lambda what, label=label: steps.start(f"{label}: {what}"))
                    data["results"].append(row)
                    steps.log(_row_line(row, roof))
                    steps.advance()
            finally:
                bench.free()
                del bench
            if checkpoint is not None:
                checkpoint()


# ------------------------------------------------------------------------------------------------
# The CPU path
# ------------------------------------------------------------------------------------------------
def _enable_simulator() -> None:
    """No GPU: run Numba kernels on the CUDA simulator (only effective before numba is imported). It holds for the
    rest of the process: numba.cuda, once imported on the simulator, stays there -- an IPython session on a machine
    without a GPU keeps simulating after the bench (the real target could not run there anyway)."""
    if "numba" in sys.modules and os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
        print("warning: numba was imported before the bench; the CUDA simulator may not be active", file=sys.stderr)
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"


def _plain(value: Any) -> Any:
    """JSON-ready copy (numpy scalars to Python, unknown objects to str)."""
    return json.loads(json.dumps(value, default=_json_default))


def _simulate(chosen: list[Any], tokens: int, routing: str, seed: int, steps: display.Steps) -> dict[str, Any]:
    """The selected variants that run on Numba's CUDA simulator (those whose kernel family states ``simulate``: the
    Numba ones), at the tiny shape and ``tokens`` tokens, checked against the reference."""
    simulated = [v for v in chosen if v.kernel_family is not None and v.kernel_family.simulate is not None]
    if not simulated:
        return {"status": "none", "message": "no selected variant runs on the CUDA simulator (the Numba ones do)",
                "cases": []}
    cases: list[dict[str, Any]] = []
    for variant in simulated:
        steps.start(f"{variant.name} on Numba's CUDA simulator ({SIM_SHAPE}, T={tokens}; every CUDA thread is a "
                    f"Python thread: seconds per token)")
        name = f"{variant.name} {SIM_SHAPE} T={tokens}"
        try:
            case = (SIM_SHAPE, tokens, routing, dict(variant.params))
            (outcome,) = variant.kernel_family.simulate((case,), seed=seed)
        except Exception as exc:  # noqa: BLE001 - report it, no traceback
            cases.append({"case": name, "ok": False, "message": f"{type(exc).__name__}: {exc}"})
            continue
        cases.append({**_plain(outcome), "case": name, "rel_l2": outcome.get("rel_l2_fp64"),
                      "ulp": outcome.get("max_ulp")})
    ok = all(bool(c.get("ok")) for c in cases)
    return {"status": "ok" if ok else "failed", "cases": cases,
            "message": "" if ok else "; ".join(f"{c['case']}: {c.get('why') or c.get('message', 'outside tolerance')}"
                                               for c in cases if not c.get("ok"))}


REFERENCE_MODES = (("warp_decode", None), ("classical", None), ("classical", "fp8"), ("classical", "mxfp8"))


def _reference_checks(batches: list[int], routing: str, seed: int,
                      modes: Iterable[tuple[str, str | None]] = REFERENCE_MODES) -> list[dict[str, Any]]:
    from kernels.numerics import max_abs, rel_l2
    from kernels.problem import make_problem
    from kernels.reference import moe_decode

    rows = []
    for tokens in batches:
        problem = make_problem(SIM_SHAPE, tokens, seed, routing)
        oracle = moe_decode(*problem.arrays, mode="fp64")
        for mode, quant in modes:
            out = moe_decode(*problem.arrays, mode=mode, quant=quant).astype("float64")
            rows.append({"mode": mode + (f"+{quant}" if quant else ""), "batch": tokens,
                         "rel_l2": rel_l2(out, oracle), "max_abs": max_abs(out, oracle)})
    return rows


def _expected_bytes(models: list[str], batches: list[int], routing: str, seed: int,
                    draws: int = DEFAULT_REPEATS) -> list[dict[str, Any]]:
    """Each point's bytes over ``draws`` routing draws (the mean touched experts, as a timed point divides by)."""
    import numpy as np

    from kernels.routing import make_routing

    rows = []
    for model in models:
        shape = get_shape(model)
        for tokens in batches:
            ids = np.stack([make_routing(tokens, shape.experts, shape.top_k, routing,
                                         seed if d == 0 else harness.draw_seed(seed, d, 0))[0] for d in range(draws)])
            b = harness.bytes_breakdown(shape, ids)
            rows.append({"model": model, "batch": tokens, "bytes": b, "us_at_4_8_tbps": b["weights"] / 4.8e12 * 1e6})
    return rows


def _compile_rows(chosen: list[Any], models: list[str], tokens: int, mode: str) -> list[dict[str, Any]]:
    """The sm_90 compile report as JSON rows: "summary", the selected variants' kernels with the knobs they run
    at each model's ``tokens``-token point; "full", every registered source at every listed parameter set."""
    import dataclasses

    from kernels.contract import Dims
    from tools import compile_report as offline

    if mode == "full":
        return [dataclasses.asdict(row) for row in offline.collect()]
    rows: dict[tuple[Any, ...], Any] = {}  # one row per distinct compiled kernel; the variants that run it joined
    for model in models:
        shape = get_shape(model)
        dims = Dims(tokens, shape.hidden, shape.intermediate, shape.experts, shape.top_k)
        for variant in chosen:
            for row in offline.variant_rows(variant, dims):
                label = f"{row.variant} ({model})" if len(models) > 1 else row.variant
                key = (row.source, row.kernel, json.dumps(row.params, sort_keys=True), row.error)
                if key in rows:
                    rows[key].variant += f", {label}"
                else:
                    row.variant = label
                    rows[key] = row
    return [dataclasses.asdict(row) for row in rows.values()]


def cpu_checks(models: list[str], batches: list[int], routing: str, seed: int, reason: str,
               chosen: Sequence[Any] = (), compile_report: str = "summary",
               steps: display.Steps | None = None) -> dict[str, Any]:
    """Everything the bench can do without a GPU, for the selected variants (``chosen``): the simulator, the
    reference in their modes, bytes, and the compile report (built in a worker thread while the simulator runs)."""
    steps = steps or display.Steps(enabled=False)
    chosen = list(chosen)
    modes = [m for m in REFERENCE_MODES if not chosen or m in {(v.reference_mode, v.quant) for v in chosen}]
    result: dict[str, Any] = {"reason": reason, "compile_report": compile_report}
    with ThreadPoolExecutor(max_workers=1) as pool:
        compiling = (pool.submit(_compile_rows, chosen, models, min(batches), compile_report)
                     if compile_report != "none" else None)
        result["simulator"] = _simulate(chosen, min(batches), routing, seed, steps)
        names = ", ".join(mode + (f"+{quant}" if quant else "") for mode, quant in modes)
        steps.start(f"the reference at the {SIM_SHAPE} shape vs fp64 ({names})")
        result["reference"] = _reference_checks(batches, routing, seed, modes)
        steps.start("bytes per layer of every requested point")
        result["expected_bytes"] = _expected_bytes(models, batches, routing, seed)
        if compiling is not None:
            steps.start(f"compile report ({compile_report}): NVRTC / nvJitLink for sm_90")
            try:
                result["compile"] = compiling.result()
            except Exception as exc:  # noqa: BLE001 - the report must not stop the checks
                result["compile"] = [{"source": "-", "kernel": "-", "error": f"{type(exc).__name__}: {exc}"[:200]}]
    return result


# ------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tools.bench", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Time the lab's MoE decode paths against the roofline measured in the same run (without a GPU: "
                    "check them on the CPU, no timing). The default answers how fast warp decode is here against "
                    "the baseline and the peer, in about a minute on an H200.",
        epilog=examples("python -m tools.bench                                   # auto, strict, baseline, peer",
                        "python -m tools.bench --all --batch 1,8,64              # every path of the library",
                        "python -m tools.bench --model qwen3-235b-a22b --routing zipf --json run.json",
                        "python -m tools.bench --variants 'cupy:auto*' --stages  # the autos, each stage timed too"))
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"comma list of presets, or 'all' (every preset but tiny); default {DEFAULT_MODEL}; "
                             f"known: {', '.join(PRESETS)}")
    parser.add_argument("--batch", type=int_list, default=list(DEFAULT_BATCHES),
                        help="comma list of batch sizes (default 1,2,4,8,16,32,64)")
    parser.add_argument("--variants", default=None,
                        help="comma list of variant names or globs (default: " + ", ".join(QUICK_VARIANTS)
                             + ", those installed; --list names them all)")
    parser.add_argument("--all", action="store_true", help="every path of the library (default: the four above)")
    parser.add_argument("--list", action="store_true", help="list the registered variants and exit (python -m "
                                                            "tools.bench --list)")
    parser.add_argument("--prototypes", action="store_true", help="also run the experiments in prototypes/")
    parser.add_argument("--routing", choices=ROUTINGS, default="uniform",
                        help="the routing generator each sample draws from (default uniform)")
    parser.add_argument("--repeats", type=positive_int, default=DEFAULT_REPEATS,
                        help=f"timed samples per point, each on fresh routing draws (default {DEFAULT_REPEATS})")
    parser.add_argument("--seed", type=int, default=0, help="seed of the activations and routing draws (default 0)")
    parser.add_argument("--json", metavar="PATH",
                        help="write every raw sample + the environment here (default: no file written)")
    parser.add_argument("--markdown", action="store_true", help="print markdown tables (for a PR) instead")
    parser.add_argument("--stages", action="store_true",
                        help="also time each stage of a launch alone and its cost in the layer's chain (slower)")
    parser.add_argument("--compile-report", choices=COMPILE_REPORTS, default="summary",
                        help="without a GPU: 'summary' (the selected variants' kernels, a line each; default), "
                             "'full' (every registered source and parameter set) or 'none'")
    return parser


def list_variants(prototypes: bool = True, file: Any = None) -> None:
    """Print every registered variant (the library's, then the prototypes'): name, weight format, what it is; the
    default selection marked ``*``."""
    import shutil

    registry, warnings = load_registry()
    out = file or sys.stdout
    shown = {name: v for name, v in registry.items() if prototypes or not getattr(v, "prototype", False)}
    width = max((len(name) for name in shown), default=0)
    room = max(20, shutil.get_terminal_size((120, 24)).columns - width - 22)  # what the line has left
    for line in describe(shown, marked=QUICK_VARIANTS, room=room):
        print(line, file=out)
    print("* the default selection (python -m tools.bench); --all: every library path; --prototypes: prototypes too",
          file=out)
    from tools.registry import peers

    names, why_not = peers()
    if why_not is not None:
        print(f"  {', '.join(names)}: not here: {why_not}", file=out)
    for line in warnings:
        print(f"warning: {line}", file=out)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    models = [m for m in PRESETS if m != "tiny"] if args.model == "all" else _as_list(args.model)
    unknown = [m for m in models if m not in PRESETS]
    if unknown or not models:
        parser.error(f"--model: unknown preset(s) {unknown or args.model!r}; known: {', '.join(PRESETS)}")
    if args.seed < 0:
        parser.error(f"--seed must be an int >= 0, got {args.seed}")
    if args.list:
        list_variants(prototypes=True)
        return 0
    patterns = _as_list(args.variants) if args.variants is not None else None
    if patterns is not None and not patterns:
        parser.error("--variants: give at least one name or glob")
    if args.all and patterns is not None:
        parser.error("--all and --variants choose the variants two ways: give one")
    if args.all:
        patterns = [ALL]
    try:
        result = run(models, args.batch, patterns, args.routing, args.repeats, args.seed, stages=args.stages,
                     json_path=args.json, prototypes=args.prototypes, compile_report=args.compile_report)
    except SelectionError as exc:
        parser.error(f"--variants: {exc}")
    if args.markdown:
        sys.stdout.write(result.markdown())
    else:
        display.console().print(result)
    if args.json:
        print(f"wrote {args.json}", file=sys.stderr)
    cpu = result.data.get("cpu")
    if cpu and cpu["simulator"]["status"] in ("failed", "error"):
        print(f"simulator check {cpu['simulator']['status']}: {cpu['simulator'].get('message', '')}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
