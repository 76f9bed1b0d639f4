"""Auto-dispatch: the fastest warp-decode path for (shape, T) on this GPU, decided without looking at the routing.

    out = kernels.dispatch.moe_decode(x, w13, w2, topk_ids, topk_weights, out=None, workspace=None)

Paths (both reproduce ``reference.moe_decode(mode="warp_decode")``):

* ``"cupy:warp-decode"``          strict: one warp per (token, slot, neuron); best when few pairs share an expert
* ``"cupy:warp-decode-batched"``  batched: each active expert's weights read once per batch

The choice depends only on the shape (H, I, E, K), T and the GPU -- never on ``topk_ids``' values -- so it
never syncs with the host and a captured CUDA graph stays valid for any routing.

1. A table measured on the GPU (``python -m tools.dispatch_table --json kernels/dispatch_tables/<slug>.json``,
   slug = the device name lowercased with non-alphanumerics as '-', e.g. ``nvidia-h200``) gives, per shape
   and T in 1, 2, 4, ..., 64, the measured winner. T between table points uses the nearest LOWER point
   (above the last point: the last point).
2. No table for this GPU, or no entry for this shape: the heuristic :func:`heuristic` -- strict at T = 1
   and when ``T * K <= E / 8`` (few pairs, almost every expert touched once: strict reads about the same
   bytes with one launch fewer), else batched; strict also whenever the batched knobs cannot run the dims
   (e.g. T too large for the down kernel's shared memory).

Variant ``"cupy:auto"``: ``build(dims)`` decides once and returns that path's launch, with
``launch.choice`` (the variant name) and ``launch.choice_source`` ("table" or "heuristic").
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from kernels import warp_decode_batched as wdb
from kernels import warp_decode_cupy as wdc
from kernels.contract import Dims, array_module, check_inputs
from kernels.variants import Variant, get_variant, register

STRICT = "cupy:warp-decode"
BATCHED = "cupy:warp-decode-batched"
CANDIDATES = (STRICT, BATCHED)
TABLE_POINTS = (1, 2, 4, 8, 16, 32, 64)
TABLE_DIR = Path(__file__).resolve().parent / "dispatch_tables"
SCHEMA = "warp-decode-dispatch/1"
STRICT_PAIRS_PER_EXPERT = 0.125  # heuristic: strict while T*K <= E/8 (and at T = 1)


def gpu_slug(name: str) -> str:
    """File-name form of a device name: ``"NVIDIA H200"`` -> ``"nvidia-h200"``."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"a GPU name must be a non-empty string, got {name!r}")
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def shape_key(dims: Dims) -> str:
    """How a table names a shape: ``"H{hidden}-I{intermediate}-E{experts}-K{top_k}"``."""
    return f"H{dims.hidden}-I{dims.intermediate}-E{dims.experts}-K{dims.top_k}"


# ---------------------------------------------------------------------------------------------------
# Tables
# ---------------------------------------------------------------------------------------------------
def validate_table(table: Any) -> dict[str, Any]:
    """ValueError unless ``table`` has the layout tools.dispatch_table writes; returns it."""
    if not isinstance(table, dict) or table.get("schema") != SCHEMA:
        raise ValueError(f"a dispatch table must be a JSON object with schema {SCHEMA!r}")
    for key in ("gpu", "date", "entries"):
        if key not in table:
            raise ValueError(f"dispatch table lacks {key!r}")
    for key, entry in table["entries"].items():
        points = entry.get("points") if isinstance(entry, dict) else None
        if not isinstance(points, dict) or not points:
            raise ValueError(f"dispatch table entry {key!r} has no points")
        for tokens, point in points.items():
            if not str(tokens).isdigit() or int(tokens) < 1:
                raise ValueError(f"dispatch table entry {key!r}: point {tokens!r} is not a batch size")
            if point.get("choice") not in CANDIDATES:
                raise ValueError(f"dispatch table entry {key!r} T={tokens}: choice {point.get('choice')!r} "
                                 f"is not one of {CANDIDATES}")
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


def table_choice(table: dict[str, Any], dims: Dims) -> str | None:
    """The table's winner for ``dims`` (nearest lower measured T), or None without an entry for the shape."""
    entry = table["entries"].get(shape_key(dims))
    if entry is None:
        return None
    points = sorted(int(t) for t in entry["points"])
    lower = [t for t in points if t <= dims.tokens]
    point = lower[-1] if lower else points[0]
    return entry["points"][str(point)]["choice"]


