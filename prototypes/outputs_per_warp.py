"""Prototype: outputs per warp in the strict kernels -- GU_OUTS x DN_OUTS in {1, 2, 4}^2 (no new CUDA).

Hypothesis. A warp that owns ``GU_OUTS`` consecutive gate_up neurons loads ``x[t]`` once for all of them, and a down
warp that owns ``DN_OUTS`` consecutive hidden units loads each intermediate chunk once for DN_OUTS w2 rows: fewer load
instructions per weight byte. But the warps get fewer and fatter (more registers per lane, fewer resident warps per
SM; at T = 1 fewer warps in total), and latency hiding in a streaming kernel comes from bytes in flight per SM.

Prediction (H200, ~27 KB in flight per SM needed): GU_OUTS 1 x DN_OUTS 1 (the strict default) stays best at T = 1;
at qwen3-30b-a3b T = 1 DN_OUTS 4 (3.9 warps, 8 KB in flight per SM) costs +4-6 us, DN_OUTS 2 +1-3 us, GU_OUTS 2
within +-3 %, GU_OUTS 4 within +-5 %; nothing wins by > 2 % at T = 8.

Numerics: GU_OUTS and DN_OUTS change no summation order; DN_OUTS changes the auto DN_SLOTS (4 // DN_OUTS), which
does -- outputs are bitwise ``cupy:warp-decode`` built with the same resolved DN_SLOTS / DN_UNROLL (GPU test). No
point of the grid spills.

Result on the H200 (2026-11-30; qwen3-30b-a3b only -- qwen3-235b-a22b was not swept; median us per layer at
T = 1 / 8 / 32): 1 x 1 23.2 / 134.3 / 530.0, the best at T = 1; 1 x 2 23.5 / 132.9 / 516.3; DN_OUTS 4 +5.2 us at
T = 1 (4 x 4: 34.3 us); GU_OUTS 2 / 4 +1.0 / +0.7 us at T = 1. At T = 8 nothing wins by more than 2 %; the DN_OUTS 2
points are 2.2-2.6 % faster at T = 32, inside the run-to-run spread there. The full table and the comparison with
each prediction: notes/PROTOTYPES.md ("Outputs per warp").

Conclusion: the strict defaults (GU_OUTS 1, DN_OUTS 1) stay. Worth a rerun with more repeats: DN_OUTS 2 (auto
DN_SLOTS 2) at T >= 8; if it holds, DN_OUTS could become batch-dependent like the auto DN_* knobs.

Results: results/sweep-proto-outputs-per-warp.json.
"""

from __future__ import annotations

from kernels.variants import register
from kernels.warp_decode_cupy import FAMILY

GRID = {"GU_OUTS": [1, 2, 4], "DN_OUTS": [1, 2, 4]}

VARIANT = register(
    FAMILY.variant(
        "proto:outputs-per-warp",
        family="outputs-per-warp",
        reference_mode="warp_decode",
        description="strict warp decode, GU_OUTS x DN_OUTS consecutive outputs per warp (x / intermediate reuse)",
        grid=GRID,
    )
)
