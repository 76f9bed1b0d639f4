"""Prototype: gate_up load width x loads in flight (the lab kernel, ``prototypes/_gate_up_lab.py``).

Hypothesis. gate_up is the larger stage (2/3 of the bytes) and runs below the roofline at T = 1 (the strict
kernel moves 50.3 MB in ~15.8 us = 3.2 TB/s on qwen3-30b-a3b). Per lane and row it streams
H * 2 / 32 bytes (128 B at H = 2048, 256 B at H = 4096). With LAB_BYTES = 8 the strict default needs two
rounds of 8 chunks (2 memory latencies per warp, plus the tail); 16-byte (ld.v4) or 32-byte (two adjacent
ld.v4) loads fetch a lane's whole row share in one round with half / a quarter of the load instructions,
at the price of registers (offline report, SINK=1, 2 warps / block: 8 B: 32/39/47/72 registers for UNROLL
1/2/4/8; 16 B: 37/47/72/126; 32 B: 47/72/121/218) and therefore resident warps.

Prediction (H200, ~4.5 TB/s read roofline, T = 1, uniform routing; gate_up stage alone):

    qwen3-30b-a3b    50.3 MB -> 11.2 us at 100 %. Bytes in flight needed ~ 4.5 TB/s x ~0.8 us ~ 3.6 MB
                     ~ 27 KB per SM. 8 B x U8: 2 rows x 8 x 8 B x 32 lanes = 4 KB per warp x 28 warps
                     (72 registers) = 112 KB per SM: enough -- the loss is ramp and tail, not queue depth.
                     16 B x U8 / 32 B x U4 (one round per row, 121-126 registers, 16 warps / SM, 8 KB per
                     warp = 128 KB per SM): one latency per warp instead of two -> gate_up ~13.5 us
                     (3.7 TB/s) vs ~15 us for the 8 B default; the layer 28.5 -> ~27 us.
                     U = 1 at 8 B (512 B per warp, 64 warps -> 32 KB per SM, barely Little's law): ~+20 %.
                     32 B x U8 (218 registers, 8 warps / SM, half its loads masked at H = 2048): slower.
    qwen3-235b-a22b  201 MB -> 44.7 us at 100 %; 256 B per lane per row: the strict 8 B x U8 takes four
                     rounds, 16 B x U8 / 32 B x U4 two, 32 B x U8 one (but 218 registers, 8 warps / SM).
                     Predicted best 16 B x U8 or 32 B x U4 at ~50 us gate_up (~90 %), 8 B x U1 ~+15 %.
                     Differences between widths at equal bytes in flight: < 5 %.

Sweep: ``python -m tools.sweep proto:gate-up-load-width --model qwen3-30b-a3b --batch 1,8`` (and
qwen3-235b-a22b). 12 points: LAB_BYTES 8/16/32 x LAB_UNROLL 1/2/4/8, LAB_SINK 1, 2 warps / block; every
point compiles spill-free for sm_90 (tests/test_prototypes_gate_up.py). The layer time includes the strict
down kernel at its defaults (the same for every point); ``tools.bench`` stage timings isolate gate_up.

Result on the H200 (2026-11-30, NVIDIA H200, cupy-cuda13x 14.2.0; results/sweep-proto-gate-up-load-width.json;
qwen3-30b-a3b only -- qwen3-235b-a22b was not swept; uniform routing, decode-step CUDA graphs, weights rotated past
3x L2, 8 repeats). Whole layer (lab gate_up + strict down), median us, % of the run's 4.48 TB/s read roofline;
registers from the JSON (all spill-free); T = 1 / 8 IQRs <= 0.7 us except where given:

    LAB_BYTES x UNROLL    registers   T = 1 us       T = 8 us                 T = 32 us (IQR)
    8 B  x U1             32          26.4 (64 %)    142.3 (74 %)             548.0 (1.4)
    8 B  x U2             39          25.9 (65 %)    139.8 (75 %)             538.4 (0.9)
    8 B  x U4             47          26.7 (63 %)    139.3 (76 %)             671.4 (118)
    8 B  x U8 (strict's)  72          25.9 (65 %)    138.0 (76 %)             548.4 (12.7)
    16 B x U1             37          25.8 (65 %)    139.5 (75 %)             533.9 (0.9)
    16 B x U2             47          26.6 (63 %)    138.4 (76 %)             597.0 (14.1)
    16 B x U4             72          25.5 (66 %)    137.6 (77 %)             546.6 (2.1)
    16 B x U8             126         28.7 (59 %)    157.2 (67 %)             599.3 (1.5)
    32 B x U1             47          26.5 (64 %)    138.0 (76 %)             583.7 (9.4)
    32 B x U2             72          26.6 (63 %)    152.2 (69 %, IQR 26.7)   551.9 (11.1)
    32 B x U4             121         28.7 (59 %)    186.0 (57 %, IQR 17.2)   581.8 (4.5)
    32 B x U8             218         40.1 (42 %)    250.3 (42 %)             961.0 (4.0)

Baselines (same GPU, same day): ``cupy:warp-decode`` at its defaults 23.2 / 134.3 / 530.0 us at T = 1 / 8 / 32
(results/sweep-proto-outputs-per-warp.json, GU_OUTS 1 x DN_OUTS 1) and 25.1 us at T = 1 with PDL = 0
(results/sweep-dn-qwen3-30b-a3b-after-race-fix.json). The lab gate_up never executes
``griddepcontrol.launch_dependents``, so the strict down launched after it gets no PDL overlap: the fair T = 1
reference for a lab pair is ~25.1 us, and the lab at the strict kernel's knobs (8 B x U8, SINK 1, 2 warps) measured
25.9 us. Identical lab kernels swept in separate runs today agree within 0.1 us at T = 1 (one pair 0.9 us apart),
mostly within ~1 us at T = 8 (but some jump 12-33 us with small IQRs: 8 B x U8 138.0 vs 167.1 us) and by up to
~13 % at T = 32 (16 B x U2: 530.7 / 532.2 / 597.0 us), so T = 32 differences below ~10-15 % are not evidence,
whatever the within-run IQR.

Against the prediction: the one-round-per-row points (16 B x U8, 32 B x U4) were to save ~1.5 us per layer at
T = 1; they tie for second-slowest (28.7 us, +2.8 us vs 8 B x U8), like every point above ~100 registers
(occupancy <= 0.25): the extra depth does not make up for half the resident warps. The 9 points at <= 72 registers
span only 25.5-26.7 us at T = 1 with no width pattern; 16 B x U4 is first (25.5 us), 0.4 us ahead of the strict
knobs -- beyond the within-run IQR (<= 0.1 us) but the size of a cross-run difference, so not a claim. 8 B x U1,
predicted +20 % (too few bytes in flight), is +0.5 us (+2 %). At T = 8 the <= 72-register points sit at 137.6-142.3
us (74-77 %) except 32 B x U2 (152.2 us, IQR 26.7); at T = 32 they spread 534-671 us with IQRs up to 118 us:
nothing resolvable there.

Conclusion: load width is not the lever. At <= 72 registers every width streams the same ~65 % of the roofline per
layer at T = 1, and buying one-round rows with > 100 registers costs 10-55 %. The strict gate_up keeps GU_BYTES 8 x
GU_UNROLL 8. If anything is tried next it is a ``tools.bench`` stage timing of 16 B x U4 against 8 B x U8 in one
run, and the qwen3-235b-a22b shape (256 B per lane per row), which was predicted to separate the widths more.
"""

from __future__ import annotations

from kernels.variants import Variant, register
from prototypes import _gate_up_lab as lab

register(
    Variant(
        name="proto:gate-up-load-width",
        backend="cupy",
        family="proto-gate-up-lab",
        build=lab.build,
        reference_mode="warp_decode",
        params=dict(lab.DEFAULTS),
        description="gate_up lab: bytes per lane per load (8/16/32) x chunks in flight; strict down",
        grid={"LAB_BYTES": [8, 16, 32], "LAB_UNROLL": [1, 2, 4, 8]},
    )
)
