"""H200 diagnostic (written 2026-12-04): does the tensor-core kernels' row-chunked access pattern read slower than a
contiguous stream of the same bytes?

Run from the repo root on a GPU: ``PYTHONPATH=. python3 notes/diag_row_reads.py`` (writes
``$OUT/diag_row_reads.json``; about a minute).

Why: at T = 1 the FP8 per-pair gate_up alone takes 26.6 µs on qwen3-235b's 100.7 MB of w13 (84 % of the streaming
roofline) and the down 13.9 µs on its 50.3 MB (81 %); a one-kernel read of that many bytes needs ~1 µs of ramp above
the roofline. The gate_up's warp reads 16 rows x 128 bytes per round (its quarter of each row, GB_KSPLIT 4), rows
H bytes apart; a stream of the same bytes reads them contiguously. This times, with no compute:

* ``ranges``: the gate_up's pattern -- 16-row groups, warp w of KS reading the w-th contiguous range of each row, U
  64-byte k blocks per row per round (lane (g, q): rows g and g + 8, 16 bytes at 64 kb + 16 q);
* ``interleaved``: the same loads, but the block's KS warps take adjacent U-block chunks of the rows in turn (so that
  one round of the block reads KS x U x 64 contiguous bytes per row);
* ``contiguous``: each warp reads the same number of bytes as one contiguous run, 2 U 16-byte loads per lane a round;
* ``rotated``: ``ranges`` with each warp starting its walk at a round that depends on its group and range (and
  wrapping), so that the warps in flight do not all read the same offsets of their ranges.

Each shape runs as a block loop over the groups with 6 or 12 blocks of 4 warps per SM (16 or 32 of one warp at
KS = 1, the down's whole rows), each read a different window of a 4 GiB
buffer (past 3x L2), 48 reads per CUDA graph (tools.roofline.window_read_samples); TB/s and the streaming-read
roofline in the same process.
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
    name="diag_row_reads",
    description="notes/diag_row_reads.py: 16-row groups read in k ranges, interleaved chunks, or contiguously",
    kernels=("read_rows",),
    defaults={"ROW": 4096, "KS": 4, "U": 2, "PATTERN": 0},
    code=r"""
// PATTERN 0 ranges, 1 interleaved, 2 contiguous, 3 rotated (module docstring); KS warps per 16-row group
extern "C" __global__ void __launch_bounds__(32 * KS) read_rows(const uint4* __restrict__ src,
                                                                unsigned long long n16,
                                                                unsigned int* __restrict__ sink) {
    constexpr int ROW16 = ROW / 16, KB = ROW / 64, PER = KB / KS;   // uint4s a row, 64-byte k blocks, a warp's
    const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3, w = threadIdx.x >> 5;
    const long long groups = (long long)(n16 / ROW16) / 16;
    unsigned int acc = 0u;
    for (long long grp = blockIdx.x; grp < groups; grp += gridDim.x) {
        const uint4* lo_row = src + (grp * 16 + g) * ROW16;
        const uint4* hi_row = lo_row + 8 * ROW16;
        const uint4* mine = src + grp * 16 * ROW16 + (long long)w * 16 * PER * 4;   // PATTERN 2: the warp's run
        for (int r = 0; r < PER; r += U) {
            uint4 lo[U], hi[U];
            #pragma unroll
            for (int u = 0; u < U; ++u) {
                if (PATTERN == 2) {
                    lo[u] = __ldg(mine + (r * 2 + 2 * u) * 32 + lane);
                    hi[u] = __ldg(mine + (r * 2 + 2 * u + 1) * 32 + lane);
                } else {
                    const int rr = PATTERN == 3 ? (r + (int)((grp * 7 + w * 3) % (PER / U)) * U) % PER : r;
                    const int kb = PATTERN == 1 ? ((r / U) * KS + w) * U + u : w * PER + rr + u;
                    lo[u] = __ldg(lo_row + kb * 4 + q);
                    hi[u] = __ldg(hi_row + kb * 4 + q);
                }
            }
            #pragma unroll
            for (int u = 0; u < U; ++u) acc ^= lo[u].x ^ lo[u].y ^ lo[u].z ^ lo[u].w ^ hi[u].x ^ hi[u].w;
        }
    }
    if (acc == 0x9E3779B9u) atomicAdd(sink, 1u);
}
""",
)

# (label, row bytes, layer bytes): qwen3-235b-a22b's and qwen3-30b-a3b's FP8 w13 (2I x H e4m3 rows, K = 8 experts)
# and w2 (H x I rows) at T = 1
SIZES = [("235b w13", 4096, 8 * 3072 * 4096), ("235b w2", 1536, 8 * 4096 * 1536),
         ("30b w13", 2048, 8 * 1536 * 2048)]
PATTERNS = {0: "ranges", 1: "interleaved", 2: "contiguous", 3: "rotated"}


def main() -> dict[str, Any]:
    sms = cupy.cuda.runtime.getDeviceProperties(0)["multiProcessorCount"]
    source, sink, stream = window_read_buffers()
    rows = []
    for label, row, nbytes in SIZES:
        for ks, unroll in ((4, 2), (4, 4), (1, 4)):
            if (row // 64) % (ks * unroll):
                continue
            for pattern, name in PATTERNS.items():
                read = get_kernel(SOURCE, "read_rows", ROW=row, KS=ks, U=unroll, PATTERN=pattern)
                for per_sm in ((6, 12) if ks == 4 else (16, 32)):   # the real kernels' 24 warps an SM, or 2x
                    samples = window_read_samples(read, per_sm * sms, 32 * ks, source, sink, stream, nbytes)
                    rows.append(window_read_row(samples, nbytes, what=label, pattern=name, row=row, ks=ks,
                                                unroll=unroll, blocks_per_sm=per_sm))
                    print(rows[-1], flush=True)
    return {"reads": rows, "roofline": roofline.measure()["read_tbps"]}


if __name__ == "__main__":
    result = main()
    with open(os.path.join(os.environ.get("OUT", "."), "diag_row_reads.json"), "w") as f:
        json.dump(result, f, indent=1)
