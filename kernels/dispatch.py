"""Auto-dispatch: the fastest MoE decode path for (shape, T) on this GPU, decided without looking at the routing.

    ws = kernels.dispatch.make_workspace(dims, policy="fastest")
    out = kernels.dispatch.moe_decode(x, w13, w2, topk_ids, topk_weights, out=out, workspace=ws, policy="fastest")

Candidates: ``"cupy:warp-decode"`` (strict: one warp per (token, slot, neuron); best when few pairs share an expert),
``"cupy:warp-decode-batched"`` (each active expert's weights read once per batch), ``"cupy:warp-decode-mma"``
(batched on tensor cores: mma.sync, FP32 accumulators -- warp decode's numerics in the tensor core's summation
order), the batch-invariant pair (below: ``"cupy:warp-decode-mma-pairs"``, ``"cupy:warp-decode-mma-grouped"``)
and ``"cupy:expert-centric"`` (align, gather, grouped GEMMs, SiLU, combine: reproduces
``reference.moe_decode(mode="classical")``, four bf16 roundings). The five warp-decode paths reproduce mode
"warp_decode".

Policies (``policy=``, :data:`POLICIES`; candidates in :data:`POLICY_CANDIDATES`): ``"fastest"`` (the default), the
fastest of the six; ``"warp_decode"``, the five warp-decode paths only, keeping warp decode's numerics;
``"batch_invariant"``, a token's output bitwise the same whatever batch it rides in: the tensor-core path with the
grouped down at every T (``"cupy:warp-decode-mma-grouped"``) or its per-pair form (``"cupy:warp-decode-mma-pairs"``),
which share one numerics (``kernels.batched.mma.grouped_knobs``: a pair's gate_up dots are mma chains over
``invariant_ksplit`` fixed k ranges, a function of H and the format alone, added in range order; a column never sees
another; each pair's down row is weighted once and a token's slots are summed in slot order from 0), so switching
between them with T changes nothing. "fastest" and "warp_decode" are not
batch-invariant: they switch between paths whose sums differ (strict's lane chains, the tensor core's, the batched
downs' per-warp partials).

fp8-block128 weights (``kernels.quantize_weights(w13, w2, "fp8-block128")``) choose among the FP8 paths
(:data:`FORMAT_CANDIDATES`: ``"cupy:warp-decode-fp8"``, ``"cupy:warp-decode-batched-fp8"``,
``"cupy:warp-decode-mma-fp8"``, ``"cupy:warp-decode-mma-pairs-fp8"``, ``"cupy:warp-decode-mma-grouped-fp8"``; warp
decode's numerics on the dequantized
weights), from the same table under the format's own entries (key ``H..-K..-fp8-block128``; the H200's are measured)
or the same heuristic; ``moe_decode`` sees the format in the
weights it is given, ``make_workspace`` takes it as ``weight_format``. fp8-block128-t16 weights (the same values in
16-row tiles, ``quantize_weights(w13, w2, "fp8-block128-t16")`` or ``FP8_BLOCK128_T16.from_rows`` on loaded ones) choose
among the three tensor-core FP8 paths on tiles (:data:`FP8_T16_CANDIDATES`, entries ``H..-K..-fp8-block128-t16``),
under every policy, ``cupy:auto-fp8-t16`` being its variant; bf16-t16 weights (bf16 in the same tiles,
``quantize_weights(w13, w2, "bf16-t16")``) likewise among the three tensor-core bf16 paths on tiles
(:data:`T16_CANDIDATES`, entries ``H..-K..-bf16-t16``, ``cupy:auto-t16``). No strict path reads tiles, so dims beyond
the tensor-core kernels' limits (too many experts or pairs for the list kernel) raise a ValueError there. The
batch-invariant policy's variant is ``cupy:auto-invariant`` on bf16 and ``cupy:auto-invariant-fp8``, ``-fp8-t16`` and
``-t16`` on the other formats.

mxfp4 (nvfp4) weights choose among that format's FMA, tensor-core, per-pair and grouped paths (``cupy:auto-mxfp4``,
``cupy:auto-nvfp4``; the batch-invariant pairs ``cupy:auto-invariant-mxfp4`` / ``-nvfp4``); neither has a measured
table entry yet, so the heuristic decides (:data:`FORMAT_PATHS`). A call with the model's own layer
(``activation=``, ``b13=`` / ``b2=``: gpt-oss's) runs where the choice is batched and takes the format's FMA path
where it is strict or expert-centric (:func:`layer_choice`): only the batched families compile a layer.

The choice depends only on the shape (H, I, E, K), T, the GPU and the policy -- never on ``topk_ids``' values -- so
it never syncs with the host and a captured CUDA graph stays valid for any routing:

1. A table measured on the GPU (``python -m tools.dispatch_table --json kernels/dispatch_tables/<slug>.json``, slug =
   the device name lowercased with non-alphanumerics as '-', e.g. ``nvidia-h200``) holds, per shape and T in 1, 2, 4,
   ..., 64, every candidate's median and check status under uniform routing and under the skewed routings of
   :data:`TABLE_ROUTINGS` (``routings``). Since the routing is unknown when the path is chosen, the choice holds
   under skew: among the policy's candidates with status "ok" under every recorded routing (that can run the dims),
   the one whose WORST slowdown against that routing's fastest candidate is least wins (one routing: the fastest).
   T between points uses the nearest LOWER point (below the first: the first; above the last: the
   last). Older tables holding only a ``choice`` per point are still read (that choice if it belongs to the policy).
   A table may name variants since removed (``cupy:warp-decode-mixed``): their medians and choices are history,
   never picked.
2. Otherwise :func:`heuristic`: strict at T = 1 and when ``T * K <= E / 8``, the MMA path when ``T * K >= E``, else
   batched (FP8: the per-pair tensor-core form in strict's place, the tensor-core path in batched's); never the
   expert-centric path, never a path that cannot run the dims (:func:`batched_supported`,
   :func:`expert_centric_supported`; strict runs everything). The H200 runs behind it: notes/FINDINGS.md.

Variants ``"cupy:auto"`` (policy "fastest") and ``"cupy:auto-warp-decode"`` (no kernel family of their own: they
compose the registered variants): ``build(dims)`` decides once and returns the chosen variant's
:class:`~kernels.family.Launch` stating the chosen path's ``reference_mode`` / ``quant`` (the bench harness checks
against those) and ``facts``: ``choice``, ``choice_source`` ("table" or "heuristic"), ``policy``.
"""

