"""How much closer to the fp64 oracle warp decode is than the expert-centric path, measured.

    python -m tools.accuracy                               # all presets (minus tiny), T = 1, 8, 32
    python -m tools.accuracy --model qwen3-30b-a3b --seeds 16 --json results/accuracy.json
    python -m tools.accuracy --model tiny --seeds 2 --layers 3
    python -m tools.accuracy --weight-format fp8-block128 --layers 0   # FP8 weights: the format's error apart

Definitions (one call = one MoE layer on T tokens; y64 = reference.moe_decode(mode="fp64"), y = a path):

    rel-L2      ||y - y64||_2 / ||y64||_2 over all T x H outputs of the call
    max-abs     max |y - y64| over all T x H outputs
    min-cos     min over tokens t of cos(y[t], y64[t])
    x closer    rel-L2(path) / rel-L2(warp decode), per seed (same inputs); summarised by median [min, max]

Paths: warp decode (fp32 accumulation, one bf16 rounding of the intermediate and of the output),
expert-centric with bf16 intermediates, and with FP8 e4m3 (128-element groups) or MXFP8 activation
quantization. On a GPU the numbers come from the registered kernels (kernels.variants) where present; a
path without a kernel, and every path on a CPU, comes from the reference's matching mode (the output says
which). With ``--weight-format fp8-block128`` every path also runs on the layer's weights quantized to FP8
(warp decode FP8 = W8A16: bf16 activations, FP32 accumulation; EC fp8 = W8A8, the serving engines' design) and
each such row gives two distances: to the fp64 oracle on the dequantized weights (what the path's numerics add)
and on the original weights (format + numerics), beside the bf16 rows on the original weights (on a GPU with
``--source kernels``, from the kernels reading that format: strict FP8, W8A8 expert-centric).

The depth study (kernels.stack) runs L layers of RMSNorm + router + MoE + residual in fp64 and per path with a
bf16 residual stream, always through the reference's modes on the host; with ``--weight-format`` every path also
runs on the quantized experts, against an fp64 stack on the dequantized weights and the one on the original weights.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kernels.contract import BF16, check_inputs
from kernels.formats import FORMATS, FormatDimsError, get_format
from kernels.numerics import max_abs, min_cosine, rel_l2
from kernels.reference import moe_decode
from kernels.shapes import DEFAULT_MODEL, PRESETS, MoEShape, get_shape
from kernels.stack import PATHS, Stack, decode_input, moe_fp64, routing_mismatch, sparse_problem
from tools.cli import examples

LABELS = {  # EC = expert-centric
    "warp_decode": "warp decode",
    "batch_invariant": "batch-invariant",
    "classical": "EC bf16",
    "classical+fp8": "EC fp8",
    "classical+mxfp8": "EC mxfp8",
}
PREFERRED_VARIANTS = {
    "warp_decode": "cupy:warp-decode",
    "classical": "cupy:expert-centric",
    "classical+fp8": "cupy:expert-centric-fp8",
    "classical+mxfp8": "cupy:expert-centric-mxfp8",
}
PREFERRED_FP8 = {"warp_decode": "cupy:warp-decode-fp8", "classical+fp8": "cupy:expert-centric-w8a8"}  # fp8 weights
# kernel-only rows (source "kernels"): numerics no reference mode spells -- the batch-invariant policy's tensor-core
# grouped sums (warp decode's roundings in the tensor core's order), per weight format
KERNEL_ROWS = {"batch_invariant": {"bf16": "cupy:warp-decode-mma-grouped",
                                   "fp8-block128": "cupy:warp-decode-mma-grouped-fp8",
                                   "mxfp4": "cupy:warp-decode-mma-grouped-mxfp4"}}
DEFAULT_BATCH = (1, 8, 32)
GPU_SEEDS, CPU_SEEDS = 16, 2
CPU_EXPERTS = 8  # CPU default: routed experts per model capped at max(8, top_k) (weights cost ~2 s / 100M values)
SMALL_DIVISOR = 4  # the one-layer table's "small" width (CPU default): H and I divided by 4 (multiples of 8)
SMALL_STACK_WIDTH = (256, 128)  # the same for the depth study's "small" width (its default)
DEPTH_MARKS = (1, 2, 4, 8, 16, 32, 64)


def _host(arr: Any) -> np.ndarray:
    return np.asarray(arr.get() if hasattr(arr, "get") and not isinstance(arr, np.ndarray) else arr)


def gpu_available() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - no driver / device / CuPy
        return False


def summary(values: Sequence[float]) -> dict[str, float]:
    """median, min, max of a list (NaN-free)."""
    return {"median": float(statistics.median(values)), "min": float(min(values)), "max": float(max(values))}


# -- result -----------------------------------------------------------------------------------------------


@dataclass
class Cell:
    """One (model, T, path): per-seed distances to the fp64 oracle."""

    model: str
    tokens: int
    path: str
    source: str  # a variant name, or "reference:<mode>"
    run_shape: dict[str, int] = field(default_factory=dict)  # hidden, intermediate, experts actually run
    weight_format: str = "bf16"  # the format the weights were stored in (the variant's; the reference's is bf16)
    seeds: list[int] = field(default_factory=list)
    rel_l2: list[float] = field(default_factory=list)  # to the fp64 oracle on the weights the path read
    # a quantized format's row: to the fp64 oracle on the ORIGINAL (bf16) weights -- format + numerics
    rel_l2_original: list[float] = field(default_factory=list)
    max_abs: list[float] = field(default_factory=list)
    min_cos: list[float] = field(default_factory=list)
    ratio: list[float] = field(default_factory=list)  # rel_l2 / rel_l2(warp decode), same seed

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["summary"] = {
            "rel_l2": summary(self.rel_l2), "max_abs": summary(self.max_abs), "min_cos": summary(self.min_cos),
            "x_closer": summary(self.ratio) if self.ratio else None,
            "rel_l2_original": summary(self.rel_l2_original) if self.rel_l2_original else None,
        }
        return d


@dataclass
class DepthPath:
    """One path through one model's stack: per seed, per layer."""

    path: str
    rel_l2: list[list[float]] = field(default_factory=list)  # [seed][layer]
    routing_diff: list[list[int]] = field(default_factory=list)  # [seed][layer] tokens whose top-k set differs
    # [seed][layer] rel-L2 over the tokens routed like the fp64 stack at every layer so far (NaN: none left)
    rel_l2_same_route: list[list[float]] = field(default_factory=list)
    same_route_tokens: list[list[int]] = field(default_factory=list)  # [seed][layer] how many such tokens
    # on a quantized format's weights: rel_l2 and the routing are against the fp64 stack on the dequantized
    # weights, this [seed][layer] against the fp64 stack on the original ones (format + numerics)
    weight_format: str = "bf16"
    rel_l2_original: list[list[float]] = field(default_factory=list)

    def median_rel(self, layer: int) -> float:
        return float(statistics.median(r[layer] for r in self.rel_l2))

    def median_original(self, layer: int) -> float:
        return float(statistics.median(r[layer] for r in self.rel_l2_original))

    def mean_diff(self, layer: int) -> float:
        return float(np.mean([r[layer] for r in self.routing_diff]))

    def median_same(self, layer: int) -> float:
        values = [r[layer] for r in self.rel_l2_same_route if np.isfinite(r[layer])]
        return float(statistics.median(values)) if values else float("nan")

    def mean_same_tokens(self, layer: int) -> float:
        return float(np.mean([r[layer] for r in self.same_route_tokens]))


