"""Prototype: split-K over H for gate_up -- several warps per output (gate_up lab, ``LAB_SPLIT``).

Hypothesis. At T = 1 a warp owns one neuron and streams both of its rows in UNROLL-deep rounds; the kernel ends when
the last-started warps finish their chain of rounds (the tail). With LAB_SPLIT = S, S warps of one block share the
output, each dotting a lane-aligned 1/S of the row; the S partial (gate, up) sums meet in shared memory and part 0
adds them in order s = 0..S-1 (deterministic, no atomics, one __syncthreads): shorter chains, a finer tail, more
warps during the ramp. Costs: the barrier, S times the x reads, masked loads when a part is shorter than a round.

Prediction (H200, T = 1, gate_up stage; LAB_WARPS 8, LAB_BYTES 16): qwen3-30b-a3b (H = 2048) S = 2 ~8 % faster than
S = 1, S = 4 about S = 2, S = 8 +5 %; qwen3-235b-a22b (H = 4096) S = 2 / 4 ~5 % faster.

Outputs are NOT bitwise those of S = 1 (the sum order changes); each point is checked against
``reference.moe_decode(mode="warp_decode")`` within the usual 1-ulp rule. Grid: LAB_SPLIT 1/2/4/8 x LAB_UNROLL 2/4
(8 points, 47-73 registers, spill-free). The lab pair runs without PDL (fair T = 1 reference: 25.1 us;
notes/PROTOTYPES.md, "The gate_up lab").

Result on the H200 (2026-11-30; qwen3-30b-a3b only -- qwen3-235b-a22b was not swept): S = 2 is slower at every batch
(+0.6-0.7 us at T = 1, +3.2-4.6 us at T = 8) and S = 1 x U4 is the best point at T = 1, 8 and 32 (25.6 / 137.6 /
531.5 us); S = 4 x U4 +6.4 us, S = 8 +41 % / +87 % at T = 1 -- the slowdown follows the masked fraction, and even
unmasked S = 2 x U2 loses 0.7 us: the barrier, the combine and the S-fold x reads cost more than the shorter tail
gains. Full table: notes/PROTOTYPES.md.

Conclusion: negative at H = 2048: one warp per output stays (no change to the strict kernel). qwen3-235b-a22b
(predicted ~5 % gain) was not swept; after this result it is low priority.

Results: results/sweep-proto-gate-up-split-k.json.
"""

from __future__ import annotations

from kernels.variants import register
from prototypes import _gate_up_lab as lab

register(
    lab.FAMILY.variant(
        "proto:gate-up-split-k",
        build=lab.build,
        knobs={**lab.DEFAULTS, "LAB_WARPS": 8, "LAB_BYTES": 16, "LAB_UNROLL": 4},
        reference_mode="warp_decode",
        description="gate_up lab: LAB_SPLIT warps per output over H, fixed-order shared-memory combine",
        grid={"LAB_SPLIT": [1, 2, 4, 8], "LAB_UNROLL": [2, 4]},
    )
)
