"""H200 diagnostic (2026-12-03): how many cycles does widening e4m3 weights cost, per 2 values, in each form?

Run from the repo root on a GPU: ``PYTHONPATH=. python3 notes/diag_fp8_widen_rate.py`` (prints JSON; committed as
results/diag-2026-12-03-fp8-widen-rate.json).

Nsight Compute put the FP8 tensor-core gate_up at qwen3-235b T = 64 Zipf at 49 % issue slots and 44.5 % of the ALU
pipe (results/ncu-2026-12-03-fp8-235b-t64-zipf.txt); about half its instructions widen e4m3 to bf16 (PRMT, SHL,
LOP3 per 2 values, FP8_PRMT 2). sm_90 has no mma.sync on FP8 operands (ptxas lowers
``mma.sync.m16n8k32.e4m3`` to F2FP.F16.E4M3.UNPACK_B and an f16 HMMA), but the same single instruction per 2
values widens to fp16, exactly. This times register-resident streams of words widened by each form, at full
occupancy, with nothing else to do: per thread 16 words, ITERS rounds, every widened pair XOR-folded into an
accumulator (one LOP3 per word in every form) so nothing is dead code.

* ``prmt``  the library's FP8_PRMT 2 widening (kernels/device_helpers.py, e4m3x8_to_bf16x8): bf16 x 2^-120
* ``cvt16`` cvt.rn.f16x2.e4m3x2: fp16, exact
* ``cvt16_bf16`` cvt to fp16 then re-encoded as bf16 (the FP8_PRMT 0 form)
"""

from __future__ import annotations

import json
import sys

import cupy

from kernels.compile import CudaSource, get_kernel
from kernels.device_helpers import FP8_HELPERS, WARP_HELPERS

FORMS = {"prmt": 2, "cvt16": 1, "cvt16_bf16": 0}
ITERS = 2048

SOURCE = CudaSource(
    name="diag_fp8_widen_rate",
    description="notes/diag_fp8_widen_rate.py: e4m3 widening forms, issue-bound",
    kernels=("widen",),
    defaults={"FORM": 2, "FP8_PRMT": 2},
    code=WARP_HELPERS + FP8_HELPERS + r"""
// FORM 2: FP8_PRMT 2 (prmt, shl, lop3 per 2 values); 1: cvt.rn.f16x2.e4m3x2; 0: cvt then re-encoded as bf16
extern "C" __global__ void widen(unsigned int seed, int iters, unsigned int* __restrict__ sink) {
    u32 w[16];
    #pragma unroll
    for (int i = 0; i < 16; ++i) w[i] = seed * (threadIdx.x + 7u * i + 1u) ^ (blockIdx.x << i);
    u32 acc = 0u;
    for (int it = 0; it < iters; ++it) {
        #pragma unroll
        for (int i = 0; i < 16; i += 2) {
            uint4 v;
#if FORM == 2 || FORM == 0
            v = e4m3x8_to_bf16x8(make_uint2(w[i], w[i + 1]));
#else
            v = make_uint4(e4m3x2_to_f16x2(w[i]), e4m3x2_to_f16x2(w[i] >> 16),
                           e4m3x2_to_f16x2(w[i + 1]), e4m3x2_to_f16x2(w[i + 1] >> 16));
#endif
            acc ^= v.x ^ v.y;
            acc ^= v.z ^ v.w;
            w[i] += acc;  // the next round's words depend on this one: no hoisting
        }
    }
    if (acc == 0x9E3779B9u) atomicAdd(sink, 1u);
}
""",
)


def main() -> None:
    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    sink = cupy.zeros(1, dtype=cupy.uint32)
    blocks, threads = sms * 8, 256
    out: dict[str, object] = {"date": "2026-12-03", "sms": sms, "blocks": blocks, "threads": threads, "iters": ITERS,
                              "words_per_thread_round": 16, "forms": {}}
    for form, value in FORMS.items():
        prmt = 2 if value == 2 else 0
        kernel = get_kernel(SOURCE, "widen", FORM=value, FP8_PRMT=prmt)
        args = (cupy.uint32(2654435761), cupy.int32(ITERS), sink)
        kernel((blocks,), (threads,), args)
        cupy.cuda.runtime.deviceSynchronize()
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        samples = []
        for _ in range(7):
            start.record()
            kernel((blocks,), (threads,), args)
            stop.record()
            stop.synchronize()
            samples.append(cupy.cuda.get_elapsed_time(start, stop))
        samples.sort()
        ms = samples[len(samples) // 2]
        words = blocks * threads * ITERS * 16
        clock_hz = cupy.cuda.Device().attributes["ClockRate"] * 1e3
        # SM cycles per warp-instruction slot: cycles x SMs / (words / 32 lanes) = SM-cycles per warp-word
        cycles_per_warp_word = ms * 1e-3 * clock_hz * sms / (words / 32)
        out["forms"][form] = {"median_ms": ms, "samples_ms": samples, "words": words,
                              "sm_cycles_per_warp_word": cycles_per_warp_word}
        print(form, f"{ms:.3f} ms", f"{cycles_per_warp_word:.3f} SM-cycles per warp-word (2 pairs)", file=sys.stderr)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