@dataclass
class Depth:
    model: str
    shape: dict[str, Any]  # the shape actually run (width may be reduced)
    tokens: int
    layers: int
    seeds: list[int]
    paths: dict[str, DepthPath]
    final_rms: float  # RMS of the fp64 residual stream after the last layer (median over seeds)

    def to_json(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if k != "paths"}
        d["paths"] = {
            name: {**asdict(p), "rel_l2_same_route": [[v if np.isfinite(v) else None for v in r]
                                                      for r in p.rel_l2_same_route]}
            for name, p in self.paths.items()
        }
        return d


@dataclass
class AccuracyResult:
    config: dict[str, Any]
    cells: list[Cell]
    depth: list[Depth]
    notes: list[str]
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "config": self.config, "notes": self.notes, "seconds": self.seconds,
            "layer": [c.to_json() for c in self.cells], "depth": [d.to_json() for d in self.depth],
        }

    def __rich_console__(self, console: Any, options: Any) -> Any:
        yield from render(self)

    def __repr__(self) -> str:
        c = self.config
        return (f"AccuracyResult(models={c['models']}, seeds={c['seeds']}, batch={c['batch']}, "
                f"source={c['source']!r}, cells={len(self.cells)}, depth={[d.model for d in self.depth]})")

    def show(self, width: int = 140) -> None:
        """Print the tables (what the CLI prints), e.g. in IPython."""
        from rich.console import Console

        Console(width=width).print(self)


# -- rendering --------------------------------------------------------------------------------------------


def _path_label(path: str, weight_format: str) -> str:
    """The path's label, with the weights' format when they are not bf16 (EC fp8 on fp8 weights = W8A8)."""
    return LABELS[path] if weight_format == "bf16" else f"{LABELS[path]}, {weight_format} weights"


def depth_key(path: str, weight_format: str = "bf16") -> str:
    """A depth study's key for ``path`` on ``weight_format`` weights: the path's name, ``name@format`` if quantized."""
    return path if weight_format == "bf16" else f"{path}@{weight_format}"


def _depth_label(key: str, labels: dict[str, str]) -> str:
    name, _, fmt = key.partition("@")
    return labels.get(name, name) + (f", {fmt} weights" if fmt else "")


def _depth_cell(p: DepthPath, layer: int) -> str:
    text = f"{p.median_rel(layer):.2e}"
    if p.rel_l2_original:
        text += f" (orig. {p.median_original(layer):.2e})"
    return f"{text} / {p.mean_diff(layer):.1f}"


def _ratio_text(values: list[float]) -> str:
    if not values:
        return "1 (ref)"
    s = summary(values)
    return f"{s['median']:.2f}x [{s['min']:.2f}, {s['max']:.2f}]"


def _bar(value: float, top: float, width: int = 28) -> str:
    if not np.isfinite(value) or top <= 0:
        return ""
    n = value / top * width
    full = int(n)
    part = " ▏▎▍▌▋▊▉"[int((n - full) * 8)]
    return "█" * full + (part if full < width else "")


def render(result: AccuracyResult) -> list[Any]:
    from rich.table import Table

    items: list[Any] = []
    table = Table(
        title="One MoE layer: distance to the fp64 oracle (median over seeds; x closer = rel-L2 / warp decode's)",
        caption=(f"seeds per cell: {result.config['seeds']}; model (H x I, E as run); EC = expert-centric; "
                 "source: a kernel variant, or ref = the reference's mode on the host"),
    )
    quantized = any(c.rel_l2_original for c in result.cells)
    columns = [("model", "left"), ("T", "right"), ("path", "left"), ("rel-L2", "right"), ("max-abs", "right"),
               ("min-cos", "right"), ("x closer [min, max]", "right"), ("source", "left")]
    if quantized:
        columns.insert(4, ("rel-L2 vs original weights", "right"))
    for col, just in columns:
        table.add_column(col, justify=just, no_wrap=True)  # type: ignore[arg-type]
    last = None
    for cell in result.cells:
        if last is not None and (cell.model, cell.tokens) != last:
            table.add_section()
        first = (cell.model, cell.tokens) != last
        last = (cell.model, cell.tokens)
        run = cell.run_shape
        row = [(f"{cell.model} ({run['hidden']}x{run['intermediate']}, E={run['experts']})" if first else ""),
               str(cell.tokens) if first else "", _path_label(cell.path, cell.weight_format),
               f"{statistics.median(cell.rel_l2):.2e}", f"{max(cell.max_abs):.2e}", f"{min(cell.min_cos):.6f}",
               _ratio_text(cell.ratio), "ref" if cell.source.startswith("reference:") else cell.source]
        if quantized:
            row.insert(4, f"{statistics.median(cell.rel_l2_original):.2e}" if cell.rel_l2_original
                       else f"{statistics.median(cell.rel_l2):.2e}")
        table.add_row(*row)
    items.append(table)
    for depth in result.depth:
        marks = sorted({m for m in DEPTH_MARKS if m <= depth.layers} | {depth.layers})
        t = Table(
            title=(f"Depth: {depth.model} stack, {depth.layers} layers, T = {depth.tokens}, "
                   f"H = {depth.shape['hidden']}, I = {depth.shape['intermediate']}, E = {depth.shape['experts']}, "
                   f"K = {depth.shape['top_k']}; rel-L2 of the residual stream vs the fp64 stack "
                   f"(median over {len(depth.seeds)} seeds) / tokens whose top-k differs (mean)"
                   + ("; on quantized weights vs the fp64 stack on the dequantized weights (orig.: on the "
                      "original weights)" if any(p.rel_l2_original for p in depth.paths.values()) else "")),
        )
        t.add_column("layer", justify="right")
        for name in depth.paths:
            t.add_column(_depth_label(name, LABELS), justify="right", no_wrap=True)
        for m in marks:
            t.add_row(str(m), *(_depth_cell(p, m - 1) for p in depth.paths.values()))
        items.append(t)
        t2 = Table(
            title=(f"{depth.model}: rel-L2 over the tokens routed like the fp64 stack at every layer so far "
                   "(median over seeds) / how many such tokens (mean)"),
        )
        t2.add_column("layer", justify="right")
        for name in depth.paths:
            t2.add_column(_depth_label(name, LABELS), justify="right", no_wrap=True)
        for m in marks:
            t2.add_row(str(m), *(f"{p.median_same(m - 1):.2e} / {p.mean_same_tokens(m - 1):.1f}"
                                 for p in depth.paths.values()))
        items.append(t2)
        plot = Table(title=f"{depth.model}: rel-L2 vs depth (bars linear, common scale)", show_lines=False)
        plot.add_column("layer", justify="right")
        plot.add_column("path")
        plot.add_column("rel-L2")
        top = max(p.median_rel(m - 1) for p in depth.paths.values() for m in marks)
        for m in marks:
            for i, (name, p) in enumerate(depth.paths.items()):
                value = p.median_rel(m - 1)
                plot.add_row(str(m) if i == 0 else "", _depth_label(name, LABELS), f"{_bar(value, top)} {value:.2e}")
            plot.add_section()
        items.append(plot)
    for note in result.notes:
        items.append(f"[dim]note:[/dim] {note}")
    return items