from __future__ import annotations

import importlib
import json
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from kernels import batched
from kernels import warp_decode_cupy as wdc
from kernels import warp_decode_fp8 as wdf
from kernels.activation import CONTRACT_LAYER, ExpertLayer, expert_layer, kernel_layer
from kernels.contract import Dims, array_module, check_inputs
from kernels.family import Launch
from kernels.formats import BF16_T16, FP8_BLOCK128, FP8_BLOCK128_T16, MXFP4, NVFP4, format_of, get_format
from kernels.variants import Variant, get_variant, register

ec = importlib.import_module("kernels.expert_centric_path")

STRICT = "cupy:warp-decode"
BATCHED = "cupy:warp-decode-batched"
MMA = "cupy:warp-decode-mma"
EXPERT_CENTRIC = "cupy:expert-centric"
FP8 = FP8_BLOCK128.name
FP8_STRICT = "cupy:warp-decode-fp8"
FP8_BATCHED = "cupy:warp-decode-batched-fp8"
FP8_MMA = "cupy:warp-decode-mma-fp8"
MMA_GROUPED = "cupy:warp-decode-mma-grouped"
MMA_PAIRS = "cupy:warp-decode-mma-pairs"
FP8_MMA_GROUPED = "cupy:warp-decode-mma-grouped-fp8"
FP8_MMA_PAIRS = "cupy:warp-decode-mma-pairs-fp8"
FP8_T16 = FP8_BLOCK128_T16.name
FP8_T16_MMA = "cupy:warp-decode-mma-fp8-t16"
FP8_T16_MMA_PAIRS = "cupy:warp-decode-mma-pairs-fp8-t16"
FP8_T16_MMA_GROUPED = "cupy:warp-decode-mma-grouped-fp8-t16"
T16 = BF16_T16.name
T16_MMA = "cupy:warp-decode-mma-t16"
T16_MMA_PAIRS = "cupy:warp-decode-mma-pairs-t16"
T16_MMA_GROUPED = "cupy:warp-decode-mma-grouped-t16"
MX4, NV4 = MXFP4.name, NVFP4.name
MX4_BATCHED, NV4_BATCHED = "cupy:warp-decode-batched-mxfp4", "cupy:warp-decode-batched-nvfp4"
MX4_MMA = "cupy:warp-decode-mma-mxfp4"
MX4_MMA_PAIRS = "cupy:warp-decode-mma-pairs-mxfp4"
MX4_MMA_GROUPED = "cupy:warp-decode-mma-grouped-mxfp4"
NV4_MMA = "cupy:warp-decode-mma-nvfp4"
NV4_MMA_PAIRS = "cupy:warp-decode-mma-pairs-nvfp4"
NV4_MMA_GROUPED = "cupy:warp-decode-mma-grouped-nvfp4"
# the batch-invariant pair are candidates of the other policies too: the per-pair form, whose pairs sharing an expert
# read it back to back, led at qwen3-235b T = 2 by the worst case over uniform and Zipf routing, and the grouped path
# at qwen3-235b T = 4 / 8 / 16 (H200, results/h200-2026-12-02-candidates-*.json)
WARP_DECODE_CANDIDATES = (STRICT, BATCHED, MMA, MMA_PAIRS, MMA_GROUPED)
CANDIDATES = (*WARP_DECODE_CANDIDATES, EXPERT_CENTRIC)
# on FP8 weights the per-pair tensor-core form is a candidate too: it beats strict FP8 from qwen3-235b T = 1 and
# qwen3-30b T = 2 (H200, results/sweep-2026-12-02-mma-pairs-fp8-*.json); so is the grouped form, which led at
# qwen3-235b T = 4 once the FP8 paths were re-measured (139.5 vs 143.1 us uniform, 137.2 vs 136.9 Zipf)
FP8_CANDIDATES = (FP8_STRICT, FP8_BATCHED, FP8_MMA, FP8_MMA_PAIRS, FP8_MMA_GROUPED)
# fp8-block128-t16 weights: the tensor-core FP8 paths on tiles (only they read the tiled order; kernels.formats)
FP8_T16_CANDIDATES = (FP8_T16_MMA, FP8_T16_MMA_PAIRS, FP8_T16_MMA_GROUPED)
# bf16-t16 weights: the tensor-core bf16 paths on tiles
T16_CANDIDATES = (T16_MMA, T16_MMA_PAIRS, T16_MMA_GROUPED)
# 4-bit weights: each format's FMA, tensor-core, per-pair and grouped paths
MX4_CANDIDATES = (MX4_BATCHED, MX4_MMA, MX4_MMA_PAIRS, MX4_MMA_GROUPED)
NV4_CANDIDATES = (NV4_BATCHED, NV4_MMA, NV4_MMA_PAIRS, NV4_MMA_GROUPED)
BATCHED_PATHS = batched.PATHS  # variant name -> (batched family path, knobs): the batched paths
FASTEST = "fastest"
WARP_DECODE = "warp_decode"
BATCH_INVARIANT = "batch_invariant"
POLICIES = (FASTEST, WARP_DECODE, BATCH_INVARIANT)
POLICY_CANDIDATES: dict[str, tuple[str, ...]] = {FASTEST: CANDIDATES, WARP_DECODE: WARP_DECODE_CANDIDATES,
                                                 BATCH_INVARIANT: (MMA_PAIRS, MMA_GROUPED)}
