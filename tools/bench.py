"""``python -m tools.bench``: time every registered variant on real model shapes against the measured roofline.

    python -m tools.bench                                     # qwen3-30b-a3b, batches 1..64, all variants
    python -m tools.bench --model qwen3-30b-a3b,deepseek-v3 --batch 1,8,64 --variants 'cupy:*' --json results/h200.json
    python -m tools.bench --markdown                          # markdown tables for a PR

From IPython::

    from tools import bench
    r = bench.run("qwen3-30b-a3b", batch=[1, 8])    # renders as the rich table; r.to_json(), r.markdown()
    # edit a kernel: kernels.compile.SOURCES[...].code = ...; bench.run(...) again recompiles it

Variants come only from the registry (``kernels.variants.load_builtin()`` + ``prototypes.load()``). Without
a GPU the same command runs the CPU checks (Numba kernels on the CUDA simulator, the reference at the
``tiny`` shape, expected bytes, the offline compile report) and says that no timing was taken.

Import order matters: nothing here imports numba before the GPU check, so ``NUMBA_ENABLE_CUDASIM=1`` can
still be set when there is no GPU.
"""

from __future__ import annotations

import argparse
import fnmatch
import importlib
import importlib.util
import inspect
import io
import json
import os
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from kernels.shapes import DEFAULT_MODEL, PRESETS, get_shape
from tools import harness, report

SCHEMA = "warp-decode-bench/1"
DEFAULT_BATCHES = (1, 2, 4, 8, 16, 32, 64)
ROUTINGS = ("uniform", "zipf", "same")
DEFAULT_REPEATS = 30


# ------------------------------------------------------------------------------------------------
# The registry
# ------------------------------------------------------------------------------------------------
def load_registry() -> tuple[dict[str, Any], list[str]]:
    """Import the builtin kernel modules and the prototypes; returns ``(registry, load warnings)``."""
    from kernels import variants

    warnings = []
    for module in variants.BUILTIN_MODULES:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                warnings.append(f"{module}: {type(exc).__name__}: {exc}")
        except Exception as exc:  # noqa: BLE001 - a broken module must not stop the bench
            warnings.append(f"{module}: {type(exc).__name__}: {exc}")
    try:
        import prototypes

        prototypes.load()
    except Exception as exc:  # noqa: BLE001
        warnings.append(f"prototypes: {type(exc).__name__}: {exc}")
    return variants.REGISTRY, warnings


def select_variants(registry: dict[str, Any], patterns: Iterable[Any] | None) -> list[Any]:
    """Variants matching names or fnmatch globs (registry order); ValueError for a pattern matching none."""
    if patterns is None:
        return list(registry.values())
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
        from rich.console import Console

        console = Console(file=io.StringIO(), width=width, force_terminal=False)
        console.print(self.__rich__())
        return console.file.getvalue()

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text("BenchResult(...)" if cycle else self._text())

    def _repr_html_(self) -> str:
        from rich.console import Console

        console = Console(record=True, file=io.StringIO(), width=160)
        console.print(self.__rich__())
        return console.export_html(inline_styles=True)

    def __repr__(self) -> str:
        return f"BenchResult({len(self.rows)} rows, models={report.models(self.data)})"


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


def _check_args(models: list[str], batches: list[int], routing: str, repeats: int) -> None:
    if not models:
        raise ValueError("model: give at least one preset")
    for model in models:
        get_shape(model)  # ValueError naming the presets
    if not batches or any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in batches):
        raise ValueError(f"batch must be ints >= 1, got {batches!r}")
    if routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")


def run(
    model: str | Sequence[str] = DEFAULT_MODEL,
    batch: Sequence[int] = DEFAULT_BATCHES,
    variants: Sequence[Any] | None = None,
    routing: str = "uniform",
    repeats: int = DEFAULT_REPEATS,
    seed: int = 0,
    progress: bool = True,
    stages: bool = True,
    json_path: str | Path | None = None,
) -> BenchResult:
    """Measure ``variants`` (names, globs or Variant objects; default all) on ``model`` at each ``batch``.

    Without a GPU it runs the CPU checks instead (no timing). Every call compiles afresh (launches are
    built per run), so editing a ``CudaSource.code`` and calling ``run`` again measures the edited kernel.
    ``json_path``: rewritten after every (model, batch), so a run cut short still leaves its results.
    """
    models = _as_list(model)
    batches = [int(b) if isinstance(b, str) else b for b in _as_list(batch)]
    _check_args(models, batches, routing, repeats)
    gpu, why = harness.gpu_available()
    if not gpu:
        _enable_simulator()
    registry, warnings = load_registry()
    chosen = select_variants(registry, variants)
    config = {"models": models, "batches": batches, "variants": [v.name for v in chosen], "routing": routing,
              "repeats": repeats, "seed": seed, "argv": sys.argv if __name__ == "__main__" else None}
    data: dict[str, Any] = {
        "schema": SCHEMA, "synthetic": False, "environment": harness.environment(gpu), "config": config,
        "load_warnings": warnings, "rooflines": None, "results": [], "complete": False,
    }
    data["date"] = data["environment"]["date"]
    if not gpu:
        data["cpu"] = cpu_checks(models, batches, routing, seed, reason=why)
        return BenchResult(data)
    def checkpoint() -> None:
        data["crossover"] = {m: report.crossover(data, m) for m in models}
        if json_path is not None:
            BenchResult(data).to_json(json_path)

    _measure_all(data, models, batches, chosen, routing, repeats, seed, progress, stages, checkpoint)
    data["complete"] = True
    checkpoint()
    return BenchResult(data)