# -- measurement ------------------------------------------------------------------------------------------


def find_kernels(notes: list[str], weight_format: str = "bf16") -> dict[str, Any]:
    """path -> registered Variant (or None) that implements it on ``weight_format`` weights, preferring the cupy
    library kernels."""
    try:
        from kernels.variants import load_builtin

        registry = load_builtin()
    except Exception as exc:  # noqa: BLE001 - a broken kernel module must not stop the accuracy table
        notes.append(f"kernels.variants.load_builtin() failed ({type(exc).__name__}: {exc}); using the reference")
        return dict.fromkeys(PATHS)
    found: dict[str, Any] = {}
    for path, (mode, quant) in PATHS.items():
        matches = [v for v in registry.values() if v.reference_mode == mode and (v.quant or None) == quant
                   and v.weight_format == weight_format and not v.prototype and v.family != "auto"]
        preferred = registry.get((PREFERRED_VARIANTS if weight_format == "bf16" else PREFERRED_FP8).get(path, ""))
        if preferred is not None and preferred in matches:
            found[path] = preferred
        elif matches:
            found[path] = sorted(matches, key=lambda v: (v.backend != "cupy", v.name))[0]
        else:
            found[path] = None
    return found


class _KernelRunner:
    """Builds each variant once per Dims and runs it on a CuPy problem; returns the output on the host."""

    def __init__(self) -> None:
        self.launches: dict[tuple[str, Any], Any] = {}

    def __call__(self, variant: Any, problem: Any) -> np.ndarray:
        import cupy

        dims = check_inputs(*problem.arrays)
        key = (variant.name, dims)
        if key not in self.launches:
            self.launches[key] = variant.make(dims)
        w13, w2 = get_format(variant.weight_format).quantize(problem.w13, problem.w2)  # the variant's format
        if variant.prepack is not None:
            w13, w2 = variant.prepack(w13, w2)
        out = cupy.empty((dims.tokens, dims.hidden), dtype=cupy.uint16)
        out.fill(0x7FC0)  # NaN poison: every element must be written
        out = out.view(BF16)
        self.launches[key](problem.x, w13, w2, problem.topk_ids, problem.topk_weights, out)
        cupy.cuda.runtime.deviceSynchronize()
        host = _host(out)
        if not np.isfinite(host.astype(np.float32)).all():
            raise RuntimeError(f"{variant.name} left NaN/inf in its output (T={dims.tokens}, H={dims.hidden})")
        return host


def _capped(shape: MoEShape, experts: int | None) -> MoEShape:
    if experts is None or experts >= shape.experts:
        return shape
    return shape.with_(experts=max(experts, shape.top_k))


def _narrow(shape: MoEShape, caps: tuple[int, int]) -> MoEShape:
    hidden, intermediate = min(shape.hidden, caps[0]), min(shape.intermediate, caps[1])
    if (hidden, intermediate) == (shape.hidden, shape.intermediate):
        return shape
    return shape.with_(hidden=hidden, intermediate=intermediate)


def _shrink(shape: MoEShape) -> MoEShape:
    def div(n: int) -> int:
        return max(8, round(n / SMALL_DIVISOR / 8) * 8)

    if shape.hidden < 8 * SMALL_DIVISOR * 8:  # already small (tiny): keep
        return shape
    return shape.with_(hidden=div(shape.hidden), intermediate=div(shape.intermediate))


def _gpu_problem(shape: MoEShape, tokens: int, seed: int, w13: Any, w2: Any) -> Any:
    """``make_problem(shape, tokens, seed, xp=cupy)`` with its weights passed in (they depend on seed only)."""
    import cupy

    from kernels.problem import Problem
    from kernels.routing import make_routing

    topk_ids, topk_weights = make_routing(tokens, shape.experts, shape.top_k, "uniform", seed)
    x = decode_input(shape.hidden, tokens, seed)
    return Problem(shape, tokens, seed, "uniform", cupy.asarray(x), w13, w2,
                   cupy.asarray(topk_ids), cupy.asarray(topk_weights))


