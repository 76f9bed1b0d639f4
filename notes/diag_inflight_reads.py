"""H200 diagnostic (written 2026-12-03): read bandwidth against the bytes each SM keeps in flight, loads into
registers against a ring of bulk copies into shared memory.

Run from the repo root on a GPU: ``PYTHONPATH=. python3 notes/diag_inflight_reads.py`` (writes
``$OUT/diag_inflight_reads.json``; about a minute).

Why: at qwen3-235b from T = 16 the FP8 tensor-core kernels stream 68-86 % of DRAM (Nsight Compute,
results/ncu-2026-12-03-fp8-235b-*.txt: half the stalls on weight loads, 49 % issue), with 16 warps per SM (122-128
registers) and a few 16-byte loads per lane in flight. The copy-engine shapes tried so far (DN_BULK, DN_STAGED,
DB_STAGED) were single-stage and row-granular and lost at T = 1 / 2, where latency rules; what the W8A8 peer runs is a
multi-stage ring. Before a ring is built into the kernels, this measures whether one could stream more than the
registers do at the residency those kernels have:

* ``regs``: the grid-stride read of notes/diag_small_reads.py (UNROLL independent 16-byte loads per lane in flight)
  at 8 / 16 / 32 / 64 warps per SM; bytes in flight per SM = warps x 32 lanes x 16 B x UNROLL.
* ``bulk``: 4-warp blocks, each warp a ring of RING stages of CHUNK contiguous bytes in shared memory, filled by
  ``cp.async.bulk`` (lane 0, an mbarrier per stage) and read by the warp's lanes before the stage is refilled; 1, 2
  or 4 blocks per SM (the dynamic shared memory allows no more); bytes in flight per SM = blocks x 4 x RING x CHUNK.

Each configuration reads 256 MiB (a qwen3-235b T = 16..32 gate_up's weights), each read a different window of a
4 GiB buffer (past 3x L2), 48 reads per CUDA graph (tools.roofline.window_read_samples); TB/s and % of the
streaming-read roofline measured in the same process.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import cupy

sys.path.insert(0, os.path.dirname(__file__))
from diag_small_reads import SOURCE as REGS_SOURCE  # noqa: E402  (the grid-stride read with UNROLL loads in flight)

from kernels.compile import CudaSource, get_kernel  # noqa: E402
from tools import roofline  # noqa: E402
from tools.roofline import window_read_buffers, window_read_row, window_read_samples  # noqa: E402

# A per-warp ring of bulk copies, for the ring kernels of this file and notes/diag_fp8_stream_mma.py (CHUNK and WARPS
# are their defines): ring_stream(src, n16, consume) walks warp w's chunks w, w + W, ... (W = the grid's warps) of
# CHUNK bytes through RING stages in dynamic shared memory ([WARPS][RING][CHUNK] bytes, then [WARPS][RING] 8-byte
# mbarriers). Lane 0 keeps RING copies in flight (cp.async.bulk, an mbarrier per stage); once a stage has arrived,
# every lane calls consume(stage, lane), and lane 0 refills the stage with the chunk RING steps ahead. A tail of less
# than CHUNK bytes is left unread (the sizes read are multiples of CHUNK).
BULK_RING_HELPERS = r"""
__device__ __forceinline__ unsigned int smem_u32(const void* p) {
    return static_cast<unsigned int>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void issue(unsigned char* stage, unsigned long long* bar, const unsigned char* from) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(smem_u32(bar)), "r"(CHUNK)
                 : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(smem_u32(stage)), "l"(from), "r"(CHUNK), "r"(smem_u32(bar)) : "memory");
}

__device__ __forceinline__ void wait_stage(unsigned long long* bar, unsigned int parity) {
    unsigned int done = 0u;
    while (!done) {
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                     : "=r"(done) : "r"(smem_u32(bar)), "r"(parity) : "memory");
    }
}

