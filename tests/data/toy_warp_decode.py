"""Toy warp decode: the smallest complete variant, a template to copy (one warp per output, plain loops).

Hypothesis: none -- this file is the "add a variant" walkthrough's example (README), exercised by
tests/test_add_a_variant.py. Result, verdict, results file: none; a real prototype records them here.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kernels.compile import CudaSource, launch_ex
from kernels.contract import BF16, Dims
from kernels.device_helpers import WARP_HELPERS
from kernels.family import Compiled, KernelFamily, Stage
from kernels.variants import register

CODE = WARP_HELPERS + r"""
// gate_up: warp w owns pair p = w / I (token p / K, slot p % K) and neuron i = w % I
extern "C" __global__ void __launch_bounds__(WARPS * 32) toy_gate_up(
    const bf16_t* __restrict__ x, const bf16_t* __restrict__ w13, const int* __restrict__ ids,
    bf16_t* __restrict__ inter, int tokens, int hidden, int intermediate, int experts, int top_k)
{
    const long long w = (long long)blockIdx.x * WARPS + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (w >= (long long)tokens * top_k * intermediate) return;
    const long long pair = w / intermediate;
    const int e = ids[pair];
    if ((unsigned)e >= (unsigned)experts) { if (lane == 0) inter[w] = BF16_NAN; return; }  // bad id: no read
    const u32* xr = reinterpret_cast<const u32*>(x + (pair / top_k) * hidden);
    const u32* g = reinterpret_cast<const u32*>(w13 + ((size_t)e * 2 * intermediate + w % intermediate) * hidden);
    const u32* u = g + (size_t)intermediate * hidden / 2;
    float gate = 0.0f, up = 0.0f;
    for (int c = lane; c < hidden / 2; c += 32) {   // two bf16 per 32-bit word, FP32 accumulators
        gate = fmaf(bf16_lo(g[c]), bf16_lo(xr[c]), fmaf(bf16_hi(g[c]), bf16_hi(xr[c]), gate));
        up = fmaf(bf16_lo(u[c]), bf16_lo(xr[c]), fmaf(bf16_hi(u[c]), bf16_hi(xr[c]), up));
    }
    gate = warp_sum(gate);
    up = warp_sum(up);
    if (lane == 0) inter[w] = f32_to_bf16(gate / (1.0f + expf(-gate)) * up);
}

// down: warp w owns out[t, h] (t = w / H, h = w % H): sum over the K slots into one FP32 accumulator
extern "C" __global__ void __launch_bounds__(WARPS * 32) toy_down(
    const bf16_t* __restrict__ inter, const bf16_t* __restrict__ w2, const int* __restrict__ ids,
    const float* __restrict__ weights, bf16_t* __restrict__ out, int tokens, int hidden, int intermediate,
    int experts, int top_k)
{
    const long long w = (long long)blockIdx.x * WARPS + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (w >= (long long)tokens * hidden) return;
    const long long t = w / hidden;
    float acc = 0.0f;
    for (int k = 0; k < top_k; ++k) {
        const int e = ids[t * top_k + k];
        if ((unsigned)e >= (unsigned)experts) { if (lane == 0) out[w] = BF16_NAN; return; }
        const u32* row = reinterpret_cast<const u32*>(w2 + ((size_t)e * hidden + w % hidden) * intermediate);
        const u32* in = reinterpret_cast<const u32*>(inter + (t * top_k + k) * intermediate);
        const float weight = weights[t * top_k + k];
        for (int c = lane; c < intermediate / 2; c += 32)
            acc = fmaf(bf16_lo(row[c]), weight * bf16_lo(in[c]), fmaf(bf16_hi(row[c]), weight * bf16_hi(in[c]), acc));
    }
    acc = warp_sum(acc);
    if (lane == 0) out[w] = f32_to_bf16(acc);
}
"""


def rules(dims: Dims | None, values: dict[str, int]) -> dict[str, int]:
    """WARPS = 0 (auto): one-warp blocks while the gate_up grid is small (spread over more SMs), else 4."""
    if values["WARPS"] == 0:
        small = dims is not None and dims.tokens * dims.top_k * dims.intermediate < 4096
        values["WARPS"] = 1 if small else 4
    return values


def workspace(dims: Dims, params: dict[str, int]) -> Any:
    import cupy

    return cupy.empty((dims.tokens, dims.top_k, dims.intermediate), dtype=BF16)  # the bf16 intermediate


def stages(c: Compiled, x: Any, w13: Any, w2: Any, topk_ids: Any, topk_weights: Any, out: Any) -> list[Stage]:
    if out.dtype != BF16:
        raise TypeError(f"out must be bfloat16 (the toy writes bf16 only), got {out.dtype}")
    d, warps = c.dims, c.params["WARPS"]
    sizes = tuple(np.int32(n) for n in (d.tokens, d.hidden, d.intermediate, d.experts, d.top_k))

    def grid(outputs: int) -> tuple[int]:
        return (-(-outputs // warps),)

    def gate_up() -> None:
        launch_ex(c.kernels["toy_gate_up"], grid(d.tokens * d.top_k * d.intermediate), (32 * warps,),
                  (x, w13, topk_ids, c.workspace, *sizes))

    def down() -> None:
        launch_ex(c.kernels["toy_down"], grid(d.tokens * d.hidden), (32 * warps,),
                  (c.workspace, w2, topk_ids, topk_weights, out, *sizes))

    return [("gate_up", gate_up), ("down", down)]


FAMILY = KernelFamily(
    name="toy-warp-decode",
    source=CudaSource("toy_warp_decode", CODE, ("toy_gate_up", "toy_down"), defaults={"WARPS": 4},
                      warps_knobs={"toy_gate_up": "WARPS", "toy_down": "WARPS"}),
    limits={"WARPS": (0, 32)},
    auto_knobs=("WARPS",),
    rules=rules,
    workspace=workspace,
    stages=stages,
)
VARIANT = register(FAMILY.variant("proto:toy-warp-decode", reference_mode="warp_decode",
                                  description="toy warp decode: one warp per output, plain loops",
                                  grid={"WARPS": [1, 2, 4, 8]}))