def measure_layer(
    shape: MoEShape,
    batch: Sequence[int],
    seeds: Sequence[int],
    source: str,
    kernels: dict[str, Any],
    notes: list[str],
    log: Callable[[str], None],
    paths: Sequence[str] = tuple(PATHS),
    weight_format: str = "bf16",
    format_kernels: dict[str, Any] | None = None,
    format_paths: Sequence[str] | None = None,
) -> list[Cell]:
    """Cells for one model: every T in ``batch`` x every path, each over ``seeds``; with a quantized
    ``weight_format`` every path of ``format_paths`` (default: ``paths``) again on the weights in that format
    (``format_kernels``: path -> the variant reading that format, with source "kernels"; a path without one comes
    from its reference mode)."""
    format_kernels = format_kernels if source == "kernels" else {}
    format_paths = tuple(paths) if format_paths is None else tuple(format_paths)
    runner = _KernelRunner() if source == "kernels" else None
    extra: dict[tuple[str, str], Any] = {}  # (path, format) -> the variant of a kernel-only row
    if runner is not None:
        from kernels.variants import get_variant

        extra = {(path, fmt): get_variant(name) for path, by_format in KERNEL_ROWS.items()
                 for fmt, name in by_format.items() if fmt in ("bf16", weight_format)}
    cells = {
        (T, path): Cell(shape.name, T, path,
                        kernels[path].name if runner and kernels.get(path) else f"reference:{path}",
                        {"hidden": shape.hidden, "intermediate": shape.intermediate, "experts": shape.experts},
                        weight_format=kernels[path].weight_format if runner and kernels.get(path) else "bf16")
        for T in batch for path in paths
    }
    for T in batch:
        for (path, fmt_name), variant in extra.items():
            key = (T, path) if fmt_name == "bf16" else (T, path, fmt_name)
            cells[key] = Cell(shape.name, T, path, variant.name, {"hidden": shape.hidden,
                              "intermediate": shape.intermediate, "experts": shape.experts}, weight_format=fmt_name)
    quantized = weight_format != "bf16"
    if quantized:
        fmt = get_format(weight_format)
        for T in batch:
            for path in format_paths:
                variant = (format_kernels or {}).get(path)
                cells[(T, path, fmt.name)] = Cell(shape.name, T, path,
                                                  variant.name if variant is not None else f"reference:{path}",
                                                  {"hidden": shape.hidden, "intermediate": shape.intermediate,
                                                   "experts": shape.experts}, weight_format=fmt.name)
    # with every quantized row from a kernel, the GPU also computes their fp64 oracle (no host copy of the experts)
    device_oracle = runner is not None and all((format_kernels or {}).get(p) is not None for p in format_paths)
    for seed in seeds:
        cache: dict[int, Any] = {}  # experts of this seed, shared by every T (CPU path)
        weights = problem = host = quantized_weights = None  # drop the last seed's GPU weights first
        for T in batch:
            if runner is not None:
                import cupy

                from kernels.problem import make_weights

                if weights is None:  # the GPU weights of make_problem(shape, T, seed, xp=cupy), once per seed
                    weights = make_weights(shape, seed, cupy)
                problem = _gpu_problem(shape, T, seed, *weights)
                oracle = _host(moe_fp64(*problem.arrays))
                host = None
            else:
                problem = host = sparse_problem(shape, T, seed, cache=cache)
                oracle = moe_decode(*host.arrays, mode="fp64")
            outputs: dict[str, np.ndarray] = {}
            for path in paths:
                mode, quant = PATHS[path]
                variant = kernels.get(path) if runner is not None else None
                if variant is not None:
                    outputs[path] = runner(variant, problem)  # type: ignore[misc]
                else:
                    if host is None:
                        host = problem.compact()
                    outputs[path] = moe_decode(*host.arrays, mode=mode, quant=quant)
            for (path, fmt_name), variant in extra.items():
                if fmt_name == "bf16":
                    outputs[path] = runner(variant, problem)  # type: ignore[misc]
            _record(cells, T, seed, outputs, oracle)
            if quantized and device_oracle:
                if quantized_weights is None:  # the seed's weights in the format, on the device, once
                    quantized_weights = fmt.quantize(problem.w13, problem.w2)
                q_oracle = _host(moe_fp64(problem.x, *quantized_weights, problem.topk_ids, problem.topk_weights,
                                          weight_format=fmt.name))
            elif quantized:
                if host is None:
                    host = problem.compact()
                x, w13, w2, ids, wts = host.arrays
                q13, q2 = fmt.quantize(w13, w2)  # bitwise the device quantization the kernels' runner does
                q_oracle = moe_decode(x, q13, q2, ids, wts, mode="fp64", weight_format=fmt)
            if quantized:
                q_outputs = {}
                for path in format_paths:
                    variant = (format_kernels or {}).get(path)
                    q_outputs[path] = (runner(variant, problem) if runner is not None and variant is not None else
                                       moe_decode(x, q13, q2, ids, wts, mode=PATHS[path][0], quant=PATHS[path][1],
                                                  weight_format=fmt))
                for (path, fmt_name), variant in extra.items():
                    if fmt_name == fmt.name:
                        q_outputs[path] = runner(variant, problem)  # type: ignore[misc]
                _record(cells, T, seed, q_outputs, q_oracle, fmt.name, original=oracle)
        log(f"{shape.name}: seed {seed} done")
    return list(cells.values())


def _record(cells: dict[tuple, Cell], tokens: int, seed: int, outputs: dict[str, np.ndarray], oracle: np.ndarray,
            weight_format: str | None = None, original: np.ndarray | None = None) -> None:
    """One seed's distances of every path's output into its cell (``weight_format``: the quantized rows, also
    measured against ``original``, the fp64 oracle on the original weights); ratios divide by warp decode's."""
    base = rel_l2(outputs["warp_decode"], oracle)
    for path, y in outputs.items():
        cell = cells[(tokens, path) if weight_format is None else (tokens, path, weight_format)]
        err = rel_l2(y, oracle)
        cell.seeds.append(seed)
        cell.rel_l2.append(err)
        cell.max_abs.append(max_abs(y, oracle))
        cell.min_cos.append(min_cosine(y, oracle))
        if original is not None:
            cell.rel_l2_original.append(rel_l2(y, original))
        if path != "warp_decode":
            cell.ratio.append(err / base if base > 0 else float("inf"))