def _measure_all(data: dict[str, Any], models: list[str], batches: list[int], chosen: list[Any], routing: str,
                 repeats: int, seed: int, progress: bool, stages: bool, checkpoint: Any = None) -> None:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from tools import roofline

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True, disable=not progress) as bar:
        task = bar.add_task("rooflines", total=len(models) * len(batches) * len(chosen) + 1)
        data["rooflines"] = roofline.measure()
        bar.advance(task)
        l2 = data["environment"]["gpu"]["l2_bytes"]
        for model in models:
            shape = get_shape(model)
            for tokens in batches:
                bar.update(task, description=f"{model} T={tokens}: weights")
                try:
                    bench = harness.Workbench(shape, tokens, routing, seed, l2_bytes=l2)
                except Exception as exc:  # noqa: BLE001 - e.g. out of memory for this preset
                    for variant in chosen:
                        data["results"].append({"model": model, "batch": tokens, "variant": variant.name,
                                                "family": variant.family, "baseline": variant.baseline,
                                                "status": "error", "error": f"{type(exc).__name__}: {exc}",
                                                "samples_us": []})
                        bar.advance(task)
                    continue
                try:
                    for variant in chosen:
                        bar.update(task, description=f"{model} T={tokens}: {variant.name}")
                        data["results"].append(bench.measure(variant, repeats=repeats, stages=stages))
                        bar.advance(task)
                finally:
                    bench.free()
                    del bench
                if checkpoint is not None:
                    checkpoint()


# ------------------------------------------------------------------------------------------------
# The CPU path
# ------------------------------------------------------------------------------------------------
def _enable_simulator() -> None:
    """No GPU: run Numba kernels on the CUDA simulator (only effective before numba is imported)."""
    if "numba" in sys.modules and os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
        print("warning: numba was imported before the bench; the CUDA simulator may not be active", file=sys.stderr)
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"


def _simulator_selfcheck(seed: int) -> dict[str, Any]:
    name = "kernels.warp_decode_numba"
    if importlib.util.find_spec(name) is None:
        return {"status": "absent", "message": f"{name} is not in the repository yet", "cases": []}
    try:
        module = importlib.import_module(name)
        check = getattr(module, "simulator_selfcheck", None)
        if check is None:
            return {"status": "absent", "message": f"{name}.simulator_selfcheck is not defined yet", "cases": []}
        accepted = inspect.signature(check).parameters
        kwargs = {"seed": seed} if "seed" in accepted else {}
        outcome = check(**kwargs)
    except Exception as exc:  # noqa: BLE001 - report it, no traceback
        return {"status": "error", "message": f"{type(exc).__name__}: {exc}", "cases": []}
    if isinstance(outcome, dict):
        cases = [{"case": key, **value} if isinstance(value, dict) else {"case": key, "ok": bool(value)}
                 for key, value in outcome.items()]
    else:
        cases = [dict(case) for case in outcome]
    for case in cases:  # the selfcheck's own key names vary: pick the rel-L2 and ulp figures for the table
        rel = next((k for k in case if "rel_l2" in k), None)
        ulp = next((k for k in case if "ulp" in k), None)
        case.setdefault("rel_l2", case.get(rel) if rel else None)
        case.setdefault("ulp", case.get(ulp) if ulp else None)
    ok = bool(cases) and all(bool(c.get("ok")) for c in cases)
    return {"status": "ok" if ok else "failed", "cases": _plain(cases)}


def _plain(value: Any) -> Any:
    """JSON-ready copy (numpy scalars to Python, unknown objects to str)."""
    return json.loads(json.dumps(value, default=_json_default))


