"""One-off H200 probe (2026-12-01, ~11:20 UTC): where do the fused kernel's microseconds go?

Run from the repo root on a GPU: ``PYTHONPATH=. python3 notes/diag_fused_probe.py`` (writes
``$OUT/diag_fused_probe.json``).

``moe_fused_3d`` (prototypes/fused_layer.py) took 25.8 us at qwen3-30b-a3b T = 1 in its first sweep, against 21.9
for strict warp decode and 18.2 for one plain read of the layer's bytes. This times graphs of 16 layers, each on a
different 8 of the 128 experts (1.2 GB of weights rotate past L2), for strict warp decode, its gate_up alone, and
text-edited copies of the fused kernel (the edits exist only here; their outputs are wrong on purpose):

* ``as_is``            the kernel
* ``no_copy``          without the w2 cp.async copies (the tail reads stale shared memory)
* ``no_tail``          returns right after the grid barrier (the copies are still issued and waited for)
* ``gate_up_only``     no copies, no barrier, no tail -- with the full shared-memory request (``big``) and with only
                       the flags' 48 bytes (``small``): the cost of the carveout to gate_up's loads
* ``barrier_only``     the barrier alone (no copies, no gate_up, no tail, small shared memory)
"""

from __future__ import annotations

import json
import os
import statistics
from typing import Any

import cupy
import numpy as np

from kernels import warp_decode_cupy as wdc
from kernels.compile import CudaSource, get_kernel, launch_ex
from kernels.contract import BF16, Dims
from prototypes import fused_layer as wdf
from tools.roofline import time_launches

COPY = 'asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(dst + 16u * c), "l"(src + c) : "memory");'
GATE_UP = "for (int item = blockIdx.x * FU_WARPS + warp; item < items; item += gridDim.x * FU_WARPS) {"
BARRIER = "    grid_barrier(grid_sync);\n    if (rows == 0) return;"
NO_COPY = (COPY, "(void)dst; (void)src;")
NO_GATE_UP = (GATE_UP, "for (int item = items; item < items; item += gridDim.x * FU_WARPS) {")
PROBES: dict[str, tuple[list[tuple[str, str]], bool]] = {   # name: (edits, small shared memory)
    "as_is": ([], False),
    "no_copy": ([NO_COPY], False),
    "no_tail": ([(BARRIER, "    grid_barrier(grid_sync);\n    return;")], False),
    "gate_up_only_big": ([NO_COPY, (BARRIER, "    return;")], False),
    "gate_up_only_small": ([NO_COPY, (BARRIER, "    return;")], True),
    "barrier_only": ([NO_COPY, NO_GATE_UP, (BARRIER, "    grid_barrier(grid_sync);\n    return;")], True),
}


# 2026-12-01 ~11:20 UTC: the first two sets (results/diag-2026-12-01-fused-probe.json); the rerun after the knob sweep
# (~11:30 UTC): the FU_COOP 0 sets (the copy edits only touch FU_COPY 0's cp.async, so the probe keeps FU_COPY 0)
KNOB_SETS = [{"FU_WARPS": 24, "FU_UNROLL": 4, "FU_BYTES": 16}, {"FU_WARPS": 32, "FU_UNROLL": 4, "FU_BYTES": 8},
             {"FU_COOP": 0}, {"FU_COOP": 0, "FU_TAIL": 1}]
if os.environ.get("PROBE_SETS"):  # e.g. PROBE_SETS=2,3
    KNOB_SETS = [KNOB_SETS[int(i)] for i in os.environ["PROBE_SETS"].split(",")]


def main(knobs: dict[str, int]) -> dict[str, Any]:
    dims = Dims(1, 2048, 768, 128, 8)
    rng = np.random.default_rng(8)
    w13 = cupy.asarray((rng.standard_normal((128, 1536, 2048), dtype=np.float32) * 0.02).astype(BF16))
    w2 = cupy.asarray((rng.standard_normal((128, 2048, 768), dtype=np.float32) * 0.02).astype(BF16))
    x = cupy.asarray(rng.standard_normal((1, 2048), dtype=np.float32).astype(BF16))
    sets = [cupy.asarray(ids.reshape(1, 8).astype(np.int32)) for ids in rng.permutation(128).reshape(16, 8)]
    weights = cupy.asarray(rng.random((1, 8), dtype=np.float32))
    out = cupy.empty((1, 2048), dtype=BF16)
    rows: dict[str, Any] = {}

    strict = wdc.FAMILY.build(dims)
    rows["strict_layer"] = statistics.median(time_launches([lambda i=i: strict(x, w13, w2, i, weights, out)
                                                         for i in sets]))
    gate_up = wdc.FAMILY.kernels_for(dict(strict.params))[wdc.GATE_UP]
    rows["strict_gate_up"] = statistics.median(time_launches(
        [lambda i=i: wdc._launch_gate_up(gate_up, strict.params, dims, x, w13, i, strict.workspace) for i in sets]))
    print("strict", rows, flush=True)

    params = wdf.resolve_params(dims, **knobs)
    ws = wdf.make_workspace(dims)
    for name, (edits, small) in PROBES.items():
        code = wdf.SOURCE.code
        for old, new in edits:
            assert code.count(old) == 1, old
            code = code.replace(old, new)
        source = CudaSource(name=f"fused_probe_{name}", code=code, kernels=wdf.SOURCE.kernels,
                            defaults=dict(wdf.SOURCE.defaults))
        kernel = get_kernel(source, wdf.FUSED, **params)
        shared = 48 if small else wdf.fused_shared_bytes(params, dims)
        kernel.max_dynamic_shared_size_bytes = max(shared, 48)

        def run(ids: Any, k: Any = kernel, shared: int = shared) -> None:
            launch_ex(k, (wdf.grid_blocks(),), (params["FU_WARPS"] * 32,),
                      (x, w13, w2, ids, weights, ws.intermediate, ws.grid_sync, out, np.int32(0), np.int32(1),
                       np.int32(2048), np.int32(768), np.int32(128), np.int32(8)),
                      shared_mem=shared, programmatic=bool(params["PDL"]), cooperative=bool(params["FU_COOP"]))

        rows[name] = statistics.median(time_launches([lambda i=i: run(i) for i in sets]))
        print(name, rows[name], flush=True)
    return rows


if __name__ == "__main__":
    result = {"gpu": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(), "us_per_layer": {}}
    for knobs in KNOB_SETS:
        key = ",".join(f"{k}={v}" for k, v in knobs.items())
        result["us_per_layer"][key] = main(knobs)
    with open(os.path.join(os.environ.get("OUT", "."), "diag_fused_probe.json"), "w") as f:
        json.dump(result, f, indent=1)