def measure_depth(
    shape: MoEShape,
    layers: int,
    tokens: int,
    seeds: Sequence[int],
    log: Callable[[str], None],
    paths: Sequence[str] = tuple(PATHS),
    weight_format: str = "bf16",
) -> Depth:
    """Run the stack in fp64 and per path; rel-L2 of each path's residual stream and routing mismatches. With a
    quantized ``weight_format`` every path runs again on those weights (key :func:`depth_key`), against the fp64
    stack on the dequantized weights and, in ``rel_l2_original``, on the original ones."""
    fmt = get_format(weight_format).name
    runs = [(name, "bf16") for name in paths] + ([(name, fmt) for name in paths] if fmt != "bf16" else [])
    traces = {depth_key(name, f): DepthPath(depth_key(name, f), weight_format=f) for name, f in runs}
    rms = []
    for seed in seeds:
        stack = Stack(shape, layers, seed)
        x = stack.input(tokens)
        original = stack.run_fp64(x)
        oracles = {"bf16": original, fmt: stack.run_fp64(x, fmt) if fmt != "bf16" else original}
        rms.append(float(np.sqrt(np.mean(original.outputs[-1] ** 2))))
        for name, f in runs:
            oracle = oracles[f]
            trace = stack.run_path(x, name, weight_format=f)
            rec = traces[depth_key(name, f)]
            rec.rel_l2.append([rel_l2(y, y64) for y, y64 in zip(trace.outputs, oracle.outputs, strict=True)])
            if f != "bf16":
                rec.rel_l2_original.append([rel_l2(y, y64) for y, y64 in zip(trace.outputs, original.outputs,
                                                                              strict=True)])
            rec.routing_diff.append(
                [routing_mismatch(a, b) for a, b in zip(trace.topk_ids, oracle.topk_ids, strict=True)]
            )
            same = np.ones(tokens, bool)
            rel_same, n_same = [], []
            for y, y64, ids, ids64 in zip(trace.outputs, oracle.outputs, trace.topk_ids, oracle.topk_ids,
                                          strict=True):
                same &= np.all(np.sort(ids, axis=1) == np.sort(ids64, axis=1), axis=1)
                rel_same.append(rel_l2(y[same], y64[same]) if same.any() else float("nan"))
                n_same.append(int(same.sum()))
            rec.rel_l2_same_route.append(rel_same)
            rec.same_route_tokens.append(n_same)
        log(f"{shape.name} stack: seed {seed} done")
    shape_dict = {k: getattr(shape, k) for k in ("hidden", "intermediate", "experts", "top_k", "layers")}
    return Depth(shape.name, shape_dict, tokens, layers, list(seeds), traces, float(statistics.median(rms)))


def run(
    models: Sequence[str | MoEShape] | None = None,
    seeds: int | None = None,
    batch: Sequence[int] = DEFAULT_BATCH,
    layers: int | None = None,
    experts: int | None | str = "auto",
    stack_models: Sequence[str | MoEShape] | None = None,
    width: str = "auto",
    stack_width: str = "small",
    stack_batch: int | None = None,
    stack_seeds: int | None = None,
    source: str = "auto",
    paths: Sequence[str] | None = None,
    fallback: str = "reference",
    log: Callable[[str], None] | None = None,
    weight_format: str = "bf16",
) -> AccuracyResult:
    """Measure; returns an :class:`AccuracyResult` (``to_json()``, renders with rich).

    models        presets for the one-layer table (default: every preset but ``tiny``)
    seeds         seeds 0..seeds-1 (default 16 with a GPU, 2 without)
    batch         the T values of the one-layer table
    layers        depth of the stack (default: each model's real layer count; 0 = no depth study)
    experts       cap on routed experts per model ("auto": none with a GPU, max(8, top_k) on a CPU)
    width         "real", or "small" = H, I divided by 4 ("auto": real with a GPU, small on a CPU)
    stack_models  models of the depth study (default: ``models`` if given, else the default model)
    stack_width   "small" caps H, I at 256, 128 for the depth study (real E, K, layers); "full" = real width
    stack_batch   T of the depth study (default: max(batch))
    stack_seeds   seeds of the depth study (default: min(seeds, 4))
    source        "auto" (kernels if a GPU is present), "kernels" or "reference"
    paths         subset of PATHS to measure (warp decode is always included: the ratios divide by it)
    fallback      with source "kernels", a path without a registered kernel (for bf16 or for ``weight_format``):
                  "reference" (its reference mode on the host, on the compacted problem: slow at large presets)
                  or "skip"
    weight_format "bf16", or a quantized format (``kernels.formats``): every path also on the weights in that
                  format, against both oracles (with source "kernels", from the variants reading that format where
                  one is registered, else from the reference's modes)
    """
    start = time.perf_counter()
    log = log or (lambda _msg: None)
    notes: list[str] = []
    gpu = gpu_available()
    if source not in ("auto", "kernels", "reference"):
        raise ValueError(f"source must be 'auto', 'kernels' or 'reference', got {source!r}")
    if source == "auto":
        source = "kernels" if gpu else "reference"
    if source == "kernels" and not gpu:
        raise ValueError("source='kernels' needs a CUDA GPU; none is present")
    weight_format = get_format(weight_format).name  # ValueError names the known formats
    if paths is None:
        paths = tuple(PATHS)
    bad = [p for p in paths if p not in PATHS]
    if bad:
        raise ValueError(f"paths must be among {tuple(PATHS)}, got {bad}")
    paths = ("warp_decode", *[p for p in PATHS if p in paths and p != "warp_decode"])
    given_models = models is not None
    shapes = [get_shape(m) for m in (models if given_models else [n for n in PRESETS if n != "tiny"])]
    if seeds is None:
        seeds = GPU_SEEDS if gpu else CPU_SEEDS
        if not gpu:
            notes.append(f"no GPU: {CPU_SEEDS} seeds by default (--seeds to change)")
    if not isinstance(seeds, int) or isinstance(seeds, bool) or seeds < 1:
        raise ValueError(f"seeds must be an int >= 1, got {seeds!r}")
    batch = tuple(batch)
    if not batch or any(not isinstance(t, int) or isinstance(t, bool) or t < 1 for t in batch):
        raise ValueError(f"batch must be ints >= 1, got {batch!r}")
    if experts == "auto":
        experts = None if source == "kernels" else CPU_EXPERTS
        if experts is not None and any(_capped(s, experts) != s for s in shapes):
            notes.append(
                f"no GPU: routed experts capped at max({experts}, top_k) per model (--experts 0 for the real "
                "count); per-token numerics are unchanged, tokens just share experts more often"
            )
    if width == "auto":
        width = "real" if source == "kernels" else "small"
    if width not in ("small", "real"):
        raise ValueError(f"width must be 'small', 'real' or 'auto', got {width!r}")
    if width == "small" and any(_shrink(s) != s for s in shapes):
        notes.append(
            f"one-layer table at reduced width: H and I divided by {SMALL_DIVISOR} (rounded to multiples of 8; "
            "real K; --width real for the real width, ~10 min on 2 CPU cores)"
        )
    if experts == 0:
        experts = None
    if experts is not None and (not isinstance(experts, int) or experts < 1):
        raise ValueError(f"experts must be a positive int, 0 (no cap) or 'auto', got {experts!r}")
    if stack_width not in ("small", "real"):
        raise ValueError(f"stack_width must be 'small' or 'real', got {stack_width!r}")
    if layers is not None and (not isinstance(layers, int) or isinstance(layers, bool) or layers < 0):
        raise ValueError(f"layers must be an int >= 0, got {layers!r}")
    seed_list = list(range(seeds))

    kernels = find_kernels(notes) if source == "kernels" else dict.fromkeys(PATHS)
    format_kernels = (find_kernels(notes, weight_format) if source == "kernels" and weight_format != "bf16"
                      else dict.fromkeys(PATHS))
    format_paths = tuple(paths)
    if source == "kernels" and weight_format != "bf16":
        absent = [p for p in paths if format_kernels.get(p) is None]
        if absent and fallback == "skip":  # warp decode's row stays: the ratios divide by it
            format_paths = tuple(p for p in paths if p not in absent or p == "warp_decode")
            notes.append(f"no registered kernel reads {weight_format} weights for "
                         + ", ".join(LABELS[p] for p in absent) + f": their {weight_format} rows skipped")
        elif absent:
            notes.append(f"no registered kernel reads {weight_format} weights for "
                         + ", ".join(LABELS[p] for p in absent) + f": their {weight_format} rows come from the "
                         "reference's modes")
    if source == "kernels":
        if fallback not in ("reference", "skip"):
            raise ValueError(f"fallback must be 'reference' or 'skip', got {fallback!r}")
        missing = [p for p in paths if kernels[p] is None]
        if missing and fallback == "skip":
            dropped = [p for p in missing if p != "warp_decode"]
            paths = tuple(p for p in paths if p not in dropped)
            if dropped:
                notes.append("no registered kernel for " + ", ".join(LABELS[p] for p in dropped) + ": skipped")
            missing = [p for p in missing if p == "warp_decode"]
        if missing:
            notes.append(
                "no registered kernel for " + ", ".join(LABELS[p] for p in missing)
                + ": those rows come from the reference's modes on the host (source column)"
            )
    else:
        notes.append("one-layer numbers from the reference's modes (kernels.reference.moe_decode), not kernels")

    layer_shapes = [_shrink(_capped(s, experts)) if width == "small" else _capped(s, experts) for s in shapes]
    stack_shapes = [] if layers == 0 else [get_shape(m) for m in stack_models] if stack_models is not None else (
        shapes if given_models else [get_shape(DEFAULT_MODEL)])
    stack_runs = [_narrow(s, SMALL_STACK_WIDTH) if stack_width == "small" else s for s in stack_shapes]
    fmt = get_format(weight_format)
    for shape, run_shape in (*zip(shapes, layer_shapes, strict=True), *zip(stack_shapes, stack_runs, strict=True)):
        try:  # before any work: a format that cannot store a shape stops the run at once
            fmt.check_dims(run_shape.hidden, run_shape.intermediate)
        except FormatDimsError as exc:
            at = "" if run_shape == shape else " at the reduced width"
            raise FormatDimsError(f"{shape.name}{at}: {exc}") from None

    cells: list[Cell] = []
    for run_shape in layer_shapes:
        cells += measure_layer(run_shape, batch, seed_list, source, kernels, notes, log, paths, weight_format,
                               format_kernels, tuple(p for p in format_paths if p in paths))

    depth: list[Depth] = []
    if layers != 0:
        tokens = stack_batch or max(batch)
        if stack_seeds is None:
            stack_seeds = min(seeds, 4)
        if not isinstance(stack_seeds, int) or isinstance(stack_seeds, bool) or stack_seeds < 1:
            raise ValueError(f"stack_seeds must be an int >= 1, got {stack_seeds!r}")
        for shape, run_shape in zip(stack_shapes, stack_runs, strict=True):
            if run_shape != shape:
                notes.append(
                    f"depth study of {shape.name} at reduced width H={run_shape.hidden}, "
                    f"I={run_shape.intermediate} (real E, K and layer count; --stack-width real for real width)"
                )
            depth.append(measure_depth(run_shape, layers or shape.layers, tokens, list(range(stack_seeds)), log, paths,
                                       weight_format))
        notes.append("depth study: reference modes on the host (bf16 residual stream per path vs an fp64 stack)"
                     + (f"; every path also on {weight_format} weights" if weight_format != "bf16" else ""))

    config = {
        "models": [s.name for s in shapes], "paths": list(paths), "seeds": seeds, "batch": list(batch),
        "source": source, "weight_format": weight_format,
        "experts_cap": experts, "gpu": gpu, "layers": layers, "width": width, "stack_width": stack_width,
        "kernels": {p: (v.name if v is not None else None) for p, v in kernels.items()},
    }
    return AccuracyResult(config, cells, depth, notes, time.perf_counter() - start)


