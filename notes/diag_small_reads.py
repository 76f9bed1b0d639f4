"""One-off H200 diagnostic (2026-12-01, ~06:20 UTC): how fast can ANY kernel read a decode layer's weight bytes once?

Run from the repo root on a GPU: ``PYTHONPATH=. python3 notes/diag_small_reads.py`` (writes
``$OUT/diag_small_reads.json``; committed as results/diag-small-reads.json).

The bench's roofline kernel (tools/roofline.py) reaches ~4.5 TB/s on 4 GiB, but a layer reads far less: qwen3-30b-a3b
at T = 1 reads 75.5 MB (50.3 MB of w13, 25.2 MB of w2). This sweeps a grid-stride read with UNROLL independent
16-byte loads in flight per thread over blocks per SM x threads per block, on exactly those sizes, each replay
reading a different window of a 4 GiB buffer (past 3x L2), 48 reads per CUDA graph. The fastest configuration is a
floor for any kernel that must stream those bytes from HBM once.
"""

from __future__ import annotations

import json
import os
from typing import Any

import cupy

from kernels.compile import CudaSource, get_kernel
from tools import roofline
from tools.roofline import window_read_buffers, window_read_row, window_read_samples

SOURCE = CudaSource(
    name="diag_small_reads",
    description="notes/diag_small_reads.py: grid-stride read with UNROLL loads in flight per thread",
    kernels=("read_unrolled",),
    defaults={"UNROLL": 1},
    code=r"""
// thread i reads 16-byte chunks i, i + stride, ... with UNROLL loads issued before any is used; XOR-reduced
extern "C" __global__ void read_unrolled(const uint4* __restrict__ src, unsigned long long n16,
                                         unsigned int* __restrict__ sink) {
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    unsigned int acc = 0u;
    for (; i + (UNROLL - 1) * stride < n16; i += UNROLL * stride) {
        uint4 chunk[UNROLL];
        #pragma unroll
        for (int u = 0; u < UNROLL; ++u) chunk[u] = __ldg(src + i + u * stride);
        #pragma unroll
        for (int u = 0; u < UNROLL; ++u) acc ^= chunk[u].x ^ chunk[u].y ^ chunk[u].z ^ chunk[u].w;
    }
    for (; i < n16; i += stride) {
        const uint4 chunk = __ldg(src + i);
        acc ^= chunk.x ^ chunk.y ^ chunk.z ^ chunk.w;
    }
    if (acc == 0x9E3779B9u) atomicAdd(sink, 1u);
}
""",
)

SIZES = [("30b T=1 layer", 75_497_472), ("30b T=1 w13", 50_331_648), ("30b T=1 w2", 25_165_824)]
SHAPES = [(8, 512), (4, 256), (2, 1024), (1, 1024), (16, 128), (4, 512)]  # (blocks per SM, threads per block)


def main() -> dict[str, Any]:
    sms = cupy.cuda.runtime.getDeviceProperties(0)["multiProcessorCount"]
    source, sink, stream = window_read_buffers()
    rows = []
    for label, nbytes in SIZES:
        for unroll in (1, 4, 8):
            read = get_kernel(SOURCE, "read_unrolled", UNROLL=unroll)
            for per_sm, threads in SHAPES:
                samples = window_read_samples(read, per_sm * sms, threads, source, sink, stream, nbytes)
                rows.append(window_read_row(samples, nbytes, what=label, bytes=nbytes, unroll=unroll,
                                            blocks_per_sm=per_sm, threads=threads))
                print(rows[-1], flush=True)
    return {"reads": rows, "roofline": roofline.measure()["read_tbps"]}


if __name__ == "__main__":
    result = main()
    with open(os.path.join(os.environ.get("OUT", "."), "diag_small_reads.json"), "w") as f:
        json.dump(result, f, indent=1)
