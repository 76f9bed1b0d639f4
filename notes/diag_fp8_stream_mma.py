"""H200 diagnostic (written 2026-12-04): FP8 weights streamed into tensor-core work, loads into registers against a
ring of bulk copies into shared memory, at the residency of the lab's FP8 tensor-core kernels.

Run from the repo root on a GPU: ``PYTHONPATH=. python3 notes/diag_fp8_stream_mma.py`` (writes
``$OUT/diag_fp8_stream_mma.json``, committed as results/diag-2026-12-04-fp8-stream-mma.json; under a minute; what it
found: notes/FINDINGS.md, "What an FP8 weight stream costs on its own").

Why: at qwen3-30b the FP8 tensor-core kernels stream 66-89 % of the read roofline where their bf16 twins stream
87-97 % (results/h200-2026-12-04-tiled-auto-stages-30b-*.json), and a pure read reaches 95 % at their 16 warps per SM
and 64 KB in flight (notes/diag_inflight_reads.py). A kernel warp loads a round of k blocks, waits for all of it,
then widens and multiplies with nothing of its own in flight; a ring filled by the copy engine would keep streaming
through that work. This measures both forms with the kernels' work per weight byte and nothing else:

* a warp owns CHUNK contiguous bytes at a time (a tile strip of fp8-block128-t16: 16 rows x 64 values = 1 KB per k
  block); per k block each lane takes 32 bytes (16 of row g, 16 of row g + 8), and with ``WORK`` 2 widens them to
  four bf16 A fragments (the library's 3-instruction byte-permute widening, kernels/device_helpers.py) and runs four
  ``mma.sync`` m16n8k16 against one 8-column B fragment held in registers (an 8-pair pass; B's own loads, the scales
  and the epilogue are left out); ``WORK`` 1 widens only, 0 only XOR-folds the bytes; ``WORK`` 3 loads each k
  block's B fragment as the gate_up loads x (``__ldg`` beside the round's A loads, then the 2^8 multiply) and 4 as
  the down loads the intermediate (a coherent load after the round's A loads), from B_BYTES of bf16 rows (32 KB:
  L1-resident, as a gate_up block's x; 1 MB: L2, as a down's intermediate at T = 64);
* ``regs``: UNROLL k blocks per lane loaded into registers, then the round's work (the kernels' rounds), a warp
  taking 8 KB at a time (``WORK`` 0 there would let ptxas sink the loads: the plain read below stands for it);
* ``read``: notes/diag_small_reads.py's grid-stride read at the same 16 warps per SM, UNROLL 16-byte loads a lane;
* ``ring``: per warp a ring of RING stages of CHUNK bytes filled by ``cp.async.bulk`` (lane 0, an mbarrier per stage;
  the stage is refilled once the warp has read it), the work reading each k block from shared memory.

4-warp blocks, 4 per SM (16 warps per SM, as the kernels at 122-128 registers), each configuration reading 256 MiB,
each read a different window of a 4 GiB buffer (past 3x L2), 48 reads per CUDA graph
(tools.roofline.window_read_samples); TB/s and % of the streaming-read roofline measured in the same process.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import cupy

sys.path.insert(0, os.path.dirname(__file__))
from diag_inflight_reads import (  # noqa: E402  (a per-warp ring of bulk copies, its shared memory)
    BULK_RING_HELPERS,
    OPT_IN_SHARED,
    bulk_shared_bytes,
)
from diag_small_reads import SOURCE as READ_SOURCE  # noqa: E402  (the grid-stride read with UNROLL loads in flight)

from kernels.compile import CudaSource, get_kernel  # noqa: E402
from kernels.device_helpers import FP8_HELPERS, MMA_HELPERS, WARP_HELPERS  # noqa: E402
from tools import roofline  # noqa: E402
from tools.roofline import window_read_buffers, window_read_row, window_read_samples  # noqa: E402

SOURCE = CudaSource(
    name="diag_fp8_stream_mma",
    description="notes/diag_fp8_stream_mma.py: FP8 k blocks streamed into widening and mma, registers or a ring",
    kernels=("stream_regs", "stream_ring"),
    defaults={"WORK": 2, "UNROLL": 4, "REGS_CHUNK": 8192, "RING": 2, "CHUNK": 4096, "WARPS": 4, "FP8_PRMT": 2,
              "B_BYTES": 32768},
    code=WARP_HELPERS + FP8_HELPERS + MMA_HELPERS + BULK_RING_HELPERS + r"""
