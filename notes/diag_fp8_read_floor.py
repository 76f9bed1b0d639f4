"""One-off H200 diagnostic (2026-12-02): the read floor of an FP8 decode layer at T = 1.

Run from the repo root on a GPU: ``PYTHONPATH=. python3 notes/diag_fp8_read_floor.py`` (writes
``$OUT/diag_fp8_read_floor.json``; committed as results/diag-2026-12-02-fp8-read-floor.json).

The FP8 bar at qwen3-30b-a3b T = 1 is 13.5 µs; its 8 experts' fp8-block128 bytes (values and scales) are 25.2 MB of
w13 and 12.6 MB of w2. As ``diag_small_reads.py`` did for the bf16 layer, this times the grid-stride read of exactly
those bytes -- as one kernel, and as two (w13's bytes, then w2's: what two kernels must do) -- over a few shapes, each
read of a different window of a 4 GiB buffer (past 3x L2), 48 reads per CUDA graph. The fastest shape is a floor
for any pair of kernels that streams the layer's bytes once; qwen3-235b-a22b's layer is read the same way.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import cupy

sys.path.insert(0, os.path.dirname(__file__))
from diag_small_reads import SOURCE  # noqa: E402  (the grid-stride read with UNROLL loads in flight)

from kernels.compile import get_kernel  # noqa: E402
from kernels.contract import Dims  # noqa: E402
from kernels.shapes import get_shape  # noqa: E402
from tools import roofline  # noqa: E402
from tools.roofline import window_read_buffers, window_read_row, window_read_samples  # noqa: E402

SHAPES = [(8, 512), (4, 512), (16, 128), (2, 1024)]  # (blocks per SM, threads per block)


def layer_bytes(model: str) -> tuple[int, int]:
    """(w13, w2) fp8-block128 bytes of one token's K experts: e4m3 values plus float32 128 x 128 block scales."""
    shape = get_shape(model)
    dims = Dims(1, shape.hidden, shape.intermediate, shape.experts, shape.top_k)
    blocks = lambda n: -(-n // 128)  # noqa: E731
    w13 = 2 * dims.intermediate * dims.hidden + 2 * blocks(dims.intermediate) * blocks(dims.hidden) * 4
    w2 = dims.hidden * dims.intermediate + blocks(dims.hidden) * blocks(dims.intermediate) * 4
    return dims.top_k * w13, dims.top_k * w2


def main() -> dict[str, Any]:
    sms = cupy.cuda.runtime.getDeviceProperties(0)["multiProcessorCount"]
    source, sink, stream = window_read_buffers()
    rows = []
    for model in ("qwen3-30b-a3b", "qwen3-235b-a22b"):
        w13, w2 = (-(-n // 4096) * 4096 for n in layer_bytes(model))
        for unroll in (4, 8):
            read = get_kernel(SOURCE, "read_unrolled", UNROLL=unroll)
            for per_sm, threads in SHAPES:
                for two_kernels in (False, True):
                    parts = [(0, w13), (w13, w2)] if two_kernels else None
                    samples = window_read_samples(read, per_sm * sms, threads, source, sink, stream, w13 + w2, parts)
                    rows.append(window_read_row(samples, w13 + w2, model=model, bytes=w13 + w2, w13_bytes=w13,
                                                w2_bytes=w2, two_kernels=two_kernels, unroll=unroll,
                                                blocks_per_sm=per_sm, threads=threads))
                    print(rows[-1], flush=True)
    return {"reads": rows, "roofline": roofline.measure()["read_tbps"]}


if __name__ == "__main__":
    result = main()
    with open(os.path.join(os.environ.get("OUT", "."), "diag_fp8_read_floor.json"), "w") as f:
        json.dump(result, f, indent=1)
