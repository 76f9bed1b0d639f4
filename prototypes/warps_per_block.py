"""Prototype: warps per block in the strict kernels -- GU_WARPS x DN_WARPS in {4, 8, 16}^2 (no new CUDA).

Hypothesis. The strict kernels have no shared memory and no inter-warp sync, so a block is only a scheduling
unit: its size sets (a) how many blocks fit per SM under the register file -- 65536 / (32 * warps) registers per
thread at most for ONE block to launch (4 warps: 512, 8: 256, 16: 128; ptxas caps at 255 anyway) and
65536 / (32 * warps * blocks) for ``blocks`` resident -- and (b) the granularity of the last wave: 16-warp blocks
leave bigger holes when the warp count does not divide evenly over 132 SMs, while more small blocks cost more
block launches in the ramp.

Prediction with arithmetic (H200, 132 SMs, streaming-read roofline ~4.5 TB/s; strict defaults measured 25 us
(qwen3-30b-a3b) and 78 us (qwen3-235b-a22b) per layer at T = 1). Registers (offline report, sm_90, resolved
knobs, 2026-11-30 source): gate_up 64 at GU_WARPS 4 / 8 / 16 (<= 128 so a 16-warp block launches) -> 32 warps
per SM in all three (8 / 4 / 2 blocks); down 61 with the auto DN_MIN_BLOCKS 8 / 4 / 2 -> 32 warps per SM in all.
So occupancy is equal and only granularity differs:

    blocks of work (GU_WARPS 4 / 8 / 16)     gate_up T*K*I warps               down T*H warps (DN_WARPS 4/8/16)
    qwen3-30b-a3b    T=1   6144 warps   1536 / 768 / 384 (1.45 waves)     2048: 512 / 256 / 128 (< 1 wave)
                     T=8  49152        12288 / 6144 / 3072 (11.6 waves)   16384: 4096 / 2048 / 1024 (3.9)
    qwen3-235b-a22b  T=1  12288         3072 / 1536 / 768 (2.9 waves)     4096: 1024 / 512 / 256 (0.97)
                     T=8  98304        24576 / 12288 / 6144 (23.3)        32768: 8192 / 4096 / 2048 (7.8)

Down at 30b T=1 with 16-warp blocks: 128 blocks on 132 SMs (4 idle, 16 warps on the rest) vs 512 4-warp
blocks (3-4 per SM): the same 2048 warps spread slightly worse; 235b T=1 16-warp: 256 blocks = 124 SMs with 2 and
8 with 1. Predicted: all 9 points within +-3 % at T = 8 (many waves); at T = 1 the 16-warp points 1-4 % slower
than 4-warp ones from the coarser partial wave (~0.3-1 us of 25 us), 4 x 4 / 8 x 4 best. The strict default
(GU_WARPS 2, DN_WARPS 4) is not in this grid: sweep it beside.

Numerics: warps per block change no summation order -- bitwise equal to ``cupy:warp-decode`` (GPU test).

Result on the H200 (2026-11-30, NVIDIA H200, cupy-cuda13x 14.2.0; results/sweep-proto-warps-per-block.json;
qwen3-30b-a3b only -- qwen3-235b-a22b was not swept; uniform routing, decode-step CUDA graphs with PDL, weights
rotated past 3x L2, 8 repeats). Median us per layer, % of the run's 4.47 TB/s read roofline; T = 1 / 8 IQRs
<= 0.4 us. Compile columns: gate_up 64 and down 114 registers at every point (down differs from the offline 61
above; not investigated), spill-free. The strict default (GU_WARPS 2, DN_WARPS 4; gate_up 70 registers) is from
results/sweep-proto-outputs-per-warp.json (another run):

    GU_WARPS x DN_WARPS   T = 1 us       T = 8 us       T = 32 us (IQR)
    4 x 4                 24.1 (70 %)    134.8 (78 %)   529.3 (2.5)
    4 x 8                 23.9 (71 %)    136.0 (78 %)   532.1 (0.0)
    4 x 16                24.2 (70 %)    136.9 (77 %)   561.2 (117)
    8 x 4                 24.2 (70 %)    135.5 (78 %)   548.1 (16.3)
    8 x 8                 24.0 (70 %)    136.5 (77 %)   533.0 (1.2)
    8 x 16                24.3 (69 %)    137.4 (77 %)   593.7 (46.0)
    16 x 4                24.8 (68 %)    136.5 (77 %)   562.0 (14.8)
    16 x 8                24.8 (68 %)    137.3 (77 %)   535.2 (2.0)
    16 x 16               25.0 (68 %)    138.2 (76 %)   585.8 (22.3)
    2 x 4 (strict)        23.2 (73 %)    134.3 (79 %)   530.0 (0.8)

Against the prediction: at T = 8 all nine points are within +-3 % (134.8-138.2 us), as predicted. At T = 1 the
16-warp gate_up blocks are 0.7-0.9 us (~3 %) slower than the 4-warp ones, inside the predicted 1-4 %; DN_WARPS
4 / 8 / 16 changes T = 1 by <= 0.3 us (the predicted coarser down wave at 16 does not show). The best T = 1 point
(4 x 8, 23.9 us) is 0.7 us slower than the strict 2-warp gate_up blocks (23.2 us, separate run; the gate_up
register count differs, 64 vs 70). T = 32 spreads 529-594 us with IQRs up to 117 us: not resolvable.

Conclusion: block size is a granularity knob worth < 1 us here; the strict defaults stay (GU_WARPS 2, which beats
every point of this grid at T = 1; DN_WARPS 4, indistinguishable from 8 and 16 at T = 1 and within ~1.5 % at T = 8).
Nothing further to try along this axis.
"""

from __future__ import annotations

from kernels.variants import Variant, register
from kernels.warp_decode_cupy import AUTO_KNOBS, DEFAULTS, build

GRID = {"GU_WARPS": [4, 8, 16], "DN_WARPS": [4, 8, 16]}

VARIANT = register(
    Variant(
        name="proto:warps-per-block",
        backend="cupy",
        family="warps-per-block",
        build=build,
        reference_mode="warp_decode",
        params={**DEFAULTS, **{knob: 0 for knob in AUTO_KNOBS}},
        description="strict warp decode, GU_WARPS x DN_WARPS warps per block (scheduling granularity)",
        grid=GRID,
    )
)
