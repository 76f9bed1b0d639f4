"""One-off H200 probe (2026-12-01, ~09:50 UTC): where do the staged down's 15 us go? (results/diag-staged-probe.json)

Run from the repo root on a GPU: ``PYTHONPATH=. python3 notes/diag_staged_probe.py`` (writes
``$OUT/diag_staged_probe.json``).

``moe_down_3d_staged`` (DN_STAGED=1) alone takes 15 us at qwen3-30b-a3b T = 1 against 8.8 for the plain down, with
the copy engine or with cp.async alike. This times the down alone (16 launches in a graph, each on a different 8 of
the 128 experts, so the 403 MB of w2 rotate past L2) for the plain down and for text-edited copies of the staged
kernel: as it is, without its w2 copies, without its tensor-core dots. The edits exist only here. The committed results
came from a draft with its own copy of the graph timer; it now uses tools.roofline's (same warm-up and event timing),
not re-run since.
"""

from __future__ import annotations

import json
import os
import statistics
from typing import Any

import cupy
import numpy as np

from kernels import warp_decode_cupy as wdc
from kernels.compile import CudaSource, get_kernel
from kernels.contract import BF16, Dims
from tools.roofline import time_launches

COPY = 'asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(dst + 16u * c), "l"(src + c) : "memory");'
DOTS = "mma_k32(even, staged_chunk(a_lo, c, ok), staged_chunk(a_hi, c, ok), staged_chunk(b_col, c, ok));"
PROBES = {"as_is": [], "no_copy": [(COPY, "(void)dst; (void)src;")], "no_dots": [(DOTS, "(void)ok;")],
          "neither": [(COPY, "(void)dst; (void)src;"), (DOTS, "(void)ok;")]}
# (the first run, results/diag-staged-probe.json, edited the version whose dots read acc[kb & 1] -- in local memory;
# the rerun, diag-staged-probe-fixed.json, edits the even chain's mma of the fixed kernel: "no_dots" keeps the odd)


def main() -> dict[str, Any]:
    dims = Dims(1, 2048, 768, 128, 8)
    rng = np.random.default_rng(7)
    w2 = cupy.asarray(rng.standard_normal((128, 2048, 768), dtype=np.float32).astype(BF16))
    sets = [cupy.asarray(ids.reshape(1, 8).astype(np.int32)) for ids in rng.permutation(128).reshape(16, 8)]
    weights = cupy.asarray(rng.random((1, 8), dtype=np.float32))
    inter = cupy.asarray(rng.standard_normal((1, 8, 768), dtype=np.float32).astype(BF16))
    out = cupy.empty((1, 2048), dtype=BF16)
    rows: dict[str, Any] = {}

    plain = wdc.resolve_params(dims)
    kernel = get_kernel(wdc.SOURCE, wdc.DOWN, **plain)
    runs = [lambda ids=ids: wdc._launch_down(kernel, plain, dims, inter, w2, ids, weights, out) for ids in sets]
    rows["plain"] = statistics.median(time_launches(runs))
    print("plain", rows["plain"], flush=True)
    for warps in (4, 8):
        staged = wdc.resolve_params(dims, DN_STAGED=1, DN_WARPS=warps)
        for name, edits in PROBES.items():
            code = wdc.SOURCE.code
            for old, new in edits:
                assert code.count(old) == 1, old
                code = code.replace(old, new)
            source = CudaSource(name=f"staged_probe_{name}", code=code, kernels=wdc.SOURCE.kernels,
                                defaults=dict(wdc.SOURCE.defaults))
            kernel = get_kernel(source, wdc.STAGED_DOWN, **staged)
            runs = [lambda ids=ids, k=kernel, p=staged: wdc._launch_down(k, p, dims, inter, w2, ids, weights, out)
                    for ids in sets]
            rows[f"staged_w{warps}_{name}"] = statistics.median(time_launches(runs))
            print(name, warps, rows[f"staged_w{warps}_{name}"], flush=True)
    return rows


if __name__ == "__main__":
    result = {"down_alone_us": main(), "gpu": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()}
    with open(os.path.join(os.environ.get("OUT", "."), "diag_staged_probe.json"), "w") as f:
        json.dump(result, f, indent=1)
