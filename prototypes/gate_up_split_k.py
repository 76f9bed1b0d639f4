"""Prototype: split-K over H for gate_up -- several warps per output (gate_up lab, ``LAB_SPLIT``).

Hypothesis. At T = 1 a warp owns one neuron and streams both rows of it (8 KB at H = 2048, 16 KB at
H = 4096) in UNROLL-deep rounds; the kernel ends when the last-started warps finish their chain of rounds
(the tail), and a warp's rounds are serialised latencies. With LAB_SPLIT = S, S warps of one block share
the output, each dotting a lane-aligned 1/S of the row (part = 32 * ceil(chunks / (32 S)) chunks), then
the S partial (gate, up) sums meet in shared memory and part 0 adds them in order s = 0..S-1
(deterministic, no atomics; one __syncthreads). S x as many warps, each with 1/S of the work: shorter
chains, a finer tail, more warps to keep HBM busy during ramp-up. Costs: the barrier, 8 B of shared
memory per warp, S times the x reads (L1/L2 hits) and masked (wasted) loads when a part is shorter than
one round.

Prediction (H200, T = 1, gate_up stage; LAB_WARPS 8, LAB_BYTES 16; roofline ~4.5 TB/s):

    qwen3-30b-a3b    50.3 MB -> 11.2 us at 100 %. H = 2048: 256 chunks of 16 B per row = 8 per lane.
                     S = 1, U4: two rounds per warp (73 registers, 24 warps / SM; 6144 warps = 1.9 waves).
                     S = 2, U4: one round per warp, 12288 warps. S = 4: 2 chunks per lane, U4 half masked.
                     Predicted: S = 2 ~8 % faster than S = 1 (~14 us vs ~15 us), S = 4 about S = 2,
                     S = 8 (1 chunk per lane) slower again (+5 %: more warps than work per warp).
    qwen3-235b-a22b  201 MB -> 44.7 us at 100 %. H = 4096: 16 chunks per lane. S = 2 / S = 4 shorten
                     4 -> 2 / 1 rounds per warp at U4: predicted ~5 % gain (~50 us vs ~53 us); the
                     kernel is long enough that the tail matters less.

Outputs are NOT bitwise those of S = 1 (the sum order changes); each point is checked against
``reference.moe_decode(mode="warp_decode")`` within the usual 1-ulp rule. Grid: LAB_SPLIT 1/2/4/8 x
LAB_UNROLL 2/4 (8 points, 47-73 registers, spill-free for sm_90).

Result on the H200 (2026-11-30, NVIDIA H200, cupy-cuda13x 14.2.0; results/sweep-proto-gate-up-split-k.json;
qwen3-30b-a3b only -- qwen3-235b-a22b was not swept; uniform routing, decode-step CUDA graphs, weights rotated past
3x L2, 8 repeats; LAB_WARPS 8, LAB_BYTES 16). Whole layer (lab gate_up + strict down), median us, % of the run's
4.48 TB/s read roofline; registers from the JSON (spill-free); T = 1 / 8 IQRs <= 1.1 us:

    LAB_SPLIT x UNROLL   registers   T = 1 us       T = 8 us       T = 32 us (IQR)
    S1 x U2              47          26.3 (64 %)    138.3 (76 %)   532.3 (0.2)
    S1 x U4              73          25.6 (66 %)    137.6 (77 %)   531.5 (0.4)
    S2 x U2              48          27.0 (62 %)    142.9 (74 %)   652.7 (140)
    S2 x U4              73          26.2 (64 %)    140.8 (75 %)   565.8 (6.4)
    S4 x U2              48          27.0 (62 %)    146.8 (72 %)   579.6 (8.1)
    S4 x U4              73          32.0 (53 %)    191.8 (55 %)   849.9 (49.7)
    S8 x U2              54          36.1 (47 %)    228.7 (46 %)   888.8 (5.2)
    S8 x U4              73          47.9 (35 %)    322.0 (33 %)   1264.2 (0.3)

Baselines (same GPU, same day): ``cupy:warp-decode`` at its defaults 23.2 / 134.3 / 530.0 us at T = 1 / 8 / 32
(results/sweep-proto-outputs-per-warp.json, GU_OUTS 1 x DN_OUTS 1) and 25.1 us at T = 1 with PDL = 0
(results/sweep-dn-qwen3-30b-a3b-after-race-fix.json). The lab gate_up never executes
``griddepcontrol.launch_dependents``, so the strict down launched after it gets no PDL overlap: the fair T = 1
reference for a lab pair is ~25.1 us, and the lab at the strict kernel's knobs (8 B x U8, SINK 1, 2 warps) measured
25.9 us. Identical lab kernels swept in separate runs today agree within 0.1 us at T = 1 (one pair 0.9 us apart),
mostly within ~1 us at T = 8 (but some jump 12-33 us with small IQRs: 8 B x U8 138.0 vs 167.1 us) and by up to
~13 % at T = 32 (16 B x U2: 530.7 / 532.2 / 597.0 us), so T = 32 differences below ~10-15 % are not evidence,
whatever the within-run IQR.

Against the prediction: S = 2 was to be ~8 % faster than S = 1; it is slower at every batch (+0.6-0.7 us at T = 1,
+3.2-4.6 us at T = 8), and S = 1 x U4 is the best point at T = 1, 8 and 32. S = 4 is about S = 2 only at U2
(27.0 us); at U4, where half of each round's loads are masked, it is 6.4 us slower than S = 1 x U4. S = 8 (one
chunk per lane, half or three quarters of the loads masked), predicted +5 %, is +41 % / +87 % against S = 1 x U4
(36.1 / 47.9 us). The slowdown follows the
masked fraction, and even unmasked S = 2 x U2 (two full rounds per warp) loses 0.7 us to S = 1: the barrier, the
shared-memory combine and the S-fold x reads cost more than the shorter tail gains. The 1.9-wave tail is not what
holds gate_up at T = 1.

Conclusion: negative result at H = 2048: one warp per output stays (no change to the strict kernel). qwen3-235b-a22b
(H = 4096, 16 chunks per lane, predicted ~5 % gain) was not swept; after this result it is low priority.
"""

from __future__ import annotations

from kernels.variants import Variant, register
from prototypes import _gate_up_lab as lab

register(
    Variant(
        name="proto:gate-up-split-k",
        backend="cupy",
        family="proto-gate-up-lab",
        build=lab.build,
        reference_mode="warp_decode",
        params={**lab.DEFAULTS, "LAB_WARPS": 8, "LAB_BYTES": 16, "LAB_UNROLL": 4},
        description="gate_up lab: LAB_SPLIT warps per output over H, fixed-order shared-memory combine",
        grid={"LAB_SPLIT": [1, 2, 4, 8], "LAB_UNROLL": [2, 4]},
    )
)
