"""Prototype: outputs per warp in the strict kernels -- GU_OUTS x DN_OUTS in {1, 2, 4}^2 (no new CUDA).

Hypothesis. A warp that owns ``GU_OUTS`` consecutive gate_up neurons loads ``x[t]`` once for all of them
(2 * GU_OUTS weight rows per x row), and a down warp that owns ``DN_OUTS`` consecutive hidden units loads each
intermediate chunk once for DN_OUTS w2 rows: fewer load instructions per weight byte frees issue slots. But the
warps get fewer and fatter: more registers per lane (fewer resident warps per SM) and, at T = 1, fewer warps in
total -- and latency hiding in a streaming kernel comes from bytes in flight per SM, which needs warps.

Prediction with arithmetic (H200, 132 SMs, streaming-read roofline ~4.5 TB/s; strict defaults measured 25 us
(qwen3-30b-a3b) and 78 us (qwen3-235b-a22b) per layer at T = 1; ~0.8 us loaded DRAM latency -> ~27 KB in
flight per SM needed). Load instructions per lane per round (gate_up, GU_UNROLL 8): 2 * GU_OUTS * 8 weight +
8 x loads, so x is 1/3, 1/5, 1/9 of gate_up's loads for GU_OUTS 1, 2, 4. Registers (offline report, sm_90,
qwen3-30b T=1 resolved knobs, 2026-11-30 source): gate_up 70 / 112 / 159 -> 28 / 18 / 12 resident warps per SM
(2-warp blocks); down DN_OUTS 1 / 2 / 4 -> auto DN_SLOTS 4 / 2 / 1, 61 / 56 / 56 registers, 32 / 36 / 36 warps.

    warps of work                 gate_up T*K*I/GU_OUTS       down T*H/DN_OUTS
    qwen3-30b-a3b    T=1          6144 / 3072 / 1536          2048 / 1024 / 512
                     T=8          49152 / 24576 / 12288       16384 / 8192 / 4096
    qwen3-235b-a22b  T=1          12288 / 6144 / 3072         4096 / 2048 / 1024
                     T=8          98304 / 49152 / 24576       32768 / 16384 / 8192

Down at 30b T=1 with DN_OUTS 4: 512 warps = 3.9 per SM, each with 1 slot x 4 rows x 16 B per lane in flight =
8 KB per SM, a third of the ~27 KB needed: predicted ~2x slower down (5.6 us of bytes -> ~10+ us), i.e. the
layer +4-6 us; DN_OUTS 2: 7.8 warps/SM x 2 x 2 x 16 B x 32 = 16 KB: +1-3 us. GU_OUTS 2 at 30b T=1: 3072 warps
(23 per SM) x 32 lanes x 32 loads x 8 B = 188 KB per SM in flight: enough; predicted within +-3 %; GU_OUTS 4
(1536 warps, 12 per SM resident, 11.6 per SM of work -> one partial wave): within +-5 %, likely slower from the
coarser tail. At T = 8 there are 8x more warps, so occupancy, not warp count, limits: predicted GU_OUTS 2 and
DN_OUTS 2 within +-2 % of 1 x 1 (the freed issue slots do not matter for a memory-bound kernel). Overall
prediction: GU_OUTS 1 x DN_OUTS 1 (the strict default) stays best at T = 1; nothing here wins by > 2 % at T = 8.

No point of the 3 x 3 grid spills (offline report at the resolved knobs; tests/test_prototypes_mapping.py), so
none is dropped. Numerics: GU_OUTS and DN_OUTS do not change any output's summation order; DN_OUTS changes
the auto DN_SLOTS (4 // DN_OUTS), which does -- results are bitwise equal to ``cupy:warp-decode`` built with the
same resolved DN_SLOTS / DN_UNROLL (GPU test).

Result on the H200 (2026-11-30, NVIDIA H200, cupy-cuda13x 14.2.0; results/sweep-proto-outputs-per-warp.json;
qwen3-30b-a3b only -- qwen3-235b-a22b was not swept; uniform routing, decode-step CUDA graphs with PDL, weights
rotated past 3x L2, 8 repeats). Median us per layer, % of the run's 4.47 TB/s read roofline; T = 1 / 8 IQRs
<= 0.2 us. Registers gate_up / down are the sweep's compile columns (spill-free; the down figures differ from the
offline 61 / 56 / 56 quoted above for the T = 1 knobs -- not investigated):

    GU_OUTS x DN_OUTS   registers   T = 1 us       T = 8 us       T = 32 us (IQR)
    1 x 1 (strict)      70 / 114    23.2 (73 %)    134.3 (79 %)   530.0 (0.8)
    1 x 2               70 / 95     23.5 (72 %)    132.9 (79 %)   516.3 (0.1)
    1 x 4               70 / 80     28.4 (60 %)    133.3 (79 %)   526.9 (101)
    2 x 1               112 / 114   24.2 (70 %)    136.0 (78 %)   538.5 (10.4)
    2 x 2               112 / 95    25.4 (66 %)    134.1 (79 %)   517.5 (0.7)
    2 x 4               112 / 80    29.9 (57 %)    134.4 (79 %)   525.5 (26.9)
    4 x 1               159 / 114   23.9 (71 %)    137.3 (77 %)   555.3 (15.9)
    4 x 2               159 / 95    26.1 (65 %)    135.4 (78 %)   518.2 (0.3)
    4 x 4               159 / 80    34.3 (49 %)    135.9 (78 %)   522.2 (6.7)

Against the prediction: the strict 1 x 1 is best at T = 1, as predicted (23.2 us; 1 x 2 +0.3 us, 4 x 1 +0.7,
2 x 1 +1.0). DN_OUTS 4 costs +5.2 us (predicted +4-6 us); DN_OUTS 2 only +0.3 us (predicted +1-3 us); GU_OUTS 2
+1.0 us (+4 %, just outside the predicted +-3 %), GU_OUTS 4 +0.7 us (+3 %, inside +-5 %) -- GU_OUTS 4 beating
GU_OUTS 2 was not predicted. At T = 8 nothing wins by more than 2 %, as predicted: the best, 1 x 2, is 132.9 us
(-1.0 %, IQRs 0.1 us). At T = 32 the three DN_OUTS 2 points (516.3-518.2 us, IQRs <= 0.7) are 2.2-2.6 % faster than
1 x 1 (530.0, IQR 0.8) and every DN_OUTS >= 2 point is below every DN_OUTS 1 point in this run -- consistent, but
within the ~10-15 % run-to-run spread seen at T = 32 for identical lab kernels, so only a hint.

Conclusion: the strict defaults (GU_OUTS 1, DN_OUTS 1) stay: best at T = 1, the batch the library is tuned for,
and no point gains more than 1 % at T = 8. Worth a rerun with more repeats: DN_OUTS 2 (auto DN_SLOTS 2) at T >= 8
(-1.0 % at T = 8, -2.6 % at T = 32 here, +0.3 us at T = 1); if it holds, DN_OUTS could become batch-dependent like
the auto DN_* knobs.
"""

from __future__ import annotations

from kernels.variants import Variant, register
from kernels.warp_decode_cupy import AUTO_KNOBS, DEFAULTS, build

GRID = {"GU_OUTS": [1, 2, 4], "DN_OUTS": [1, 2, 4]}

VARIANT = register(
    Variant(
        name="proto:outputs-per-warp",
        backend="cupy",
        family="outputs-per-warp",
        build=build,
        reference_mode="warp_decode",
        params={**DEFAULTS, **{knob: 0 for knob in AUTO_KNOBS}},
        description="strict warp decode, GU_OUTS x DN_OUTS consecutive outputs per warp (x / intermediate reuse)",
        grid=GRID,
    )
)