# -- CLI --------------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tools.accuracy", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=examples(
                                    "python -m tools.accuracy --model tiny --seeds 2 --layers 3   # seconds on a CPU",
                                    "python -m tools.accuracy --model qwen3-30b-a3b --seeds 16 --json "
                                    "results/accuracy.json",
                                    "python -m tools.accuracy --weight-format fp8-block128 --model tiny --layers 0",
                                    "python -m tools.accuracy --markdown-from results/accuracy-h200-2026-11-30.json",
                                ))
    p.add_argument("--model", action="append",
                   help="preset (repeat or comma-separate; 'all' = every preset; default: every preset but tiny)")
    p.add_argument("--seeds", type=int, help=f"seeds per cell (default {GPU_SEEDS} with a GPU, {CPU_SEEDS} without)")
    p.add_argument("--batch", default=",".join(map(str, DEFAULT_BATCH)), metavar="T,...",
                   help="T values, comma-separated (default %(default)s)")
    p.add_argument("--layers", type=int, help="depth-study layers (default: the model's real count; 0 = skip)")
    p.add_argument("--experts", type=int,
                   help=f"cap routed experts per model (0 = no cap; default: none with --source kernels, else "
                        f"max({CPU_EXPERTS}, top_k))")
    p.add_argument("--width", choices=("auto", "small", "real"), default="auto",
                   help="one-layer table width: small caps H, I at 1024, 512 (default auto: real with --source "
                        "kernels, small with the reference)")
    p.add_argument("--stack-width", choices=("small", "real"), default="small",
                   help="depth-study width: small caps H, I at 256, 128 (default; real E, K, layers)")
    p.add_argument("--stack-batch", type=int, help="T of the depth study (default: max of --batch)")
    p.add_argument("--stack-seeds", type=int, help="seeds of the depth study (default: min(--seeds, 4))")
    p.add_argument("--source", choices=("auto", "kernels", "reference"), default="auto",
                   help="where the outputs come from: the GPU kernels or the reference's modes on the host "
                        "(default auto: kernels with a GPU, reference without)")
    p.add_argument("--paths", help=f"comma-separated subset of {','.join(PATHS)} (warp_decode always runs; default: "
                                   "all)")
    p.add_argument("--fallback", choices=("reference", "skip"), default="reference",
                   help="GPU: a path without a kernel runs its reference mode on the host (slow) or is skipped "
                        "(default %(default)s)")
    p.add_argument("--weight-format", choices=tuple(FORMATS), default="bf16",
                   help="also run every path on the weights in this format, against both fp64 oracles "
                        "(the dequantized and the original weights; from the kernels reading that format where one "
                        "is registered and the source is kernels, else the reference's modes; default %(default)s: "
                        "the original weights only)")
    p.add_argument("--json", metavar="PATH",
                   help="write the result as JSON (with the GPU and versions; default: not written)")
    p.add_argument("--markdown-from", metavar="JSON", action="append",
                   help="print a recorded result as markdown tables and exit (repeatable: one after another; "
                        "default: measure)")
    p.add_argument("--depth-from", metavar="JSON", action="append",
                   help="with --markdown-from: append this result's depth study (repeatable; default: none)")
    p.add_argument("--update-readme", metavar="README",
                   help="with --markdown-from: replace the README's accuracy block with those tables, each file a "
                        "link relative to README (default: print them)")
    p.add_argument("--compact", action="store_true",
                   help="with --markdown-from: one row per (model, T, weight format) and a column per path, rel-L2 "
                        "and x closer only (default: a row per path with max-abs, min cosine and the seeds' range)")
    p.add_argument("--quiet", action="store_true", help="no progress lines (default: a line per step on stderr)")
    return p