def batched_supported(dims: Dims) -> bool:
    """Whether the batched kernels (default knobs) can run ``dims``."""
    try:
        wdb.resolve_params(dims)
    except ValueError:
        return False
    return True


def heuristic(dims: Dims) -> str:
    """Strict at T = 1, when ``T * K <= E / 8`` or when the batched kernels cannot run the dims; else batched.

    Why E/8: strict reads every pair's expert, batched each active expert once but launches one more kernel
    (~2-3 us). Under uniform routing strict's extra bytes are T*K - E*(1 - (1 - K/E)**T) experts: at
    qwen3-30b T=2 ~0.5 expert (~1 us) -- strict; at T=4 ~3.4 experts (~7 us; ~28 us at qwen3-235b) -- batched.
    """
    few_pairs = dims.tokens == 1 or dims.tokens * dims.top_k <= STRICT_PAIRS_PER_EXPERT * dims.experts
    if few_pairs or not batched_supported(dims):
        return STRICT
    return BATCHED


def choose(dims: Dims, gpu: str | None = None, table_dir: str | Path = TABLE_DIR) -> tuple[str, str]:
    """``(variant name, "table" | "heuristic")`` for ``dims`` on ``gpu`` (default: the current device)."""
    if not isinstance(dims, Dims):
        raise TypeError(f"dims must be a kernels.contract.Dims, got {type(dims).__name__}")
    if gpu is None:
        gpu = current_gpu()
    table = load_table(gpu_slug(gpu), str(table_dir))
    if table is not None:
        choice = table_choice(table, dims)
        if choice is not None and (choice != BATCHED or batched_supported(dims)):
            return choice, "table"
    return heuristic(dims), "heuristic"


# ---------------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------------
@dataclass
class Workspace:
    """The chosen path and its workspace, for one dims (``make_workspace``)."""

    dims: Dims
    choice: str
    source: str
    inner: Any


def make_workspace(dims: Dims, gpu: str | None = None) -> Workspace:
    """Decide the path for ``dims`` and allocate its workspace (CuPy, current device)."""
    choice, source = choose(dims, gpu)
    if choice == BATCHED:
        inner = wdb.make_workspace(dims)
    else:
        inner = wdc.make_workspace(dims.tokens, dims.top_k, dims.intermediate)
    return Workspace(dims, choice, source, inner)


def moe_decode(x: Any, w13: Any, w2: Any, topk_ids: Any, topk_weights: Any, out: Any = None,
               workspace: Workspace | None = None) -> Any:
    """One MoE decode layer by the fastest warp-decode path for this shape and T; returns ``out`` [T, H].

    With ``out`` and ``workspace`` (``make_workspace(dims)``) nothing is allocated and nothing syncs with the
    host (graph-capturable); the chosen path checks the inputs (kernels.contract).
    """
    xp = array_module(x)
    if xp.__name__ == "numpy":
        raise TypeError("x must be a cupy.ndarray (moe_decode runs on the GPU; reference.moe_decode is the host "
                        "version)")
    dims = check_inputs(x, w13, w2, topk_ids, topk_weights, check_values=False)
    if workspace is None:
        workspace = make_workspace(dims)
    elif not isinstance(workspace, Workspace):
        raise TypeError(f"workspace must come from kernels.dispatch.make_workspace(), got {type(workspace).__name__}")
    elif workspace.dims != dims:
        raise ValueError(f"workspace was made for {workspace.dims}, this call needs {dims}")
    if workspace.choice == BATCHED:
        return wdb.warp_decode_batched(x, w13, w2, topk_ids, topk_weights, out=out, workspace=workspace.inner)
    return wdc.warp_decode(x, w13, w2, topk_ids, topk_weights, out=out, workspace=workspace.inner)


# ---------------------------------------------------------------------------------------------------
# Variant
# ---------------------------------------------------------------------------------------------------
def build(dims: Dims, **params: Any) -> Any:
    """Decide once for ``dims`` and return the chosen variant's launch (``launch.choice`` says which)."""
    if params:
        raise ValueError(f"cupy:auto takes no knobs (it picks a path and uses its defaults), got {sorted(params)}")
    choice, source = choose(dims)
    launch = get_variant(choice).make(dims)
    launch.choice = choice  # type: ignore[attr-defined]
    launch.choice_source = source  # type: ignore[attr-defined]
    return launch


VARIANT = register(
    Variant(
        name="cupy:auto",
        backend="cupy",
        family="auto",
        build=build,
        reference_mode="warp_decode",
        params={},
        description="auto-dispatch: strict or batched warp decode from a per-GPU measured table (or a heuristic)",
    )
)