# per weight format: each policy's candidates
FORMAT_CANDIDATES: dict[str, dict[str, tuple[str, ...]]] = {
    "bf16": POLICY_CANDIDATES,
    FP8: {FASTEST: FP8_CANDIDATES, WARP_DECODE: FP8_CANDIDATES, BATCH_INVARIANT: (FP8_MMA_PAIRS, FP8_MMA_GROUPED)},
    FP8_T16: {FASTEST: FP8_T16_CANDIDATES, WARP_DECODE: FP8_T16_CANDIDATES,
              BATCH_INVARIANT: (FP8_T16_MMA_PAIRS, FP8_T16_MMA_GROUPED)},
    T16: {FASTEST: T16_CANDIDATES, WARP_DECODE: T16_CANDIDATES, BATCH_INVARIANT: (T16_MMA_PAIRS, T16_MMA_GROUPED)},
    MX4: {FASTEST: MX4_CANDIDATES, WARP_DECODE: MX4_CANDIDATES, BATCH_INVARIANT: (MX4_MMA_PAIRS, MX4_MMA_GROUPED)},
    NV4: {FASTEST: NV4_CANDIDATES, WARP_DECODE: NV4_CANDIDATES, BATCH_INVARIANT: (NV4_MMA_PAIRS, NV4_MMA_GROUPED)}}
# the batch-invariant policy's (per-pair, grouped) paths per format: per-pair while pairs are few per expert
INVARIANT_PATHS: dict[str, tuple[str, str]] = {"bf16": (MMA_PAIRS, MMA_GROUPED), FP8: (FP8_MMA_PAIRS, FP8_MMA_GROUPED),
                                               FP8_T16: (FP8_T16_MMA_PAIRS, FP8_T16_MMA_GROUPED),
                                               T16: (T16_MMA_PAIRS, T16_MMA_GROUPED),
                                               MX4: (MX4_MMA_PAIRS, MX4_MMA_GROUPED),
                                               NV4: (NV4_MMA_PAIRS, NV4_MMA_GROUPED)}
# The heuristic's (few pairs, batched, MMA) paths per format, and the strict path any dims can run. FP8: the per-pair
# tensor-core form where strict would run -- on the H200 it beat strict FP8 at T = 1 / 2 on both qwen3 shapes (30b
# 18.0 / 27.1 vs 19.2 / 33.0 us, 235b 46.3 / 88.4 vs 53.8 / 104.6: results/h200-2026-12-02-fp8-paths-t1-t2-*.json)
# -- and the tensor-core path in the batched slot too (50.1 vs 58.8 us at qwen3-30b T = 4:
# results/h200-2026-12-02-fp8-paths-*.json)
FORMAT_PATHS: dict[str, tuple[str, str, str]] = {"bf16": (STRICT, BATCHED, MMA),
                                                  FP8: (FP8_MMA_PAIRS, FP8_MMA, FP8_MMA),
                                                  FP8_T16: (FP8_T16_MMA_PAIRS, FP8_T16_MMA, FP8_T16_MMA),
                                                  T16: (T16_MMA_PAIRS, T16_MMA, T16_MMA),
                                                  MX4: (MX4_MMA_PAIRS, MX4_MMA, MX4_MMA),
                                                  NV4: (NV4_MMA_PAIRS, NV4_MMA, NV4_MMA)}
# the path that runs any dims, per format; none reads tiles (dims a tiled format's tensor-core paths cannot run -- too
# many experts for the list kernel, or too many pairs -- raise, naming the row layout, whose strict path runs them)
# (4-bit weights, unmeasured: FP8's rule -- the per-pair form where strict would run, the tensor-core path
# elsewhere -- falling back on the format's FMA path, which needs no tensor-core limit)
FORMAT_STRICT: dict[str, str | None] = {"bf16": STRICT, FP8: FP8_STRICT, FP8_T16: None, T16: None, MX4: MX4_BATCHED,
                                        NV4: NV4_BATCHED}