MARKERS = ("<!-- accuracy:begin -->", "<!-- accuracy:end -->")
PATH_LABELS = {"warp_decode": "warp decode", "classical": "expert-centric bf16",
               "classical+fp8": "expert-centric FP8", "classical+mxfp8": "expert-centric MXFP8",
               "batch_invariant": "batch-invariant"}
COMPACT_LEGEND = (
    "Each cell: the median over seeds of one layer's rel-L2 against the fp64 oracle, and (Nx) that over warp "
    "decode's on the same seed; on quantized weights against the oracle on the dequantized weights, and (orig.) on "
    "the original ones. Max-abs, min cosine, the seeds' range and each row's kernel: "
    "`python -m tools.accuracy --markdown-from FILE`.")


def _from(source: str | None, sentence: str) -> str:
    """``sentence``, after "From SOURCE: " where the result's file is named."""
    return f"From {source}: {sentence[0].lower()}{sentence[1:]}" if source else sentence


def _compact_layer(data: dict[str, Any]) -> list[str]:
    """One row per (model, T, weight format), a column per path: median rel-L2, (x closer), orig. on quantized
    weights."""
    cells = data["layer"]
    paths = list(dict.fromkeys(cell["path"] for cell in cells))
    models = list(dict.fromkeys(cell["model"] for cell in cells))
    formats = list(dict.fromkeys(["bf16", *(cell.get("weight_format", "bf16") for cell in cells)]))
    found = {(c["model"], c["tokens"], c.get("weight_format", "bf16"), c["path"]): c for c in cells}
    keys = sorted(dict.fromkeys((m, t, f) for m, t, f, _ in found),
                  key=lambda k: (models.index(k[0]), formats.index(k[2]), k[1]))
    quantized = len(formats) > 1
    lines = ["| model | T | " + ("weights | " if quantized else "")
             + " | ".join(PATH_LABELS.get(p, p) for p in paths) + " |",
             "|---|---:|" + ("---|" if quantized else "") + "---:|" * len(paths)]
    for model, tokens, fmt in keys:
        texts = []
        for path in paths:
            cell = found.get((model, tokens, fmt, path))
            if cell is None:
                texts.append("-")
                continue
            summ = cell["summary"]
            text = f"{summ['rel_l2']['median']:.2e}"
            if summ.get("x_closer"):
                text += f" ({summ['x_closer']['median']:.2f}x)"
            if summ.get("rel_l2_original"):
                text += f", orig. {summ['rel_l2_original']['median']:.2e}"
            texts.append(text)
        lines.append(f"| {model} | {tokens} | " + (f"{fmt} | " if quantized else "") + " | ".join(texts) + " |")
    return lines


