"""``python -m tools.decode``: tokens per second of a whole Qwen3-MoE decode step, one CUDA graph, against the memory
roofline and the step's own read floor measured in the same run.

    python -m tools.decode --model qwen3-30b-a3b --tokens 1,4 --context 2048,8192 --moe warp-decode,strict
    python -m tools.decode --format fp8-block128 --moe warp-decode,expert-centric --json run.json
    python -m tools.peers.decode --moe warp-decode,triton-peer --torch   # the peers extra: the Triton MoE, PyTorch

Per point (model, format, T, C, MoE path) on a GPU: the step (:mod:`kernels.decode.step`) is built once on a model of
``--layers`` distinct generated layer copies cycled through the preset's layer count (the bytes a step reads are the
full model's; the distinct copies stay far past the L2; the output says how many), captured as one CUDA graph, run
once as a smoke check (tokens in range, hidden finite; no reference at real width: a timing run), then timed: warm-up
outside, each sample ``--inner`` replays between CUDA events after the lengths are reset to C (so the context stays
within C .. C + inner), median and min-max over ``--repeats`` samples. Each block (attention projections, attention,
router, MoE, LM head, norms/other) is timed alone the same way. The streaming-read roofline (``tools.roofline``) and
the step's read floor -- its kernels reduced to their reads: a streaming read (16-byte loads, no PDL) per launch of
the step with that launch's bytes, chained in one graph -- are measured in the same process. The peers extra runs
this tool as ``python -m tools.peers.decode`` (:class:`Extras`): the MoE path "triton-peer" and ``--torch``, the
PyTorch-composed step (``tools/peers/torch_step.py``: cuBLAS, SDPA, torch top-k, the Triton peer's MoE), in the same
tables; nothing here imports them. Without a GPU it runs the reference step at ``tiny`` (fp64 oracle vs the bf16
mode, rel-L2 per step), prints the bytes of every requested point, and says NO TIMING TAKEN and why.

JSON (``--json``; name runs as results/ does: ``results/h200-<date>-decode-<what>.json``): the environment, the
rooflines, per point the samples, blocks, bytes and floor; or the CPU checks.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kernels.decode.accounting import BLOCKS, WEIGHT_FORMATS, launch_plan, step_bytes
from kernels.shapes import PRESETS, get_shape
from tools.cli import examples, int_list, positive_int

SCHEMA = "warp-decode-decode/1"
MOES = ("warp-decode", "strict", "expert-centric")
DECODER_MODELS = tuple(name for name, shape in PRESETS.items() if shape.has_attention)
DEFAULT_LAYERS = 4  # distinct layer copies generated (cycled through the preset's layers)
CPU_MODEL = "tiny"
CPU_STEPS = 4
HEADROOM = 64  # cache positions past C + the replays of one sample


@dataclass(frozen=True)
class Extras:
    """What another program adds to this one (``tools.peers.decode``): its ``prog`` name, MoE paths by name (each a
    function giving the step's ``moe`` hook, or None and why it cannot run) and a composed step
    (``composed(device_model, model, tokens, context, repeats, inner, seed) -> row``, behind ``--torch``)."""

    prog: str = "python -m tools.decode"
    moes: dict[str, Callable[[], tuple[Any, str | None]]] = field(default_factory=dict)
    composed: Callable[..., dict[str, Any]] | None = None


NO_EXTRAS = Extras()


def _now() -> float:
    return time.perf_counter()


# ------------------------------------------------------------------------------------------------
# Arguments
# ------------------------------------------------------------------------------------------------
def _names(text: str, allowed: Sequence[str], what: str) -> list[str]:
    items = [item.strip() for item in text.split(",")]
    if not all(items):
        raise argparse.ArgumentTypeError(f"expected a comma list of {what}, got {text!r} (an empty item)")
    unknown = [item for item in items if item not in allowed]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown {what} {', '.join(map(repr, unknown))}; known: {', '.join(allowed)}")
    return list(dict.fromkeys(items))


def model_list(text: str) -> list[str]:
    """A comma list of the presets that carry a decoder (qwen3-30b-a3b, qwen3-235b-a22b, tiny)."""
    return _names(text, DECODER_MODELS, "decoder presets")


def moe_list(text: str, extras: Extras = NO_EXTRAS) -> list[str]:
    """A comma list of MoE paths (:data:`MOES` and the extras')."""
    return _names(text, (*MOES, *extras.moes), "MoE paths")


def format_list(text: str) -> list[str]:
    return _names(text, WEIGHT_FORMATS, "weight formats")


def knob_setting(text: str) -> tuple[str, str, list[int]]:
    """``ROLE.KNOB=V1,V2,...`` -> (role, knob, values): a kernel of the step (kernels.decode.step.KERNEL_ROLES), one
    of its knobs (kernel_knob_limits) and ints inside the knob's range."""
    from kernels.decode.step import kernel_knob_limits

    name, sep, values_text = text.partition("=")
    role, dot, knob = name.partition(".")
    if not sep or not dot or not knob or not values_text:
        raise argparse.ArgumentTypeError(f"expected KERNEL.KNOB=V1,V2,..., got {text!r}")
    try:
        limits = kernel_knob_limits(role)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if knob not in limits:
        raise argparse.ArgumentTypeError(f"{role} has no knob {knob!r}; its knobs: {', '.join(sorted(limits))}")
    try:
        values = [int(v) for v in values_text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{role}.{knob}: values must be ints, got {values_text!r}") from None
    lo, hi = limits[knob]
    outside = [v for v in values if not lo <= v <= hi]
    if outside:
        raise argparse.ArgumentTypeError(f"{role}.{knob}: {outside} outside [{lo}, {hi}]")
    return role, knob, list(dict.fromkeys(values))


def knob_settings(knobs: Sequence[tuple[str, str, list[int]]]) -> list[dict[str, dict[str, int]]]:
    """Every combination of the ``--knob`` values, as build_step's kernel_knobs ([{}] without any)."""
    settings: list[dict[str, dict[str, int]]] = [{}]
    for role, knob, values in knobs:
        settings = [{**s, role: {**s.get(role, {}), knob: v}} for s in settings for v in values]
    return settings


def knob_label(kernel_knobs: dict[str, dict[str, int]] | None) -> str:
    """``attention.SPLIT=32 qkv.UNROLL=4`` for a point's kernel_knobs ('' for the defaults)."""
    return " ".join(f"{role}.{knob}={v}" for role, knobs in (kernel_knobs or {}).items() for knob, v in knobs.items())


def _label(row: dict[str, Any]) -> str:
    """A point's MoE path and, where set, its kernel knobs."""
    knobs = knob_label(row.get("kernel_knobs"))
    return f"{row['moe']} [{knobs}]" if knobs else str(row["moe"])


def build_parser(extras: Extras = NO_EXTRAS) -> argparse.ArgumentParser:
    moes = (*MOES, *extras.moes)
    parser = argparse.ArgumentParser(
        prog=extras.prog, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Time a whole decode step (one CUDA graph) against the roofline and the step's read floor "
                    "(without a GPU: the reference step at tiny, no timing).",
        epilog=examples(
            f"{extras.prog}                          # qwen3-30b-a3b, T=1, C=2048, bf16, warp-decode",
            f"{extras.prog} --tokens 1,4 --context 2048,8192 --moe {','.join(moes)}",
            f"{extras.prog} --format fp8-block128 --json run.json"
            + (" --torch" if extras.composed is not None else ""),
            f"{extras.prog} --model qwen3-235b-a22b --layers 8   # 8 distinct copies cycled through 94"))
    parser.add_argument("--model", type=model_list, default=["qwen3-30b-a3b"],
                        help="comma list of decoder presets (default qwen3-30b-a3b); known: "
                             + ", ".join(DECODER_MODELS))
    parser.add_argument("--tokens", type=int_list, default=[1], metavar="T,...",
                        help="comma list of batch sizes T (sequences, one token each; default 1)")
    parser.add_argument("--context", type=int_list, default=[2048], metavar="C,...",
                        help="comma list of context lengths C (positions each cache holds before the step; "
                             "default 2048)")
    parser.add_argument("--format", type=format_list, default=["bf16"], metavar="FMT,...",
                        help=f"weight formats ({', '.join(WEIGHT_FORMATS)}; default bf16)")
    parser.add_argument("--moe", type=lambda text: moe_list(text, extras), default=["warp-decode"], metavar="PATH,...",
                        help=f"MoE paths in the step ({', '.join(moes)}; default warp-decode)")
    if extras.composed is not None:
        parser.add_argument("--torch", action="store_true",
                            help="also time the PyTorch-composed step (default: not)")
    parser.add_argument("--knob", type=knob_setting, action="append", default=[], metavar="KERNEL.KNOB=V,...",
                        help="a knob of one of the step's kernels (qkv, o, lm_head, rope, attention, router), with "
                             "the values to measure; repeatable: every combination is a point (default: the "
                             "kernels' own choice)")
    parser.add_argument("--layers", type=positive_int, default=None, metavar="N",
                        help=f"distinct layer copies generated, cycled through the preset's layers (default "
                             f"{DEFAULT_LAYERS}, at most the preset's)")
    parser.add_argument("--repeats", type=positive_int, default=20, metavar="N",
                        help="timed samples per point (default %(default)s)")
    parser.add_argument("--inner", type=positive_int, default=5, metavar="N",
                        help="graph replays per sample (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights, caches and tokens (default 0)")
    parser.add_argument("--json", metavar="PATH", help="write the run's record here (default: not written)")
    parser.add_argument("--markdown", metavar="RUN.json",
                        help="print a recorded run's tables as markdown (for results/REPORT.md) and exit (default: "
                             "measure)")
    return parser


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------
# Without a GPU: the reference step at tiny
# ------------------------------------------------------------------------------------------------
def cpu_checks(steps: int = CPU_STEPS, seed: int = 0, progress: Callable[[str], None] = _progress) -> dict[str, Any]:
    """``steps`` greedy steps of the reference at ``tiny`` in both modes from one state, the bf16 mode fed the
    oracle's tokens: per step the rel-L2 of the bf16 hidden and logits against fp64 and whether the tokens agree."""
    from kernels.decode_reference import decode_step, make_model, new_state
    from kernels.numerics import rel_l2

    model = make_model(CPU_MODEL, seed)
    oracle = new_state(model, [5, 9, 2], mode="fp64", seed=seed)
    faithful = oracle.to_mode("bf16")
    tokens = np.random.default_rng(seed).integers(0, model.config.vocab_size, size=3)
    rows = []
    for index in range(steps):
        started = _now()
        ref = decode_step(model, tokens, oracle)
        got = decode_step(model, tokens, faithful)
        rows.append({"step": index, "rel_l2_hidden": rel_l2(got.hidden.astype(np.float64), ref.hidden),
                     "rel_l2_logits": rel_l2(got.logits.astype(np.float64), ref.logits),
                     "tokens_agree": int((got.next_tokens == ref.next_tokens).sum()), "tokens": len(tokens),
                     "seconds": _now() - started})
        progress(f"reference step {index} at {CPU_MODEL}: bf16 vs fp64 rel-L2 hidden {rows[-1]['rel_l2_hidden']:.2e}, "
                 f"logits {rows[-1]['rel_l2_logits']:.2e}, tokens {rows[-1]['tokens_agree']}/{len(tokens)} agree")
        tokens = ref.next_tokens
    return {"model": CPU_MODEL, "steps": rows}


def bytes_rows(models: Sequence[str], tokens: Sequence[int], contexts: Sequence[int],
               formats: Sequence[str]) -> list[dict[str, Any]]:
    """The bytes of every requested point (expected distinct experts under uniform routing)."""
    return [step_bytes(m, t, c, f).as_dict() for m in models for f in formats for t in tokens for c in contexts]


# ------------------------------------------------------------------------------------------------
# On a GPU
# ------------------------------------------------------------------------------------------------
def summary(samples: list[float]) -> dict[str, float]:
    return {"median_us": statistics.median(samples), "min_us": min(samples), "max_us": max(samples)}


def time_graph(fn: Callable[[], None], repeats: int, inner: int,
               reset: Callable[[], None] | None = None) -> list[float]:
    """µs per call of ``fn`` (its launches captured as one CUDA graph): a warm-up replay, then ``repeats`` samples of
    ``inner`` replays between CUDA events, ``reset`` (outside the events) before each sample."""
    import cupy

    from tools.gpu import capture
    from tools.roofline import time_graph_replays

    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        if reset:
            reset()
        fn()  # compile, first touch: outside the graph
    stream.synchronize()
    return time_graph_replays(capture(stream, fn), stream, repeats, inner, reset)


def read_floor(plan: Sequence[Any], repeats: int, inner: int, source_bytes: int = 4 << 30) -> list[float]:
    """µs of the step's kernels reduced to their reads: per planned launch one ``stream_read`` (tools.roofline: 16-byte
    loads, no PDL) of that launch's bytes (at least one 16-byte chunk per thread of a block), each from the next
    window of a ``source_bytes`` buffer (cycling, so the reads stay out of the L2), chained in one graph."""
    import cupy

    from kernels.compile import get_kernel
    from tools.roofline import BLOCKS_PER_SM, ROOFLINE_SOURCE, THREADS_PER_BLOCK

    read = get_kernel(ROOFLINE_SOURCE, "stream_read")
    sms = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["multiProcessorCount"]
    free, _ = cupy.cuda.runtime.memGetInfo()
    source_bytes = max(1 << 20, min(source_bytes, int(free * 0.5)) // (1 << 20) * (1 << 20))
    source = cupy.empty(source_bytes // 4, dtype=cupy.uint32)
    source.fill(0x01020304)
    sink = cupy.zeros(1, dtype=cupy.uint32)
    reads = []
    offset = 0
    for launch in plan:
        n16 = max(THREADS_PER_BLOCK, int(launch.nbytes) // 16)
        nbytes = min(n16 * 16, source_bytes)
        if offset + nbytes > source_bytes:
            offset = 0
        view = source[offset // 4:(offset + nbytes) // 4]
        grid = max(1, min(BLOCKS_PER_SM * sms, -(-(nbytes // 16) // THREADS_PER_BLOCK)))
        reads.append((view, cupy.uint64(nbytes // 16), grid))
        offset += -(-nbytes // 4096) * 4096

    def body() -> None:
        for view, n16, grid in reads:
            read((grid,), (THREADS_PER_BLOCK,), (view, n16, sink))

    try:
        return time_graph(body, repeats, inner)
    finally:
        del source


def _moe_hook(moe: str, extras: Extras) -> tuple[Any, str | None]:
    """The step's ``moe`` argument for a path name: the name, or an extra's hook (None and why when it cannot run)."""
    return extras.moes[moe]() if moe in extras.moes else (moe, None)


def measure_point(device_model: Any, model: Any, tokens: int, context: int, moe: str, repeats: int, inner: int,
                  roof_tbps: float | None, seed: int, progress: Callable[[str], None],
                  extras: Extras = NO_EXTRAS, kernel_knobs: dict[str, dict[str, int]] | None = None) -> dict[str, Any]:
    """One (T, C, MoE, kernel knobs) point on an uploaded model: smoke check, step and blocks timed, read floor,
    bytes."""
    import cupy

    from kernels.decode.step import DeviceState, build_step, moe_stage_names

    row: dict[str, Any] = {"tokens": tokens, "context": context, "moe": moe, "status": "ok"}
    if kernel_knobs:
        row["kernel_knobs"] = kernel_knobs
    hook, why_not = _moe_hook(moe, extras)
    if hook is None:
        return {**row, "status": "skipped", "error": why_not}
    capacity = context + inner + HEADROOM
    state = DeviceState.random(device_model, [context] * tokens, capacity, seed)
    lengths0 = state.lengths.copy()
    step = build_step(device_model, state, tokens, moe=hook, kernel_knobs=kernel_knobs)
    moe = _label(row)  # the progress lines' name of the point
    step.set_tokens(np.random.default_rng(seed).integers(0, model.config.vocab_size, size=tokens))

    def reset() -> None:
        state.lengths[...] = lengths0

    progress(f"  T={tokens} C={context} {moe}: smoke run")
    reset()
    step.run()
    cupy.cuda.runtime.deviceSynchronize()
    out = step.read_back(hidden=True, routing=True)
    in_range = bool(((out.next_tokens >= 0) & (out.next_tokens < model.config.vocab_size)).all())
    finite = bool(np.isfinite(out.hidden.astype(np.float32)).all())
    unique = [len(np.unique(ids)) for ids in out.topk_ids]
    row["smoke"] = {"tokens_in_range": in_range, "hidden_finite": finite}
    if not (in_range and finite):
        row["status"] = "failed"
    sb = step_bytes(model.config, tokens, context, device_model.weight_format, unique_experts=unique,
                    layers=device_model.step_layers)
    row["bytes"] = sb.as_dict()
    progress(f"  T={tokens} C={context} {moe}: timing the step ({repeats} x {inner} replays)")
    samples = time_graph(step.run, repeats, inner, reset)
    row.update(samples_us=samples, **summary(samples), kernels=len(step.launches),
               kernels_per_layer=step.kernels_per_layer())
    row["tokens_per_s"] = tokens / (row["median_us"] * 1e-6)
    row["blocks"] = {}
    for block, fn in step.blocks():
        progress(f"  T={tokens} C={context} {moe}: timing the block {block!r} alone")
        block_samples = time_graph(fn, repeats, inner, reset)
        nbytes = sb.blocks[block]
        median = statistics.median(block_samples)
        row["blocks"][block] = {"samples_us": block_samples, **summary(block_samples), "bytes": nbytes,
                                "pct_roof": _pct(nbytes, median, roof_tbps)}
    progress(f"  T={tokens} C={context} {moe}: the read floor ({len(step.launches)} streaming reads in one graph)")
    plan = launch_plan(model.config, tokens, context, moe_stage_names(step), device_model.weight_format, unique,
                       device_model.step_layers)
    floor = read_floor(plan, repeats, inner)
    row["read_floor"] = {"samples_us": floor, **summary(floor), "kernels": len(plan)}
    row["pct_roof"] = _pct(sb.total, row["median_us"], roof_tbps)
    row["pct_floor"] = 100.0 * statistics.median(floor) / row["median_us"]
    return row


def _pct(nbytes: float, us: float, roof_tbps: float | None) -> float | None:
    if not roof_tbps or us <= 0:
        return None
    return 100.0 * nbytes / (us * 1e-6) / 1e12 / roof_tbps


def gpu_run(args: argparse.Namespace, data: dict[str, Any], progress: Callable[[str], None],
            checkpoint: Callable[[], None], extras: Extras = NO_EXTRAS) -> None:
    import cupy

    from kernels.decode.step import DeviceModel
    from kernels.decode_reference import make_model
    from tools import roofline

    progress("measuring the streaming-read roofline")
    data["rooflines"] = roofline.measure()
    roof = data["rooflines"].get("read_tbps")
    progress(f"streaming-read roofline: {roof:.2f} TB/s")
    for name in args.model:
        shape = get_shape(name)
        distinct = min(args.layers or DEFAULT_LAYERS, shape.layers)
        for fmt in args.format:
            progress(f"{name} {fmt}: generating {distinct} distinct layers (cycled through {shape.layers}) and "
                     "uploading them")
            model = make_model(name, args.seed, layers=distinct)
            device_model = DeviceModel.from_model(model, fmt, cycle_to=shape.layers)
            for tokens in args.tokens:
                for context in args.context:
                    for moe, knobs in itertools.product(args.moe, knob_settings(args.knob)):
                        point = {"model": name, "weight_format": fmt, "distinct_layers": distinct,
                                 "step_layers": shape.layers}
                        try:
                            row = measure_point(device_model, model, tokens, context, moe, args.repeats, args.inner,
                                                roof, args.seed, progress, extras, kernel_knobs=knobs)
                        except Exception as exc:  # noqa: BLE001 - one point's failure is reported, the run goes on
                            row = {"tokens": tokens, "context": context, "moe": moe, "status": "error",
                                   "error": f"{type(exc).__name__}: {exc}"}
                            if knobs:
                                row["kernel_knobs"] = knobs
                        data["points"].append({**point, **row})
                        progress(_point_line(data["points"][-1]))
                        checkpoint()
                    if getattr(args, "torch", False) and extras.composed is not None:
                        point = {"model": name, "weight_format": fmt, "distinct_layers": distinct,
                                 "step_layers": shape.layers}
                        try:
                            row = extras.composed(device_model, model, tokens, context, args.repeats, args.inner,
                                                  args.seed)
                        except Exception as exc:  # noqa: BLE001
                            row = {"tokens": tokens, "context": context, "moe": "torch", "status": "error",
                                   "error": f"{type(exc).__name__}: {exc}"}
                        data["points"].append({**point, **row})
                        progress(_point_line(data["points"][-1]))
                        checkpoint()
            del device_model
            cupy.get_default_memory_pool().free_all_blocks()


def _point_line(row: dict[str, Any]) -> str:
    head = f"{row['model']} {row['weight_format']} T={row['tokens']} C={row['context']} {_label(row)}"
    if row.get("status") != "ok" or row.get("median_us") is None:
        return f"{head}: {str(row.get('status')).upper()} {row.get('error') or row.get('smoke') or ''}".rstrip()
    extra = ""
    if row.get("pct_roof") is not None:
        extra = f", {row['pct_roof']:.0f} % of roofline, {row['pct_floor']:.0f} % of the read floor"
    return f"{head}: {row['median_us']:.1f} µs per step, {row['tokens_per_s']:.0f} tok/s{extra}"


# ------------------------------------------------------------------------------------------------
# Tables
# ------------------------------------------------------------------------------------------------
def renderables(data: dict[str, Any]) -> list[Any]:
    """Rich tables of a run: per timed point its blocks; without a GPU the reference rows and the bytes."""
    from rich.markup import escape
    from rich.table import Table

    out: list[Any] = []
    for row in data.get("points", []):
        if row.get("status") != "ok" or "blocks" not in row:
            continue
        title = (f"{row['model']} {row['weight_format']} T={row['tokens']} C={row['context']} MoE {_label(row)}: "
                 f"{row['tokens_per_s']:.0f} tok/s, {row['median_us']:.1f} µs per step "
                 f"({row['min_us']:.1f}-{row['max_us']:.1f}); {row['distinct_layers']} distinct layers cycled "
                 f"through {row['step_layers']}")
        table = Table(title=escape(title))  # a knob label's brackets are text, not markup
        for column in ("block", "MB", "µs alone", "% roof"):
            table.add_column(column, justify="left" if column == "block" else "right")
        for block in BLOCKS:
            cell = row["blocks"].get(block)
            if cell:
                pct = "-" if cell["pct_roof"] is None else f"{cell['pct_roof']:.0f}"
                table.add_row(block, f"{cell['bytes'] / 1e6:.1f}", f"{cell['median_us']:.1f}", pct)
        pct = "-" if row["pct_roof"] is None else f"{row['pct_roof']:.0f}"
        table.add_row("step", f"{row['bytes']['total'] / 1e6:.1f}", f"{row['median_us']:.1f}", pct, style="bold")
        floor = row["read_floor"]
        table.caption = (f"read floor ({floor['kernels']} streaming reads, one graph): {floor['median_us']:.1f} µs; "
                         f"the step at {row['pct_floor']:.0f} % of it")
        out.append(table)
    torch_rows = [r for r in data.get("points", []) if r.get("moe") == "torch" and r.get("status") == "ok"]
    for row in torch_rows:
        out.append(f"PyTorch-composed step {row['model']} {row['weight_format']} T={row['tokens']} C={row['context']}: "
                   f"{row['median_us']:.1f} µs, {row['tokens_per_s']:.0f} tok/s")
    cpu = data.get("cpu")
    if cpu:
        table = Table(title=f"the reference step at {cpu['reference']['model']}: bf16 mode vs the fp64 oracle")
        for column in ("step", "rel-L2 hidden", "rel-L2 logits", "tokens agree"):
            table.add_column(column, justify="right")
        for r in cpu["reference"]["steps"]:
            table.add_row(str(r["step"]), f"{r['rel_l2_hidden']:.2e}", f"{r['rel_l2_logits']:.2e}",
                          f"{r['tokens_agree']}/{r['tokens']}")
        out.append(table)
        table = Table(title="bytes per step (expected distinct experts, uniform routing)")
        for column in ("model", "format", "T", "C", *BLOCKS, "total GB"):
            table.add_column(column, justify="right")
        for b in cpu["bytes"]:
            table.add_row(b["model"], b["weight_format"], str(b["tokens"]), str(b["context"]),
                          *(f"{b['blocks'][k] / 1e6:.1f}" for k in BLOCKS), f"{b['total'] / 1e9:.3f}")
        table.caption = "MB per block"
        out.append(table)
        out.append(f"NO TIMING TAKEN: {cpu['reason']}")
    return out


def _cell(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def markdown(data: dict[str, Any]) -> str:
    """A run's record as the markdown results/REPORT.md holds: one row per point (µs per step with its spread,
    tokens/s, % of the roofline and of the step's read floor), the end-to-end speedup of the lab's step (MoE
    "warp-decode") over each other MoE path and the PyTorch-composed step at the same (model, format, T, C), and
    the blocks of each warp-decode point."""
    env = data.get("environment", {})
    roof = (data.get("rooflines") or {}).get("read_tbps")
    gpu = env.get("gpu") or {}
    lines = [f"{gpu.get('name', 'no GPU')}, streaming-read roofline {_cell(roof, '.2f')} TB/s (same run); "
             f"{data.get('config', {}).get('layers') or DEFAULT_LAYERS} distinct layer copies cycled through each "
             "model's layers", "",
             "| model | format | T | C | MoE | µs / step (min-max) | tok/s | % roof | % read floor | kernels / layer |",
             "|---|---|---:|---:|---|---:|---:|---:|---:|---:|"]
    ok = [p for p in data.get("points", []) if p.get("status") == "ok" and "median_us" in p]
    for p in ok:
        lines.append(f"| {p['model']} | {p['weight_format']} | {p['tokens']} | {p['context']} | {_label(p)} | "
                     f"{p['median_us']:.1f} ({p['min_us']:.1f}-{p['max_us']:.1f}) | {p['tokens_per_s']:.0f} | "
                     f"{_cell(p.get('pct_roof'), '.0f')} | {_cell(p.get('pct_floor'), '.0f')} | "
                     f"{p.get('kernels_per_layer', '-')} |")
    for p in data.get("points", []):
        if p.get("status") != "ok":
            lines.append(f"\n{p.get('model')} {p.get('weight_format')} T={p.get('tokens')} C={p.get('context')} "
                         f"{_label(p)}: {p.get('status')} ({p.get('error', '')})")
    groups: dict[tuple[Any, ...], dict[str, float]] = {}
    for p in ok:  # the MoE paths compared at the same kernel knobs
        key = (p["model"], p["weight_format"], p["tokens"], p["context"], knob_label(p.get("kernel_knobs")))
        groups.setdefault(key, {})[p["moe"]] = p["tokens_per_s"]
    others = sorted({moe for g in groups.values() for moe in g} - {"warp-decode"})
    if others and any("warp-decode" in g for g in groups.values()):
        lines += ["", "End to end, the lab's step (warp-decode MoE) over:", "",
                  "| model | format | T | C | " + " | ".join(others) + " |",
                  "|---|---|---:|---:|" + "---:|" * len(others)]
        for (model, fmt, tokens, context, knobs), g in groups.items():
            if "warp-decode" in g:
                ratios = [_cell(g["warp-decode"] / g[o] if o in g else None, ".2f") + ("x" if o in g else "")
                          for o in others]
                name = f"{model} [{knobs}]" if knobs else model
                lines.append(f"| {name} | {fmt} | {tokens} | {context} | " + " | ".join(ratios) + " |")
    for p in ok:
        if p["moe"] == "warp-decode" and p.get("blocks"):
            knobs = knob_label(p.get("kernel_knobs"))
            lines += ["", f"Blocks, {p['model']} {p['weight_format']} T={p['tokens']} C={p['context']}"
                      f"{f' [{knobs}]' if knobs else ''} (each timed alone):", "", "| block | MB | µs | % roof |",
                      "|---|---:|---:|---:|"]
            lines += [f"| {name} | {b['bytes'] / 1e6:.1f} | {b['median_us']:.1f} | {_cell(b.get('pct_roof'), '.0f')} |"
                      for name, b in p["blocks"].items()]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------
# Main
# ------------------------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None, extras: Extras = NO_EXTRAS) -> int:
    parser = build_parser(extras)
    args = parser.parse_args(argv)
    if args.markdown:
        try:
            record = json.loads(Path(args.markdown).read_text())
        except (OSError, ValueError) as exc:
            parser.error(f"--markdown {args.markdown}: {exc}")
        if record.get("schema") != SCHEMA:
            parser.error(f"--markdown {args.markdown}: not a {SCHEMA} record (schema {record.get('schema')!r})")
        print(markdown(record), end="")
        return 0
    if args.seed < 0:
        parser.error(f"--seed must be an int >= 0, got {args.seed}")
    for name in args.model:
        if args.layers is not None and args.layers > get_shape(name).layers:
            parser.error(f"--layers {args.layers}: {name} has {get_shape(name).layers} layers")
    _progress(f"{extras.prog}: looking for a CUDA GPU")
    from tools import display, harness

    gpu, why = harness.gpu_available()
    config = {"models": args.model, "tokens": args.tokens, "contexts": args.context, "formats": args.format,
              "moe": args.moe, "kernel_knobs": knob_settings(args.knob), "torch": getattr(args, "torch", False),
              "layers": args.layers, "repeats": args.repeats,
              "inner": args.inner, "seed": args.seed}
    data: dict[str, Any] = {"schema": SCHEMA, "environment": harness.environment(gpu), "config": config,
                            "rooflines": None, "points": [], "complete": False}

    def checkpoint() -> None:
        if args.json:
            path = Path(args.json)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(data, indent=1, default=_json_default) + "\n")

    if not gpu:
        _progress(f"no usable CUDA GPU: {why}; running the reference step at {CPU_MODEL} instead (no timing)")
        data["cpu"] = {"reason": why, "reference": cpu_checks(seed=args.seed),
                       "bytes": bytes_rows(args.model, args.tokens, args.context, args.format)}
    else:
        gpu_run(args, data, _progress, checkpoint, extras)
    data["complete"] = True
    checkpoint()
    console = display.console()
    for item in renderables(data):
        console.print(item)
    if args.json:
        print(f"wrote {args.json}", file=sys.stderr)
    failed = [p for p in data["points"] if p.get("status") in ("failed", "error")]
    return 1 if failed else 0


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return str(value)


if __name__ == "__main__":
    sys.exit(main())