ROW_LAYOUT: dict[str, str] = {FP8_T16: FP8, T16: "bf16"}  # a tiled format's row-major counterpart
TABLE_POINTS = (1, 2, 4, 8, 16, 32, 64)
TABLE_ROUTINGS = ("uniform", "zipf")  # what tools.dispatch_table measures; the choice is the best worst case
TABLE_DIR = Path(__file__).resolve().parent / "dispatch_tables"
SCHEMA = "warp-decode-dispatch/1"
STRICT_PAIRS_PER_EXPERT = 0.125  # heuristic: strict while T*K <= E/8 (and at T = 1)
MMA_PAIRS_PER_EXPERT = 1  # heuristic: the tensor-core batched kernels from T*K >= E (one pair per expert on average)


def check_policy(policy: Any) -> str:
    """``policy`` if it is one of :data:`POLICIES`, else ValueError naming it and the allowed values."""
    if not isinstance(policy, str) or policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    return policy


def gpu_slug(name: str) -> str:
    """File-name form of a device name: ``"NVIDIA H200"`` -> ``"nvidia-h200"``."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"a GPU name must be a non-empty string, got {name!r}")
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def shape_key(dims: Dims, weight_format: str = "bf16") -> str:
    """How a table names a shape: ``"H{hidden}-I{intermediate}-E{experts}-K{top_k}"``, with ``-{format}`` appended
    for weights in another format than bf16 (their entries hold that format's candidates)."""
    key = f"H{dims.hidden}-I{dims.intermediate}-E{dims.experts}-K{dims.top_k}"
    return key if weight_format == "bf16" else f"{key}-{weight_format}"


def check_weight_format(weight_format: Any) -> str:
    """The name of a weight format the dispatch has candidates for (:data:`FORMAT_CANDIDATES`), else ValueError."""
    name = get_format(weight_format).name
    if name not in FORMAT_CANDIDATES:
        raise ValueError(f"no dispatch candidates read weight_format {name!r}; known: {', '.join(FORMAT_CANDIDATES)}")
    return name


def key_format(key: str) -> str:
    """The weight format a table entry key names (no suffix: bf16)."""
    return next((fmt for fmt in FORMAT_CANDIDATES if fmt != "bf16" and key.endswith(f"-{fmt}")), "bf16")


# ---------------------------------------------------------------------------------------------------
# What each path can run
# ---------------------------------------------------------------------------------------------------
def batched_supported(name: str, dims: Dims) -> bool:
    """Whether the batched path ``name`` (a key of :data:`BATCHED_PATHS`) can run ``dims``."""
    try:
        get_variant(name).resolve(dims)
    except ValueError:
        return False
    return True


def expert_centric_supported(dims: Dims) -> bool:
    """Whether the expert-centric path (bf16, auto tile knobs) can run ``dims``: the checks of its
    ``make_workspace`` (E within the align kernel's shared memory, valid tile knobs for the dims)."""
    if dims.experts > ec.MAX_EXPERTS:
        return False
    try:
        ec.check_params(dims)
    except ValueError:
        return False
    return True


def supported(name: str, dims: Dims) -> bool:
    """Whether candidate ``name`` can run ``dims`` (the strict paths run every dims)."""
    if name in BATCHED_PATHS:
        return batched_supported(name, dims)
    if name == EXPERT_CENTRIC:
        return expert_centric_supported(dims)
    return name in (STRICT, FP8_STRICT)  # the strict paths run every dims


# ---------------------------------------------------------------------------------------------------
# Tables
# ---------------------------------------------------------------------------------------------------
def point_routings(point: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """A point's measurements per routing: ``{"uniform": point's own median_us / status, other routings:
    point["routings"][name]}`` (a point without ``median_us`` -- the old format -- has none)."""
    if not isinstance(point.get("median_us"), dict):
        return {}
    return {"uniform": point, **(point.get("routings") or {})}


def routing_slowdowns(point: dict[str, Any], candidates: list[str] | tuple[str, ...]) -> dict[str, dict[str, float]]:
    """Per routing the point records, per candidate with status "ok" and a median under EVERY one of them: its
    median / (that routing's fastest such candidate's median); {} when no candidate qualifies."""
    runs = point_routings(point)
    ok = [n for n in candidates if all((r.get("status") or {}).get(n) == "ok" and (r.get("median_us") or {}).get(n)
                                       for r in runs.values())]
    if not ok:
        return {}
    best = {name: min(r["median_us"][n] for n in ok) for name, r in runs.items()}
    return {name: {n: r["median_us"][n] / best[name] for n in ok} for name, r in runs.items()}


def worst_slowdowns(point: dict[str, Any], candidates: list[str] | tuple[str, ...]) -> dict[str, float]:
    """Per candidate of :func:`routing_slowdowns`: its largest slowdown over the routings."""
    per_routing = routing_slowdowns(point, candidates)
    if not per_routing:
        return {}
    names = next(iter(per_routing.values()))
    return {n: max(ratios[n] for ratios in per_routing.values()) for n in names}


def point_choice(point: dict[str, Any], policy: str = FASTEST, dims: Dims | None = None,
                 weight_format: str = "bf16") -> str | None:
    """The choice of one table point under ``policy``: among the policy's candidates for ``weight_format`` with status
    "ok" and a median under every recorded routing (and that can run ``dims`` when given), the least worst slowdown
    (:func:`worst_slowdowns`; one routing: the fastest; ties -> the alphabetically first). An old-format point
    (``choice`` only) gives its choice if it belongs to the policy (and can run the dims). None when the point
    offers nothing for this policy."""
    pool = FORMAT_CANDIDATES[check_weight_format(weight_format)][check_policy(policy)]
    candidates = [n for n in pool if dims is None or supported(n, dims)]
    if isinstance(point.get("median_us"), dict):
        worst = worst_slowdowns(point, candidates)
        return min(sorted(worst), key=lambda n: worst[n]) if worst else None
    choice = point.get("choice")
    return choice if choice in candidates else None


def registered(name: Any) -> bool:
    """Whether ``name`` is a registered variant. A table may name variants since removed (its measurements and
    choices are history): those are never candidates, so never picked."""
    try:
        get_variant(name)
    except (ValueError, TypeError):
        return False
    return True


def validate_table(table: Any) -> dict[str, Any]:
    """ValueError unless ``table`` has the layout tools.dispatch_table writes (or the older choice-only
    layout); returns it. A variant no longer registered may appear anywhere (history): it is never picked."""
    if not isinstance(table, dict) or table.get("schema") != SCHEMA:
        raise ValueError(f"a dispatch table must be a JSON object with schema {SCHEMA!r}")
    for key in ("gpu", "date", "entries"):
        if key not in table:
            raise ValueError(f"dispatch table lacks {key!r}")
    for key, entry in table["entries"].items():
        fmt = key_format(key)
        points = entry.get("points") if isinstance(entry, dict) else None
        if not isinstance(points, dict) or not points:
            raise ValueError(f"dispatch table entry {key!r} has no points")
        for tokens, point in points.items():
            where = f"dispatch table entry {key!r} T={tokens}"
            if not str(tokens).isdigit() or int(tokens) < 1:
                raise ValueError(f"dispatch table entry {key!r}: point {tokens!r} is not a batch size")
            if not isinstance(point, dict):
                raise ValueError(f"{where}: a point must be an object")
            choice = point.get("choice")  # a variant since removed (a table's history) is never picked: no error
            if "choice" in point and choice not in FORMAT_CANDIDATES[fmt][FASTEST] and registered(choice):
                raise ValueError(f"{where}: choice {choice!r} is not one of {FORMAT_CANDIDATES[fmt][FASTEST]}")
            medians = point.get("median_us")
            if medians is None:
                if "choice" not in point:
                    raise ValueError(f"{where}: a point needs median_us and status (or an old-format choice)")
                continue
            if not isinstance(point.get("routings", {}), dict):
                raise ValueError(f"{where}: routings must be an object keyed by routing name")
            for routing, run in point_routings(point).items():
                medians = run.get("median_us") if isinstance(run, dict) else None
                if not isinstance(medians, dict) or not isinstance(run.get("status"), dict):
                    raise ValueError(f"{where} ({routing}): median_us and status must be objects keyed by variant "
                                     "name")
                for name, median in medians.items():
                    if median is not None and (isinstance(median, bool) or not isinstance(median, (int, float))
                                               or not median > 0):
                        raise ValueError(f"{where} ({routing}): median_us[{name!r}] must be a positive number or "
                                         f"null, got {median!r}")
            if point_choice(point, FASTEST, weight_format=fmt) is None:
                raise ValueError(f"{where}: no candidate of {FORMAT_CANDIDATES[fmt][FASTEST]} was measured correctly "
                                 "(status 'ok' under every recorded routing)")
    return table


@lru_cache(maxsize=16)
def load_table(slug: str, directory: str = str(TABLE_DIR)) -> dict[str, Any] | None:
    """The table ``<directory>/<slug>.json``, validated; None when there is none."""
    path = Path(directory) / f"{slug}.json"
    if not path.is_file():
        return None
    return validate_table(json.loads(path.read_text()))


@lru_cache(maxsize=8)
def _device_name(device: int) -> str:
    import cupy

    name = cupy.cuda.runtime.getDeviceProperties(device)["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def current_gpu() -> str:
    """Name of the current CuPy device (a property query: no stream work, fine during capture)."""
    import cupy

    return _device_name(cupy.cuda.Device().id)


def table_point(table: dict[str, Any], dims: Dims, weight_format: str = "bf16") -> dict[str, Any] | None:
    """The table's point for ``dims`` (nearest lower measured T) in ``weight_format``'s entries, or None without an
    entry for the shape."""
    entry = table["entries"].get(shape_key(dims, weight_format))
    if entry is None:
        return None
    points = sorted(int(t) for t in entry["points"])
    lower = [t for t in points if t <= dims.tokens]
    point = lower[-1] if lower else points[0]
    return entry["points"][str(point)]


def table_choice(table: dict[str, Any], dims: Dims, policy: str = FASTEST, weight_format: str = "bf16") -> str | None:
    """The table's choice for ``dims`` under ``policy`` (a path that can run the dims), or None (no entry for
    the shape, or the point offers no runnable candidate of the policy)."""
    point = table_point(table, dims, weight_format)
    return None if point is None else point_choice(point, policy, dims, weight_format)


def heuristic(dims: Dims, policy: str = FASTEST, weight_format: str = "bf16") -> str:
    """The path for ``dims`` without a measurement (see the module docstring for the evidence), either policy:
    strict at T = 1 or when ``T * K <= E / 8``; the MMA path when ``T * K >= E``; else batched (a path that
    cannot run the dims is skipped; strict runs everything).

    Why E/8: strict reads every pair's expert, batched each active expert once but launches one more kernel
    (~2-3 us). Under uniform routing strict's extra bytes are T*K - E*(1 - (1 - K/E)**T) experts: at
    qwen3-30b T=2 ~0.5 expert (~1 us) -- strict; at T=4 ~3.4 experts (~7 us; ~28 us at qwen3-235b) -- batched.
    Why E: with a pair or more per expert the FMA kernels spend their issue slots on 2 FMAs per weight element
    per pair; the tensor core takes that work off the lanes (H200: MMA fastest from T*K/E = 1 at qwen3-30b).
    Weights in another format pick its paths by the same rule (:data:`FORMAT_PATHS`: FP8 runs its per-pair tensor-core
    form where bf16 would run strict, its tensor-core path wherever bf16 would run batched or MMA, as measured at the
    qwen3 shapes; strict FP8 where those cannot run the dims; fp8-block128-t16 and bf16-t16 the per-pair and
    tensor-core paths on tiles, a ValueError where those cannot run the dims).
    """
    check_policy(policy)
    few, batched, mma = FORMAT_PATHS[check_weight_format(weight_format)]
    pairs = dims.tokens * dims.top_k
    if policy == BATCH_INVARIANT and weight_format not in INVARIANT_PATHS:
        raise ValueError(f"no batch-invariant path reads {weight_format} weights (the policy needs a format's "
                         f"tensor-core pair; formats with one: {', '.join(INVARIANT_PATHS)})")
    if policy == BATCH_INVARIANT:  # one numerics either way: per-pair where strict would run (no lists), else grouped
        # (H200, results/h200-2026-12-01-invariant-forms-uniform.json: per-pair 27.5 vs 30.2 us at qwen3-30b T = 1 and
        # 155 vs 167 at qwen3-235b T = 2; from T*K > E/8 the grouped path wins, 68 vs 77 at qwen3-30b T = 4)
        per_pair, grouped = INVARIANT_PATHS[weight_format]
        if pairs <= STRICT_PAIRS_PER_EXPERT * dims.experts and supported(per_pair, dims):
            return per_pair
        if FORMAT_STRICT[weight_format] in BATCHED_PATHS and not supported(grouped, dims):  # (4-bit: no strict path)
            get_variant(grouped).resolve(dims)  # the kernels' own reason, a ValueError
        return _runnable(grouped, dims, weight_format)
    few_pairs = dims.tokens == 1 or pairs <= STRICT_PAIRS_PER_EXPERT * dims.experts
    if few_pairs:
        return _runnable(few, dims, weight_format)
    if pairs >= MMA_PAIRS_PER_EXPERT * dims.experts and supported(mma, dims):
        return mma
    return _runnable(batched, dims, weight_format)


def _runnable(path: str, dims: Dims, weight_format: str) -> str:
    """``path`` if it can run ``dims``, else the format's strict path; ValueError where the format has none."""
    if supported(path, dims):
        return path
    strict = FORMAT_STRICT[weight_format]
    if strict is not None:
        return strict
    try:  # what stops it: the kernels' own rule
        get_variant(path).resolve(dims)
    except ValueError as error:
        raise ValueError(f"no path reading {weight_format} weights runs {dims} (their tensor-core kernels' limits: "
                         f"{error}); use {ROW_LAYOUT[weight_format]} weights instead, whose strict path runs any "
                         "dims") from None
    raise AssertionError(f"{path} can run {dims} by its rules but was reported unsupported")  # unreachable


def choose(dims: Dims, gpu: str | None = None, table_dir: str | Path = TABLE_DIR,
           policy: str = FASTEST, weight_format: str = "bf16") -> tuple[str, str]:
    """``(variant name, "table" | "heuristic")`` for ``dims`` on ``gpu`` (default: the current device) under
    ``policy``, among the paths reading ``weight_format``."""
    check_policy(policy)
    weight_format = check_weight_format(weight_format)
    if not isinstance(dims, Dims):
        raise TypeError(f"dims must be a kernels.contract.Dims, got {type(dims).__name__}")
    if gpu is None:
        gpu = current_gpu()
    table = load_table(gpu_slug(gpu), str(table_dir))
    if table is not None:
        choice = table_choice(table, dims, policy, weight_format)
        if choice is not None:
            return choice, "table"
    return heuristic(dims, policy, weight_format), "heuristic"


# ---------------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------------
@dataclass
class Workspace:
    """The chosen path and its workspace, for one dims and policy (``make_workspace``)."""

    dims: Dims
    choice: str
    source: str
    inner: Any
    policy: str = FASTEST
    weight_format: str = "bf16"
    layer: ExpertLayer = CONTRACT_LAYER


# A layer other than the contract's (gpt-oss's activation, biases) runs on the batched families only: where the
# choice is strict or expert-centric, the format's FMA path -- strict's numerics, each expert read once.
LAYER_PATHS: dict[str, str] = {"bf16": BATCHED, FP8: FP8_BATCHED, MX4: MX4_BATCHED, NV4: NV4_BATCHED}


def layer_choice(choice: str, weight_format: str, layer: ExpertLayer) -> str:
    """``choice``, or for a layer other than the contract's a batched path (:data:`LAYER_PATHS`) in its place."""
    if layer.contract or choice in BATCHED_PATHS:
        return choice
    if weight_format not in LAYER_PATHS:
        raise ValueError(f"no batched path computes {layer.activation.name}'s layer on {weight_format} weights")
    return LAYER_PATHS[weight_format]


def make_workspace(dims: Dims, gpu: str | None = None, policy: str = FASTEST,
                   table_dir: str | Path = TABLE_DIR, weight_format: str = "bf16", activation: str = "silu",
                   biases: bool = False) -> Workspace:
    """Decide the path for ``dims`` under ``policy`` among those reading ``weight_format`` (and computing the layer
    ``activation`` / ``biases`` ask for: :func:`layer_choice`) and allocate its workspace (CuPy, current device)."""
    weight_format = check_weight_format(weight_format)
    layer = kernel_layer(activation, biases)
    choice, source = choose(dims, gpu, table_dir, policy, weight_format)
    choice = layer_choice(choice, weight_format, layer)
    if choice == EXPERT_CENTRIC:
        inner = ec.make_workspace(dims, None)
    elif choice in BATCHED_PATHS:
        path, knobs = BATCHED_PATHS[choice]
        inner = batched.make_workspace(dims, path, weight_format, layer.activation, layer.bias, **knobs)
    else:
        inner = wdc.make_workspace(dims.tokens, dims.top_k, dims.intermediate)  # strict's [T, K, I] (FP8's too)
    return Workspace(dims, choice, source, inner, policy, weight_format, layer)


def moe_decode(x: Any, w13: Any, w2: Any, topk_ids: Any, topk_weights: Any, out: Any = None,
               workspace: Workspace | None = None, policy: str = FASTEST, activation: str = "silu",
               b13: Any = None, b2: Any = None) -> Any:
    """One MoE decode layer by the fastest path of ``policy`` for this shape and T; returns ``out`` [T, H].

    ``policy="fastest"``: strict, batched, MMA, the invariant pair or expert-centric (the last reproduces
    mode "classical"); ``policy="warp_decode"``: all but expert-centric (warp decode's numerics). fp8-block128
    weights: the FP8 paths; fp8-block128-t16 (bf16-t16) weights: the tensor-core FP8 (bf16) paths on tiles. With
    ``out`` and ``workspace`` (``make_workspace(dims, policy=policy, weight_format=...)``, same policy and format)
    nothing is allocated and nothing syncs with the host during CUDA-graph capture (outside capture the chosen path
    checks the ids' range, as every path does).
    """
    check_policy(policy)
    xp = array_module(x)
    if xp.__name__ == "numpy":
        raise TypeError("x must be a cupy.ndarray (moe_decode runs on the GPU; reference.moe_decode is the host "
                        "version)")
    weight_format = format_of(w13)
    layer = expert_layer(activation, b13, b2)
    dims = check_inputs(x, w13, w2, topk_ids, topk_weights, check_values=False, weight_format=weight_format, b13=b13,
                        b2=b2)
    if workspace is None:
        workspace = make_workspace(dims, policy=policy, weight_format=weight_format, activation=layer.activation,
                                   biases=layer.bias)
    elif not isinstance(workspace, Workspace):
        raise TypeError(f"workspace must come from kernels.dispatch.make_workspace(), got {type(workspace).__name__}")
    elif workspace.dims != dims:
        raise ValueError(f"workspace was made for {workspace.dims}, this call needs {dims}")
    elif workspace.policy != policy:
        raise ValueError(f"workspace was made under policy {workspace.policy!r}, this call uses policy {policy!r}: "
                         "pass the same policy to make_workspace and moe_decode")
    elif workspace.weight_format != weight_format:
        raise ValueError(f"workspace was made for {workspace.weight_format} weights, this call passes "
                         f"{weight_format} weights: make it with make_workspace(dims, weight_format={weight_format!r})")
    elif workspace.layer != layer:
        raise ValueError(f"workspace was made for the layer {workspace.layer.activation.name!r} "
                         f"{'with' if workspace.layer.bias else 'without'} biases, this call asks for "
                         f"{layer.activation.name!r} {'with' if layer.bias else 'without'}: make it with "
                         f"make_workspace(dims, activation={layer.activation.name!r}, biases={layer.bias})")
    if workspace.choice == EXPERT_CENTRIC:
        return ec.expert_centric(x, w13, w2, topk_ids, topk_weights, quant=None, out=out, workspace=workspace.inner)
    if workspace.choice in BATCHED_PATHS:
        path, knobs = BATCHED_PATHS[workspace.choice]
        return batched.warp_decode_batched(x, w13, w2, topk_ids, topk_weights, out=out, workspace=workspace.inner,
                                           path=path, activation=layer.activation, b13=b13, b2=b2, **knobs)
    if workspace.choice == FP8_STRICT:
        return wdf.warp_decode_fp8(x, w13, w2, topk_ids, topk_weights, out=out, workspace=workspace.inner)
    return wdc.warp_decode(x, w13, w2, topk_ids, topk_weights, out=out, workspace=workspace.inner)


# ---------------------------------------------------------------------------------------------------
# Variants
# ---------------------------------------------------------------------------------------------------
def build(dims: Dims, policy: str = FASTEST, weight_format: str = "bf16", **params: Any) -> Launch:
    """Decide once for ``dims`` under ``policy`` (among the paths reading ``weight_format``) and return the chosen
    variant's launch (its run, stages, knobs and workspace) stating the chosen path's ``reference_mode`` / ``quant``
    (what its output must match: the bench harness checks against these) and ``facts`` ``choice``,
    ``choice_source``, ``policy``."""
    check_policy(policy)
    if params:
        raise ValueError(f"auto-dispatch takes no knobs (it picks a path and uses its defaults), got {sorted(params)}")
    choice, source = choose(dims, policy=policy, weight_format=weight_format)
    chosen = get_variant(choice)
    inner = chosen.make(dims)
    return Launch(run=inner.run, stages=inner.stages, params=inner.params, workspace=inner.workspace,
                  reference_mode=chosen.reference_mode, quant=chosen.quant,
                  facts={**inner.facts, "choice": choice, "choice_source": source, "policy": policy})


def _build_for(policy: str, weight_format: str = "bf16") -> Any:
    def build_policy(dims: Dims, **params: Any) -> Launch:
        return build(dims, policy, weight_format, **params)

    return build_policy


def _auto_variant(name: str, policy: str, description: str, weight_format: str = "bf16") -> Variant:
    """A registered auto-dispatch variant: no kernel family of its own, it builds the path ``policy`` picks."""
    return register(Variant(name=name, backend="cupy", family="auto", build=_build_for(policy, weight_format),
                            reference_mode="warp_decode", weight_format=weight_format, params={},
                            description=description))


# (cupy:auto's reference mode is "classical" at a T where it picks the expert-centric path: its launch says so)
VARIANT = _auto_variant("cupy:auto", FASTEST, "auto-dispatch, policy fastest: strict, batched, MMA warp decode "
                        "or expert-centric from a per-GPU measured table (or a heuristic)")
VARIANT_WARP_DECODE = _auto_variant("cupy:auto-warp-decode", WARP_DECODE, "auto-dispatch, policy warp_decode: strict, "
                                    "batched or MMA warp decode (warp decode's numerics) from a per-GPU "
                                    "measured table (or a heuristic)")
VARIANT_FP8 = _auto_variant("cupy:auto-fp8", FASTEST, "auto-dispatch on fp8-block128 weights: strict, batched or "
                            "tensor-core FP8 warp decode from the table's FP8 entries (or the heuristic)", FP8)
VARIANT_FP8_T16 = _auto_variant("cupy:auto-fp8-t16", FASTEST, "auto-dispatch on fp8-block128-t16 weights: the "
                                "tensor-core FP8 paths on tiles from the table's fp8-block128-t16 entries (or the "
                                "heuristic)", FP8_T16)
VARIANT_T16 = _auto_variant("cupy:auto-t16", FASTEST, "auto-dispatch on bf16-t16 weights: the tensor-core bf16 paths "
                            "on tiles from the table's bf16-t16 entries (or the heuristic)", T16)
VARIANT_INVARIANT = _auto_variant("cupy:auto-invariant", BATCH_INVARIANT, "auto-dispatch, policy batch_invariant: "
                                  "the grouped tensor-core path or its per-pair form (one numerics): a token's "
                                  "output bitwise the same whatever batch it rides in")
# the same policy on each other format's weights (its invariant pair, INVARIANT_PATHS): the bench's batch-invariant
# column for that format's table
VARIANT_INVARIANT_FORMATS = {fmt: _auto_variant(f"cupy:auto-invariant-{suffix}", BATCH_INVARIANT,
                                                f"auto-dispatch, policy batch_invariant, on {fmt} weights: that "
                                                "format's grouped tensor-core path or its per-pair form", fmt)
                             for fmt, suffix in ((FP8, "fp8"), (FP8_T16, "fp8-t16"), (T16, "t16"), (MX4, MX4),
                                                 (NV4, NV4))}
VARIANT_FOUR_BIT = {fmt: _auto_variant(f"cupy:auto-{fmt}", FASTEST, f"auto-dispatch on {fmt} weights: its FMA, "
                                       "tensor-core and per-pair warp decode from the table's entries for the format "
                                       "(or the heuristic)", fmt) for fmt in (MX4, NV4)}