def markdown(data: dict[str, Any], layer: bool = True, compact: bool = False, source: str | None = None) -> str:
    """Markdown tables of a recorded result (``--json``): one row per (model, T, path), medians over seeds,
    then the depth study if it ran (only the depth study with ``layer=False``). ``compact``: one row per (model, T,
    weight format) and a column per path, rel-L2 and x closer only (:data:`COMPACT_LEGEND`); ``source``: the
    result's file (markdown), named at the head of each table."""
    env = data.get("environment") or {}
    gpu = (env.get("gpu") or {}).get("name") or ("a GPU" if data["config"].get("gpu") else "CPU (reference modes)")
    outputs = "the GPU kernels" if data["config"].get("gpu") else "the reference modes on the host"
    if compact:
        measured = (f"From {source}: " if source else "") + (
            f"{gpu}, {env.get('date', 'date not recorded')}, {data['config']['seeds']} seeds per row, outputs from "
            f"{outputs}.")
        lines = [measured, "", *_compact_layer(data)] if layer else []
    else:
        lines = [_from(source, f"Measured on {gpu}, {env.get('date', 'date not recorded')}: "
                               f"{data['config']['seeds']} seeds per row, outputs from {outputs}; error of one "
                               "layer's [T, H] output against the fp64 oracle; `x closer` = rel-L2(path) / "
                               "rel-L2(warp decode) on the same seed, median [min, max] over seeds."), "",
                 "| model | T | path | rel-L2 | max-abs | min cosine | x closer | source |",
                 "|---|---|---|---|---|---|---|---|"]
    if not layer:
        lines = []
    for cell in data["layer"] if layer and not compact else []:
        summ = cell["summary"]
        ratio = summ.get("x_closer")
        ratio_text = (f"{ratio['median']:.2f}x [{ratio['min']:.2f}, {ratio['max']:.2f}]" if ratio
                      else "1 (reference)")
        label = PATH_LABELS.get(cell["path"], cell["path"])
        original = summ.get("rel_l2_original")
        if cell.get("weight_format", "bf16") != "bf16":
            label += f", {cell['weight_format']} weights (vs original weights: {original['median']:.2e})"
        lines.append(f"| {cell['model']} | {cell['tokens']} | {label} | "
                     f"{summ['rel_l2']['median']:.2e} | {summ['max_abs']['median']:.2e} | "
                     f"{summ['min_cos']['min']:.6f} | {ratio_text} | {cell['source']} |")
    for depth in data.get("depth", []):
        lines += ["", _from(source, f"Error across depth, {depth['model']} ({depth['layers']} layers, "
                                    f"T = {depth['tokens']}, H x I = {depth['shape'].get('hidden')} x "
                                    f"{depth['shape'].get('intermediate')}, {len(depth['seeds'])} seeds, reference "
                                    "modes): median rel-L2 of the residual stream against the fp64 stack, and tokens "
                                    "whose top-k set differs from it."), ""]
        names = list(depth["paths"])
        if any(depth["paths"][n].get("rel_l2_original") for n in names):
            lines[-2] += (" On quantized weights: against the fp64 stack on the dequantized weights, and (orig.) on "
                          "the original weights.")
        lines.append("| layer | " + " | ".join(_depth_label(n, PATH_LABELS) for n in names) + " |")
        lines.append("|---|" + "---|" * len(names))
        for layer in sorted({0, depth["layers"] // 8, depth["layers"] // 4, depth["layers"] // 2, depth["layers"] - 1}):
            row = []
            for n in names:
                path = depth["paths"][n]
                rel = statistics.median(r[layer] for r in path["rel_l2"])
                diff = float(np.mean([r[layer] for r in path["routing_diff"]]))
                orig = (f", orig. {statistics.median(r[layer] for r in path['rel_l2_original']):.2e}"
                        if path.get("rel_l2_original") else "")
                row.append(f"{rel:.2e}{orig} ({diff:.0f} rerouted)")
            lines.append(f"| {layer + 1} | " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def _markdown_of(parser: argparse.ArgumentParser, option: str, path: str, layer: bool = True, compact: bool = False,
                 link_base: str | Path | None = None) -> str:
    """``markdown()`` of the result file ``path``; an unreadable file or one that is not a recorded result of this
    tool ends in ``parser.error`` naming ``option`` (exit 2, one line) instead of a traceback."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:  # missing, unreadable, not JSON
        parser.error(f"{option}: cannot read {path}: {' '.join(str(exc).split())}")
    if not isinstance(data, dict) or "config" not in data or ("layer" not in data and "depth" not in data):
        parser.error(f"{option}: {path} is not a result of python -m tools.accuracy --json")
    try:
        from tools.report import link

        return markdown(data, layer=layer, compact=compact, source=link(path, link_base))
    except (KeyError, TypeError, AttributeError) as exc:
        parser.error(f"{option}: {path} is not a result of python -m tools.accuracy --json "
                     f"({type(exc).__name__}: {exc})")


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.compact and not args.markdown_from:
        parser.error("--compact goes with --markdown-from")
    if args.markdown_from:
        base = Path(args.update_readme).parent if args.update_readme else None  # the runs as links from there
        text = "\n".join(_markdown_of(parser, "--markdown-from", path, compact=args.compact, link_base=base)
                         for path in args.markdown_from)
        for path in args.depth_from or []:
            text += _markdown_of(parser, "--depth-from", path, layer=False, compact=args.compact, link_base=base)
        if args.compact:
            text = COMPACT_LEGEND + "\n\n" + text
        if args.update_readme:
            from tools.report import update_readme

            try:
                update_readme(args.update_readme, text, *MARKERS)
            except (OSError, ValueError) as exc:  # no such file / no markers in it
                parser.error(f"--update-readme: {' '.join(str(exc).split())}")
        else:
            print(text)
        return 0
    if args.update_readme:
        parser.error("--update-readme goes with --markdown-from")
    if args.depth_from:
        parser.error("--depth-from goes with --markdown-from")
    models = None
    if args.model:
        names = [n.strip() for m in args.model for n in m.split(",") if n.strip()]
        if "all" in names:
            names = list(PRESETS)
        for n in names:
            if n not in PRESETS:
                parser.error(f"--model: unknown model {n!r}; presets: {', '.join(PRESETS)}")
        models = names
    try:
        batch = tuple(int(b) for b in args.batch.split(","))
    except ValueError:
        parser.error(f"--batch must be comma-separated ints, got {args.batch!r}")
    if any(b < 1 for b in batch):
        parser.error(f"--batch values must be >= 1, got {args.batch!r}")
    if args.seeds is not None and args.seeds < 1:
        parser.error(f"--seeds must be >= 1, got {args.seeds}")
    if args.layers is not None and args.layers < 0:
        parser.error(f"--layers must be >= 0, got {args.layers}")
    if args.experts is not None and args.experts < 0:
        parser.error(f"--experts must be >= 0, got {args.experts}")
    if args.stack_seeds is not None and args.stack_seeds < 1:
        parser.error(f"--stack-seeds must be >= 1, got {args.stack_seeds}")
    if args.stack_batch is not None and args.stack_batch < 1:
        parser.error(f"--stack-batch must be >= 1, got {args.stack_batch}")
    paths = None
    if args.paths:
        paths = [p.strip() for p in args.paths.split(",") if p.strip()]
        for p in paths:
            if p not in PATHS:
                parser.error(f"--paths: unknown path {p!r}; choose from {', '.join(PATHS)}")
    if args.source == "kernels" and not gpu_available():
        parser.error("--source kernels needs a CUDA GPU; none is present")
    source = args.source

    from rich.console import Console

    from tools.display import console as output_console

    console = output_console()  # a pipe or a file: as wide as the tables need
    err = Console(stderr=True)
    log = (lambda _m: None) if args.quiet else (lambda m: err.print(f"[dim]{m}[/dim]"))
    try:
        result = run(
            models, args.seeds, batch, args.layers, "auto" if args.experts is None else args.experts,
            width=args.width, stack_batch=args.stack_batch, stack_seeds=args.stack_seeds,
            stack_width=args.stack_width, paths=paths, source=source, fallback=args.fallback, log=log,
            weight_format=args.weight_format,
        )
    except FormatDimsError as exc:  # a tiled --weight-format and a model whose dims are not whole tiles
        parser.error(f"--weight-format {args.weight_format}: {exc}")
    console.print(result)
    console.print(f"[dim]{result.seconds:.1f} s[/dim]")
    if args.json:
        from tools.harness import environment

        with open(args.json, "w") as fh:
            json.dump({**result.to_json(), "environment": environment(gpu_available())}, fh, indent=1)
        console.print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
