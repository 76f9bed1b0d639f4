"""Prototype: warps per block in the strict kernels -- GU_WARPS x DN_WARPS in {4, 8, 16}^2 (no new CUDA).

Hypothesis. The strict kernels have no shared memory and no inter-warp sync, so a block is only a scheduling unit:
its size sets (a) how many blocks fit per SM under the register file and (b) the granularity of the last wave --
16-warp blocks leave bigger holes when the warp count does not divide evenly over 132 SMs, while more small blocks
cost more block launches in the ramp.

Prediction (H200; offline registers: gate_up 64, down 61 at every point -> 32 warps per SM everywhere, so only
granularity differs): all 9 points within +-3 % at T = 8 (many waves); at T = 1 the 16-warp points 1-4 % slower than
the 4-warp ones from the coarser partial wave (~0.3-1 us of 25 us), 4 x 4 / 8 x 4 best. The strict default
(GU_WARPS 2, DN_WARPS 4) is not in this grid: sweep it beside.

Numerics: warps per block change no summation order -- bitwise equal to ``cupy:warp-decode`` (GPU test).

Result on the H200 (2026-11-30; qwen3-30b-a3b only -- qwen3-235b-a22b was not swept): at T = 8 all nine points
within +-3 % (134.8-138.2 us), as predicted; at T = 1 the 16-warp gate_up blocks are 0.7-0.9 us (~3 %) slower than
the 4-warp ones, and DN_WARPS 4 / 8 / 16 moves T = 1 by <= 0.3 us. The best T = 1 point (4 x 8, 23.9 us) is 0.7 us
slower than the strict 2 x 4 (23.2 us, another run). T = 32 spreads 529-594 us: not resolvable. The full table:
notes/PROTOTYPES.md ("Warps per block").

Conclusion: block size is a granularity knob worth < 1 us here; the strict defaults stay (GU_WARPS 2, which beats
every point of this grid at T = 1; DN_WARPS 4, indistinguishable from 8 and 16 at T = 1 and within ~1.5 % at
T = 8). Nothing further to try along this axis.

Results: results/sweep-proto-warps-per-block.json (the strict default: results/sweep-proto-outputs-per-warp.json).
"""

from __future__ import annotations

from kernels.variants import register
from kernels.warp_decode_cupy import FAMILY

GRID = {"GU_WARPS": [4, 8, 16], "DN_WARPS": [4, 8, 16]}

VARIANT = register(
    FAMILY.variant(
        "proto:warps-per-block",
        family="warps-per-block",
        reference_mode="warp_decode",
        description="strict warp decode, GU_WARPS x DN_WARPS warps per block (scheduling granularity)",
        grid=GRID,
    )
)
