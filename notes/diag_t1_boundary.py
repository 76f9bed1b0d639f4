"""One-off H200 diagnostic (2026-12-03): when the per-pair FP8 down starts against the gate_up's end at T = 1.

Run from the repo root on a GPU: ``PYTHONPATH=. python3 notes/diag_t1_boundary.py`` (writes
``$OUT/diag_t1_boundary.json``; committed as results/diag-2026-12-03-t1-boundary.json).

At qwen3-30b-a3b T = 1 the per-pair FP8 pair takes ~14.7 µs per layer; its gate_up alone ~9.5 and its down alone
~6.0. The suspect for the rest (PROTOTYPES.md, ``DB_KPARTS``) is the kernel boundary: the gate_up's warps fill the
register file, so the down's blocks start -- and issue their first w2 loads before the PDL wait -- only as the
gate_up drains. This times it from inside: an edited copy of the per-pair family's source stamps ``%globaltimer``
(ns) into device arrays -- each gate_up block's last warp end, each down block's first warp start and last warp end
-- for one layer pair (the per-pair family on fp8-block128, PDL on) replayed as a CUDA graph, each replay on another
8 experts (16 disjoint sets, 600 MB at qwen3-30b: the weights come from DRAM). Times are relative to the first
gate_up warp's start. The result (FINDINGS.md, 2026-12-03): every down block is resident before the gate_up's last
block ends; the time goes to the gate_up's ramp and spread and to the down's rounds after the wait. At qwen3-235b
the first replay of each graph ran ~70 µs, the second ones ~43.5 (read the replays from 18 on there).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
from typing import Any

import cupy
import numpy as np

from kernels import batched
from kernels.batched import pairs
from kernels.compile import CudaSource, get_module
from kernels.contract import Dims
from kernels.formats import Quantized
from kernels.shapes import get_shape

MARKS = 1 << 16  # blocks per kernel the stamp arrays hold
PRELUDE = r"""
__device__ unsigned long long wd_gu_start[1], wd_gu_end[65536], wd_dn_start[65536], wd_dn_end[65536];
__device__ __forceinline__ unsigned long long wd_now() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
// lane 0 of every warp: a stamp at construction (atomicMin into start[block], when start is given) and at every
// return (atomicMax into end[block])
struct WdMark {
    unsigned long long* end;
    __device__ WdMark(unsigned long long* start, unsigned long long* end_) : end(end_) {
        if ((threadIdx.x & 31) == 0 && start) atomicMin(start, wd_now());
    }
    __device__ ~WdMark() { if ((threadIdx.x & 31) == 0) atomicMax(end + blockIdx.x, wd_now()); }
};
"""
EDITS = [  # (unique text, text to insert after it)
    ("    int hidden, int inter, int experts, int top_k, int pairs)\n{\n",
     "    WdMark wd_mark(wd_gu_start, wd_gu_end);\n"),
    ("    int out_f32, int tokens, int hidden, int inter, int experts, int top_k)\n{\n",
     "    WdMark wd_mark(wd_dn_start + blockIdx.x, wd_dn_end);\n"),
]


def marked_family() -> Any:
    family = batched.family("pairs", "fp8-block128")
    code = family.source.code
    for anchor, insert in EDITS:
        assert code.count(anchor) == 1, anchor
        code = code.replace(anchor, anchor + insert)
    code = PRELUDE + code
    source = CudaSource(name="batched_pairs_marked", code=code, kernels=family.source.kernels,
                        defaults=dict(family.source.defaults))
    return dataclasses.replace(family, source=source, _cache={})


def fp8_weights(shape: Any, rng: np.random.Generator) -> tuple[Quantized, Quantized]:
    """Random e4m3 bytes (no NaN codes) and scales near 2^-8 for every expert, on the device."""
    e, h, i = shape.experts, shape.hidden, shape.intermediate

    def matrix(rows: int, cols: int, scale_rows: int) -> Quantized:
        values = cupy.random.randint(0, 0x7E, size=(e, rows, cols), dtype=cupy.uint8)
        values |= (cupy.random.randint(0, 2, size=(e, rows, cols), dtype=cupy.uint8) << 7)
        scales = cupy.asarray(rng.uniform(2**-9, 2**-7, (e, scale_rows, -(-cols // 128))).astype(np.float32))
        return Quantized(values=values, scales=scales)

    return matrix(2 * i, h, 2 * -(-i // 128)), matrix(h, i, -(-h // 128))


def stamps(model: str, replays: int = 32) -> dict[str, Any]:
    shape = get_shape(model)
    dims = Dims(1, shape.hidden, shape.intermediate, shape.experts, shape.top_k)
    rng = np.random.default_rng(3)
    w13, w2 = fp8_weights(shape, rng)
    x = cupy.asarray(rng.standard_normal((1, shape.hidden), dtype=np.float32)).astype(cupy.float32)
    x = x.view(cupy.uint32).__rshift__(16).astype(cupy.uint16)  # bf16 bits of x (truncated)
    sets = [cupy.asarray(ids.reshape(1, shape.top_k).astype(np.int32))
            for ids in rng.permutation(shape.experts)[:16 * shape.top_k].reshape(16, shape.top_k)]
    weights = cupy.asarray(rng.random((1, shape.top_k), dtype=np.float32))
    out = cupy.empty((1, shape.hidden), dtype=cupy.uint16)
    family = marked_family()
    compiled = family.compile(dims)
    module = get_module(family.source, **compiled.params)

    def device_array(name: str, n: int) -> Any:
        return cupy.ndarray((n,), dtype=cupy.uint64, memptr=module.get_global(name))

    gu_start, gu_end = device_array("wd_gu_start", 1), device_array("wd_gu_end", MARKS)
    dn_start, dn_end = device_array("wd_dn_start", MARKS), device_array("wd_dn_end", MARKS)
    gu_blocks, dn_blocks = pairs.gate_up_blocks(dims, compiled.params), pairs.down_blocks(dims, compiled.params)
    stream = cupy.cuda.Stream(non_blocking=True)
    graphs = []
    with stream:
        for ids in sets:
            compiled.run(x, w13, w2, ids, weights, out)  # warm-up, outside the graphs
            stream.begin_capture()
            compiled.run(x, w13, w2, ids, weights, out)
            graphs.append(stream.end_capture())
        stream.synchronize()
        rows = []
        for r in range(replays):
            gu_start.fill(np.uint64(2**64 - 1))
            dn_start.fill(np.uint64(2**64 - 1))
            gu_end.fill(0)
            dn_end.fill(0)
            graphs[r % len(graphs)].launch(stream)
            stream.synchronize()
            t0 = int(gu_start.get()[0])
            ge = (gu_end[:gu_blocks].get().astype(np.int64) - t0) / 1e3
            ds = (dn_start[:dn_blocks].get().astype(np.int64) - t0) / 1e3
            de = (dn_end[:dn_blocks].get().astype(np.int64) - t0) / 1e3
            rows.append({"gate_up_end_max": float(ge.max()), "gate_up_end_p50": float(np.median(ge)),
                         "gate_up_end_p10": float(np.percentile(ge, 10)), "down_start_min": float(ds.min()),
                         "down_start_p50": float(np.median(ds)), "down_start_max": float(ds.max()),
                         "down_blocks_started_before_gate_up_end": int((ds < ge.max()).sum()),
                         "down_end_max": float(de.max()), "down_end_min": float(de.min())})
    keys = rows[0].keys()
    summary = {k: statistics.median(r[k] for r in rows[4:]) for k in keys}
    return {"model": model, "gate_up_blocks": gu_blocks, "down_blocks": dn_blocks, "params": compiled.params,
            "replays": rows, "median_of_replays_4_on": summary}


if __name__ == "__main__":
    result = {"gpu": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(), "unit": "µs from the first gate_up "
              "warp's start", "points": []}
    for model in ("qwen3-30b-a3b", "qwen3-235b-a22b"):
        result["points"].append(stamps(model))
        print(model, json.dumps(result["points"][-1]["median_of_replays_4_on"]), flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "diag_t1_boundary.json"), "w") as f:
        json.dump(result, f, indent=1)