def _reference_checks(batches: list[int], routing: str, seed: int) -> list[dict[str, Any]]:
    from kernels.numerics import max_abs, rel_l2
    from kernels.problem import make_problem
    from kernels.reference import moe_decode

    rows = []
    for tokens in batches:
        problem = make_problem("tiny", tokens, seed, routing)
        oracle = moe_decode(*problem.arrays, mode="fp64")
        for mode, quant in (("warp_decode", None), ("classical", None), ("classical", "fp8"), ("classical", "mxfp8")):
            out = moe_decode(*problem.arrays, mode=mode, quant=quant).astype("float64")
            rows.append({"mode": mode + (f"+{quant}" if quant else ""), "batch": tokens,
                         "rel_l2": rel_l2(out, oracle), "max_abs": max_abs(out, oracle)})
    return rows


def _expected_bytes(models: list[str], batches: list[int], routing: str, seed: int) -> list[dict[str, Any]]:
    from kernels.routing import make_routing

    rows = []
    for model in models:
        shape = get_shape(model)
        for tokens in batches:
            ids, _ = make_routing(tokens, shape.experts, shape.top_k, routing, seed)
            b = harness.bytes_breakdown(shape, ids)
            rows.append({"model": model, "batch": tokens, "bytes": b, "us_at_4_8_tbps": b["weights"] / 4.8e12 * 1e6})
    return rows


def _inspect_report() -> str | None:
    if importlib.util.find_spec("tools.inspect") is None:
        return "offline compile report: tools/inspect.py is not in the repository yet"
    try:
        from rich.console import Console

        import tools.roofline  # noqa: F401 - registers the roofline source so it is listed
        from tools import inspect as offline

        rendered = offline.render(offline.collect())
        if isinstance(rendered, str):
            return rendered
        console = Console(file=io.StringIO(), width=160)
        console.print(rendered)
        return console.file.getvalue()
    except Exception as exc:  # noqa: BLE001
        return f"offline compile report failed: {type(exc).__name__}: {exc}"


def cpu_checks(models: list[str], batches: list[int], routing: str, seed: int, reason: str) -> dict[str, Any]:
    """Everything the bench can do without a GPU (simulator, reference, bytes, compile report)."""
    return {
        "reason": f"no CUDA GPU ({reason})",
        "simulator": _simulator_selfcheck(seed),
        "reference": _reference_checks([b for b in batches if b <= 64] or [1], routing, seed),
        "expected_bytes": _expected_bytes(models, batches, routing, seed),
        "inspect": _inspect_report(),
    }


# ------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------
def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of ints like 1,2,4, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"batch sizes must be ints >= 1, got {text!r}")
    return values


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tools.bench",
                                     description="Time registered MoE decode variants against the measured roofline.")
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"comma list of presets, or 'all' (every preset but tiny); default {DEFAULT_MODEL}; "
                             f"known: {', '.join(PRESETS)}")
    parser.add_argument("--batch", type=_int_list, default=list(DEFAULT_BATCHES),
                        help="comma list of batch sizes (default 1,2,4,8,16,32,64)")
    parser.add_argument("--variants", default=None, help="comma list of variant names or globs (default: all)")
    parser.add_argument("--routing", choices=ROUTINGS, default="uniform")
    parser.add_argument("--repeats", type=_positive, default=DEFAULT_REPEATS, help="timed samples per point")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", help="write every raw sample + the environment here")
    parser.add_argument("--markdown", action="store_true", help="print markdown tables (for a PR) instead")
    parser.add_argument("--no-stages", action="store_true", help="skip per-stage timing")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    models = [m for m in PRESETS if m != "tiny"] if args.model == "all" else _as_list(args.model)
    unknown = [m for m in models if m not in PRESETS]
    if unknown or not models:
        parser.error(f"--model: unknown preset(s) {unknown or args.model!r}; known: {', '.join(PRESETS)}")
    gpu, _ = harness.gpu_available()
    if not gpu:
        _enable_simulator()  # before anything below imports numba
    patterns = _as_list(args.variants) if args.variants is not None else None
    if patterns is not None:
        if not patterns:
            parser.error("--variants: give at least one name or glob")
        registry, _ = load_registry()
        try:
            select_variants(registry, patterns)
        except ValueError as exc:
            parser.error(f"--variants: {exc}")
    result = run(models, args.batch, patterns, args.routing, args.repeats, args.seed, stages=not args.no_stages,
                 json_path=args.json)
    if args.json:
        result.to_json(args.json)
    if args.markdown:
        sys.stdout.write(result.markdown())
    else:
        from rich.console import Console

        Console(width=None if sys.stdout.isatty() else 200).print(result)
    if args.json:
        print(f"wrote {args.json}", file=sys.stderr)
    cpu = result.data.get("cpu")
    if cpu and cpu["simulator"]["status"] in ("failed", "error"):
        print(f"simulator self-check {cpu['simulator']['status']}: {cpu['simulator'].get('message', '')}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
