"""How mma.sync (bf16 in, FP32 accumulate) and mul.rn.bf16x2 treat subnormals: subnormal bf16 inputs, products
below FP32's normal range, a subnormal accumulator. Each lane's A and B fragment registers hold one value in every
half, so d = 16 a b + c. Run on a GPU from the repo root: ``python3 notes/diag_mma_subnormals.py`` (the H200's
answer, 2026-12-02: every case exact -- results/h200-2026-12-02-fp8-widening-checks.log; the FP8 widening's
write-up is in notes/PROTOTYPES.md, "FP8 fragments by byte permute")."""
from __future__ import annotations

import cupy
import numpy as np

SRC = r'''
extern "C" __global__ void mma1(const unsigned* ab, const float* c, float* d) {
    const unsigned a = ab[0] | (ab[0] << 16), b = ab[1] | (ab[1] << 16);
    float d0, d1, d2, d3;
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%10,%11,%12,%13};" : "=f"(d0), "=f"(d1), "=f"(d2), "=f"(d3)
                 : "r"(a), "r"(a), "r"(a), "r"(a), "r"(b), "r"(b), "f"(c[0]), "f"(c[0]), "f"(c[0]), "f"(c[0]));
    if (threadIdx.x == 0) d[0] = d0;
}
extern "C" __global__ void mul1(const unsigned* ab, unsigned* d) {
    unsigned out;
    asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(out) : "r"(ab[0] | (ab[0] << 16)), "r"(0x43804380u));
    d[0] = out;
}
'''
mod = cupy.RawModule(code=SRC)
mma, mul = mod.get_function("mma1"), mod.get_function("mul1")


def bf16(v: float) -> int:
    return int(np.array(v, np.float32).view(np.uint32)) >> 16


CASES = (
    ("normal a, b", 2.0**-3, 2.0**-2, 0.0),
    ("subnormal a (2^-130) x 2^100", 2.0**-130, 2.0**100, 0.0),
    ("subnormal a (2^-133) x 2^120", 2.0**-133, 2.0**120, 0.0),
    ("products 2^-130 (a 2^-100, b 2^-30)", 2.0**-100, 2.0**-30, 0.0),
    ("products 2^-140", 2.0**-100, 2.0**-40, 0.0),
    ("subnormal c 2^-130, zero products", 0.0, 1.0, 2.0**-130),
    ("products 2^-128 plus c 2^-100", 2.0**-100, 2.0**-28, 2.0**-100),
)
for what, a, b, c in CASES:
    ab = cupy.asarray([bf16(a), bf16(b)], cupy.uint32)
    cc = cupy.asarray([c], cupy.float32)
    d = cupy.zeros(1, cupy.float32)
    mma((1,), (32,), (ab, cc, d))
    exact = 16 * np.float64(np.array(bf16(a) << 16, np.uint32).view(np.float32)) * \
        np.float64(np.array(bf16(b) << 16, np.uint32).view(np.float32)) + c
    print(f"mma {what}: got {float(d.get()[0]):.6e}, exact {exact:.6e}", flush=True)
for v in (2.0**-130, 2.0**-133, 1.5 * 2.0**-128):
    ab = cupy.asarray([bf16(v), 0], cupy.uint32)
    d = cupy.zeros(1, cupy.uint32)
    mul((1,), (1,), (ab, d))
    got = np.array((int(d.get()[0]) & 0xFFFF) << 16, np.uint32).view(np.float32)
    print(f"mul.rn.bf16x2 {v:.3e} x 2^8: got {float(got):.6e}, exact {v * 256:.6e}", flush=True)
