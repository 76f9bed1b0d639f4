"""Stage times of the down kernels: per-SM or HBM limit of the tensor-core down; where the staged down's time goes.

One-off H200 diagnostics (2026-12-01, 09:27-10:00 UTC), kept with their results. Run from the repo root on a GPU:
``PYTHONPATH=. python3 notes/diag_down_stage_times.py [down_per_sm] [staged]`` (writes
``$OUT/diag_down_stage_times_<parts>.json``).

``down_per_sm`` (results/diag-2026-12-01-down-per-sm.json): is the tensor-core down limited per SM or by HBM? Its
block owns 16 hidden columns, so qwen3-30b (H = 2048) runs 128 blocks on the H200's 132 SMs. The same layer with
H = 2112 runs 132 blocks on 3.1 % more w2 bytes: if the down stage takes the same time, the down is limited per SM
(work spread over all 132 SMs would be ~3 % faster); if it takes 3.1 % longer, HBM is the limit and the 4 idle SMs
cost nothing.

``staged``: the strict layer at qwen3-30b-a3b T = 1 with ``DN_STAGED`` 0 / 1 and a few gate_up / down knob sets,
stage times included; run once per version of the staged down (results/diag-2026-12-01-staged-tma.json: copy
engine per padded row; -staged-async.json: cp.async; -staged-rotated.json: copy order slot-minor, rotated by block).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from kernels import warp_decode_batched as wdb
from kernels.shapes import get_shape
from tools import harness, roofline


def down_per_sm() -> list[dict[str, Any]]:
    rows = []
    base = get_shape("qwen3-30b-a3b")
    for variant, tokens in ((wdb.MIXED_VARIANT, 8), (wdb.MMA_VARIANT, 32), (wdb.MMA_VARIANT, 64)):
        for hidden in (2048, 2112):
            shape = dataclasses.replace(base, name=f"qwen3-30b-a3b/H{hidden}", hidden=hidden, layers=1)
            bench = harness.Workbench(shape, tokens, "uniform", 0)
            record = bench.measure(variant, repeats=15, stages=True)
            stages = {s["name"]: s.get("median_us") for s in record["stages"]}
            rows.append({"variant": variant.name, "H": hidden, "T": tokens, "status": record["status"],
                         "median_us": record.get("median_us"), "iqr_us": record.get("iqr_us"),
                         "stages_us": stages, "unique": record["bytes"]["unique_experts"],
                         "weights": record["bytes"]["weights"]})
            print(rows[-1], flush=True)
            bench.free()
    return rows


def staged() -> list[dict[str, Any]]:
    from kernels import warp_decode_cupy as wdc

    rows = []
    bench = harness.Workbench(get_shape("qwen3-30b-a3b"), 1, "uniform", 0)
    for params in ({}, {"DN_STAGED": 1}, {"DN_STAGED": 1, "DN_WARPS": 16},
                   {"DN_STAGED": 1, "DN_WARPS": 4, "GU_UNROLL": 2}, {"DN_STAGED": 1, "GU_OUTS": 2, "GU_UNROLL": 4},
                   {"DN_STAGED": 1, "DN_WARPS": 4, "GU_OUTS": 2}):
        record = bench.measure(wdc.VARIANT, repeats=15, params=params, stages=True)
        rows.append({"params": params, "status": record["status"], "median_us": record.get("median_us"),
                     "stages_us": {s["name"]: s.get("median_us") for s in record["stages"]}})
        print(rows[-1], flush=True)
    bench.free()
    return rows


if __name__ == "__main__":
    import sys

    parts = sys.argv[1:] or ["down_per_sm", "staged"]
    result: dict[str, Any] = {name: globals()[name]() for name in parts}
    result["roofline"] = roofline.measure()["read_tbps"]
    with open(os.path.join(os.environ.get("OUT", "."), f"diag_down_stage_times_{'_'.join(parts)}.json"), "w") as f:
        json.dump(result, f, indent=1)