// a lane's 32 bytes of one k block (rows g and g + 8) into the warp's work: acc (mma), or fold (XOR). gate (0 at run
// time): WORK 0 / 1 have no accumulator to hang the round's all_loads_arrived on, so their inputs take it instead.
__device__ __forceinline__ void kblock_work(uint4 lo, uint4 hi, const uint4 (&b)[2], float (&acc)[4], u32& fold,
                                            u32 gate) {
#if WORK < 2
    lo.x ^= gate; lo.y ^= gate; lo.z ^= gate; lo.w ^= gate; hi.x ^= gate; hi.y ^= gate; hi.z ^= gate; hi.w ^= gate;
#else
    (void)gate;
#endif
#if WORK >= 2
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
        const uint4 a_lo = e4m3x8_to_bf16x8(h == 0 ? make_uint2(lo.x, lo.y) : make_uint2(lo.z, lo.w));
        const uint4 a_hi = e4m3x8_to_bf16x8(h == 0 ? make_uint2(hi.x, hi.y) : make_uint2(hi.z, hi.w));
        mma_k32(acc, a_lo, a_hi, b[h]);
    }
#elif WORK == 1
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
        const uint4 a_lo = e4m3x8_to_bf16x8(h == 0 ? make_uint2(lo.x, lo.y) : make_uint2(lo.z, lo.w));
        const uint4 a_hi = e4m3x8_to_bf16x8(h == 0 ? make_uint2(hi.x, hi.y) : make_uint2(hi.z, hi.w));
        fold ^= a_lo.x ^ a_lo.y ^ a_lo.z ^ a_lo.w ^ a_hi.x ^ a_hi.y ^ a_hi.z ^ a_hi.w;
    }
#else
    fold ^= lo.x ^ lo.y ^ lo.z ^ lo.w ^ hi.x ^ hi.y ^ hi.z ^ hi.w;
#endif
}