template <class Consume>
__device__ __forceinline__ void ring_stream(const uint4* __restrict__ src, unsigned long long n16, Consume& consume) {
    extern __shared__ __align__(128) unsigned char smem[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    unsigned char* ring = smem + (size_t)warp * RING * CHUNK;
    unsigned long long* bars = reinterpret_cast<unsigned long long*>(smem + (size_t)WARPS * RING * CHUNK) + warp * RING;
    const unsigned char* base = reinterpret_cast<const unsigned char*>(src);
    const unsigned long long chunks = n16 * 16ull / CHUNK;
    const unsigned long long first = (unsigned long long)blockIdx.x * WARPS + warp;
    const unsigned long long step = (unsigned long long)gridDim.x * WARPS;
    if (lane == 0) {
        for (int s = 0; s < RING; ++s)
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(smem_u32(bars + s)) : "memory");
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        for (int s = 0; s < RING; ++s) {
            const unsigned long long c = first + (unsigned long long)s * step;
            if (c < chunks) issue(ring + (size_t)s * CHUNK, bars + s, base + c * CHUNK);
        }
    }
    __syncwarp();
    unsigned int parity = 0u;  // parity: bit s = the phase stage s waits for next
    int s = 0;
    for (unsigned long long c = first; c < chunks; c += step) {
        wait_stage(bars + s, (parity >> s) & 1u);
        parity ^= 1u << s;
        consume(reinterpret_cast<const uint4*>(ring + (size_t)s * CHUNK), lane);
        __syncwarp();  // every lane has read the stage before lane 0 refills it
        const unsigned long long next = c + (unsigned long long)RING * step;
        if (lane == 0 && next < chunks) issue(ring + (size_t)s * CHUNK, bars + s, base + next * CHUNK);
        s = s + 1 == RING ? 0 : s + 1;
    }
}
"""

BULK_SOURCE = CudaSource(
    name="diag_inflight_bulk",
    description="notes/diag_inflight_reads.py: a ring of bulk copies per warp, read from shared memory",
    kernels=("read_bulk_ring",),
    defaults={"RING": 2, "CHUNK": 4096, "WARPS": 4},
    code=BULK_RING_HELPERS + r"""
// each lane XOR-reduces its 16-byte words of every stage
struct XorFold {
    unsigned int acc = 0u;
    __device__ __forceinline__ void operator()(const uint4* stage, int lane) {
        #pragma unroll 4
        for (int i = lane; i < CHUNK / 16; i += 32) {
            const uint4 v = stage[i];
            acc ^= v.x ^ v.y ^ v.z ^ v.w;
        }
    }
};

extern "C" __global__ void __launch_bounds__(WARPS * 32) read_bulk_ring(const uint4* __restrict__ src,
                                                                      unsigned long long n16,
                                                                      unsigned int* __restrict__ sink) {
    XorFold fold;
    ring_stream(src, n16, fold);
    if (fold.acc == 0x9E3779B9u) atomicAdd(sink, 1u);
}
""",
)

NBYTES = 256 << 20
REGS = [(per_sm, threads, unroll) for per_sm, threads in ((1, 256), (2, 256), (4, 256), (8, 256))
        for unroll in (1, 2, 4, 8)]  # 8 / 16 / 32 / 64 warps per SM
BULK = [(per_sm, ring, chunk) for per_sm in (1, 2, 4) for ring, chunk in ((2, 2048), (2, 4096), (4, 4096),
                                                                          (2, 8192), (4, 8192), (3, 16384))]
OPT_IN_SHARED = 227 * 1024


def bulk_shared_bytes(ring: int, chunk: int, warps: int = 4) -> int:
    return warps * ring * (chunk + 8)


def main() -> dict[str, Any]:
    sms = cupy.cuda.runtime.getDeviceProperties(0)["multiProcessorCount"]
    source, sink, stream = window_read_buffers()
    rows = []
    for per_sm, threads, unroll in REGS:
        read = get_kernel(REGS_SOURCE, "read_unrolled", UNROLL=unroll)
        samples = window_read_samples(read, per_sm * sms, threads, source, sink, stream, NBYTES)
        warps = per_sm * threads // 32
        rows.append(window_read_row(samples, NBYTES, mode="regs", warps_per_sm=warps, unroll=unroll,
                                    inflight_per_sm=warps * 32 * 16 * unroll))
        print(rows[-1], flush=True)
    for per_sm, ring, chunk in BULK:
        shared = bulk_shared_bytes(ring, chunk)
        if per_sm * shared > OPT_IN_SHARED:
            continue
        kernel = get_kernel(BULK_SOURCE, "read_bulk_ring", RING=ring, CHUNK=chunk)
        kernel.max_dynamic_shared_size_bytes = shared

        def read(grid: tuple[int], block: tuple[int], args: tuple, kernel: Any = kernel, shared: int = shared) -> None:
            kernel(grid, block, args, shared_mem=shared)

        samples = window_read_samples(read, per_sm * sms, 128, source, sink, stream, NBYTES)
        rows.append(window_read_row(samples, NBYTES, mode="bulk", warps_per_sm=per_sm * 4, ring=ring, chunk=chunk,
                                    inflight_per_sm=per_sm * 4 * ring * chunk))
        print(rows[-1], flush=True)
    roof = roofline.measure()["read_tbps"]
    for row in rows:
        row["pct_roofline"] = 100.0 * row["tbps"] / roof
    return {"nbytes": NBYTES, "reads": rows, "roofline_read_tbps": roof}


if __name__ == "__main__":
    result = main()
    with open(os.path.join(os.environ.get("OUT", "."), "diag_inflight_reads.json"), "w") as f:
        json.dump(result, f, indent=1)