__device__ __forceinline__ uint4 ld_coherent(const uint4* p) {   // as the kernels' ld_dep: a volatile plain load
    uint4 v;
    asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

__device__ __forceinline__ void finish(const float (&acc)[4], u32 fold, unsigned int* sink) {
    fold ^= __float_as_uint(acc[0] + acc[1] + acc[2] + acc[3]);
    if (fold == 0x9E3779B9u) atomicAdd(sink, 1u);                    // never in practice: keeps the work alive
}

// Warp w of the grid takes chunks w, w + W, ... (W = the grid's warps) of REGS_CHUNK bytes, UNROLL 1 KB k blocks a
// round.
// Every load of a round is made to arrive before its first use (all_loads_arrived, as the library's rounds do).
static_assert(REGS_CHUNK % (1024 * UNROLL) == 0, "REGS_CHUNK is a whole number of rounds of 1 KB k blocks");
extern "C" __global__ void __launch_bounds__(WARPS * 32) stream_regs(const uint4* __restrict__ src,
                                                                   unsigned long long n16,
                                                                   unsigned int* __restrict__ sink) {
    const int lane = threadIdx.x & 31;
    const unsigned long long chunks = n16 * 16ull / REGS_CHUNK;
    const unsigned long long step = (unsigned long long)gridDim.x * WARPS;
    const uint4 b_fixed = make_uint4(0x3F803F80u ^ lane, 0x3F803F80u, 0x3F803F80u, 0x3F803F80u);
    // WORK 3 / 4: lane (g, q)'s B chunks of k block kb: column g's row (B_BYTES / 8 bytes of bf16 at the start of
    // src), bytes 128 kb + 32 q .. + 31, as the kernels' x / intermediate fragments
    const uint4* b_row = src + (size_t)(lane >> 2) * (B_BYTES / 8 / 16) + 2 * (lane & 3);
    constexpr int B_KBLOCKS = B_BYTES / 8 / 128;                     // k blocks a B row holds (a power of two)
    static_assert((B_KBLOCKS & (B_KBLOCKS - 1)) == 0, "B_BYTES / 1024 must be a power of two");
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    u32 fold = 0u;
    for (unsigned long long c = (unsigned long long)blockIdx.x * WARPS + (threadIdx.x >> 5); c < chunks; c += step) {
        const uint4* chunk = src + c * (REGS_CHUNK / 16);
        const int kb0 = (int)(c * (REGS_CHUNK / 1024) & (B_KBLOCKS - 1));   // this chunk's first k block in B's rows
        (void)kb0;
        for (int k0 = 0; k0 < REGS_CHUNK / 1024; k0 += UNROLL) {
            uint4 v[UNROLL][2];                                      // rows g, g + 8 of each k block
            uint4 b[UNROLL][2];
            #pragma unroll
            for (int j = 0; j < UNROLL; ++j) {
                v[j][0] = __ldg(chunk + (k0 + j) * 64 + lane);
                v[j][1] = __ldg(chunk + (k0 + j) * 64 + 32 + lane);
#if WORK == 3
                const int kb = (kb0 + k0 + j) & (B_KBLOCKS - 1);
                b[j][0] = __ldg(b_row + 8 * kb);
                b[j][1] = __ldg(b_row + 8 * kb + 1);
#else
                b[j][0] = b[j][1] = b_fixed;
#endif
            }
#if WORK == 4
            #pragma unroll
            for (int j = 0; j < UNROLL; ++j) {                       // after the round's A loads, coherent
                const int kb = (kb0 + k0 + j) & (B_KBLOCKS - 1);
                b[j][0] = ld_coherent(b_row + 8 * kb);
                b[j][1] = ld_coherent(b_row + 8 * kb + 1);
            }
#endif
            const u32 gate = all_loads_arrived(v);
            acc[0] += __uint_as_float(gate);                         // += 0.0f, after every load of the round
            #pragma unroll
            for (int j = 0; j < UNROLL; ++j) {
#if WORK >= 3
                #pragma unroll
                for (int h = 0; h < 2; ++h)                          // FP8_PRMT 2: the 2^8 on the B fragments
                    b[j][h] = make_uint4(bf16x2_times_256(b[j][h].x), bf16x2_times_256(b[j][h].y),
                                         bf16x2_times_256(b[j][h].z), bf16x2_times_256(b[j][h].w));
#endif
                kblock_work(v[j][0], v[j][1], b[j], acc, fold, gate);
            }
        }
    }
    finish(acc, fold, sink);
}

// The same chunks through notes/diag_inflight_reads.py's ring of RING stages per warp, each stage's k blocks into
// the work as they arrive.
struct StageWork {
    uint4 b[2];
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    u32 fold = 0u;
    __device__ __forceinline__ void operator()(const uint4* stage, int lane) {
        #pragma unroll 4
        for (int k = 0; k < CHUNK / 1024; ++k)
            kblock_work(stage[k * 64 + lane], stage[k * 64 + 32 + lane], b, acc, fold, 0u);
    }
};

extern "C" __global__ void __launch_bounds__(WARPS * 32) stream_ring(const uint4* __restrict__ src,
                                                                   unsigned long long n16,
                                                                   unsigned int* __restrict__ sink) {
    const int lane = threadIdx.x & 31;
    StageWork work;
    work.b[0] = work.b[1] = make_uint4(0x3F803F80u ^ lane, 0x3F803F80u, 0x3F803F80u, 0x3F803F80u);
    ring_stream(src, n16, work);
    finish(work.acc, work.fold, sink);
}
""",
)

NBYTES = 256 << 20
BLOCKS_PER_SM = 4  # x 4 warps: 16 warps per SM, as the FP8 tensor-core kernels
REGS_CHUNK = 8192  # a warp's contiguous bytes at a time in the register form (8 k blocks; a whole number of rounds)
REGS = [(work, unroll, 32768) for work in (1, 2) for unroll in (2, 4, 8)] + [
    (work, unroll, b_bytes) for work in (3, 4) for unroll in (2, 4) for b_bytes in (32768, 1 << 20)]
READS = (4, 8)  # the plain grid-stride read (notes/diag_small_reads.py) at 16 warps per SM: UNROLL 16-byte loads
RING = [(work, ring, chunk) for work in (0, 1, 2) for ring, chunk in ((2, 4096), (3, 4096), (4, 2048), (6, 2048))]


def main() -> dict[str, Any]:
    sms = cupy.cuda.runtime.getDeviceProperties(0)["multiProcessorCount"]
    source, sink, stream = window_read_buffers()
    rows = []
    for unroll in READS:  # the same residency's pure read, in this process
        read = get_kernel(READ_SOURCE, "read_unrolled", UNROLL=unroll)
        samples = window_read_samples(read, 2 * sms, 256, source, sink, stream, NBYTES)
        rows.append(window_read_row(samples, NBYTES, form="read", work=0, unroll=unroll,
                                    inflight_per_sm=16 * 32 * 16 * unroll))
        print(rows[-1], flush=True)
    for work, unroll, b_bytes in REGS:
        kernel = get_kernel(SOURCE, "stream_regs", WORK=work, UNROLL=unroll, REGS_CHUNK=REGS_CHUNK, B_BYTES=b_bytes)
        samples = window_read_samples(kernel, BLOCKS_PER_SM * sms, 128, source, sink, stream, NBYTES)
        rows.append(window_read_row(samples, NBYTES, form="regs", work=work, unroll=unroll, b_bytes=b_bytes,
                                    inflight_per_sm=BLOCKS_PER_SM * 4 * 32 * 32 * unroll,
                                    registers=kernel.num_regs))
        print(rows[-1], flush=True)
    for work, ring, chunk in RING:
        shared = bulk_shared_bytes(ring, chunk)
        if BLOCKS_PER_SM * shared > OPT_IN_SHARED:
            continue
        kernel = get_kernel(SOURCE, "stream_ring", WORK=work, RING=ring, CHUNK=chunk)
        kernel.max_dynamic_shared_size_bytes = shared

        def read(grid: tuple[int], block: tuple[int], args: tuple, kernel: Any = kernel, shared: int = shared) -> None:
            kernel(grid, block, args, shared_mem=shared)

        samples = window_read_samples(read, BLOCKS_PER_SM * sms, 128, source, sink, stream, NBYTES)
        rows.append(window_read_row(samples, NBYTES, form="ring", work=work, ring=ring, chunk=chunk,
                                    inflight_per_sm=BLOCKS_PER_SM * 4 * ring * chunk, registers=kernel.num_regs))
        print(rows[-1], flush=True)
    roof = roofline.measure()["read_tbps"]
    for row in rows:
        row["pct_roofline"] = 100.0 * row["tbps"] / roof
    return {"nbytes": NBYTES, "blocks_per_sm": BLOCKS_PER_SM, "reads": rows, "roofline_read_tbps": roof}


if __name__ == "__main__":
    result = main()
    with open(os.path.join(os.environ.get("OUT", "."), "diag_fp8_stream_mma.json"), "w") as f:
        json.dump(result, f, indent=1)
