"""Prototype: does forcing a round's loads ahead of the FMAs (``all_loads_arrived``) pay? (gate_up lab)

Hypothesis. Left alone, ptxas sinks each weight load next to its FMAs: the offline report of the lab with
LAB_SINK=0 stays at 32-45 registers whatever LAB_UNROLL is (8 B: 32 at U2/U4/U8; 16 B: 45/44/40), and
its SASS (nvdisasm, sm_90, 8 B x U8) is 8 times "LDG gate, LDG up, LDG x, 8 FFMA": one chunk per row in
flight per lane. LAB_SINK=1 at the same knobs issues all 24 loads, then 88 FFMAs. With
LAB_SINK=1 (the strict kernel's trick) every load of a round is issued first (8 B: 39/47/72 registers,
16 B: 47/72/126 for U2/U4/U8): 2 x U loads per lane in flight. SINK=0 keeps 64 (8 B) or 42-50 (16 B)
warps / SM resident instead of 28 (8 B U8) or 16 (16 B U8); the question is whether occupancy (many
warps, one load each) hides the latency as well as depth (fewer warps, many loads each).

Prediction (H200, T = 1, gate_up stage; roofline ~4.5 TB/s):

    qwen3-30b-a3b    50.3 MB: 11.2 us at 100 %. SINK=0: 64 warps x 32 lanes x (2 rows x 8 B) = 32 KB per SM
                     in flight at best -- about the ~27 KB Little's law asks for at ~0.8 us, but only if the
                     scheduler keeps every warp's next load issued: predicted ~17-18 us (2.9 TB/s).
                     SINK=1 at 8 B x U8 (112 KB per SM in flight): ~15 us (the strict kernel's number).
                     So SINK=1 wins by 10-20 % at U >= 4 and is within ~3 % at U = 2.
    qwen3-235b-a22b  201 MB: 44.7 us at 100 %; same ratio: SINK=0 ~60 us, SINK=1 ~52 us.

Both settings do the FMAs in the same order: their outputs are bitwise equal (tested on the CPU emulation
and on the GPU), so the sweep compares timing only. Grid: LAB_SINK 0/1 x LAB_UNROLL 2/4/8 x LAB_BYTES 8/16
(12 points, all spill-free for sm_90).

Result on the H200 (2026-11-30, NVIDIA H200, cupy-cuda13x 14.2.0; results/sweep-proto-gate-up-sink.json;
qwen3-30b-a3b only -- qwen3-235b-a22b was not swept; uniform routing, decode-step CUDA graphs, weights rotated past
3x L2, 8 repeats). Whole layer (lab gate_up + strict down), median us, % of the run's 4.49 TB/s read roofline;
T = 1 / 8 IQRs <= 0.4 us except where given. The SINK=1 rows carry no compile columns in the JSON: their registers
are the offline figures above (SINK=0 registers from the JSON):

    point              registers   T = 1 us       T = 8 us                 T = 32 us (IQR)
    8 B  U2 SINK 0     32          26.1 (65 %)    141.3 (74 %)             542.8 (0.9)
    8 B  U2 SINK 1     39          25.8 (65 %)    139.8 (75 %)             567.2 (3.2)
    8 B  U4 SINK 0     32          26.9 (63 %)    141.6 (74 %)             669.1 (112)
    8 B  U4 SINK 1     47          26.7 (63 %)    139.0 (76 %)             591.2 (5.7)
    8 B  U8 SINK 0     32          26.9 (63 %)    141.8 (74 %)             544.2 (1.2)
    8 B  U8 SINK 1     72          26.0 (65 %)    167.1 (63 %)             540.2 (6.5)
    16 B U2 SINK 0     45          27.8 (60 %)    140.2 (75 %)             533.9 (0.2)
    16 B U2 SINK 1     47          26.6 (63 %)    138.3 (76 %)             532.2 (0.7)
    16 B U4 SINK 0     44          27.7 (61 %)    140.1 (75 %)             546.1 (3.5)
    16 B U4 SINK 1     72          25.6 (66 %)    140.8 (75 %, IQR 11.3)   555.8 (6.2)
    16 B U8 SINK 0     40          25.6 (66 %)    139.0 (76 %)             594.9 (28.0)
    16 B U8 SINK 1     126         28.6 (59 %)    169.0 (62 %, IQR 17.9)   632.2 (18.3)

Baselines (same GPU, same day): ``cupy:warp-decode`` at its defaults 23.2 / 134.3 / 530.0 us at T = 1 / 8 / 32
(results/sweep-proto-outputs-per-warp.json, GU_OUTS 1 x DN_OUTS 1) and 25.1 us at T = 1 with PDL = 0
(results/sweep-dn-qwen3-30b-a3b-after-race-fix.json). The lab gate_up never executes
``griddepcontrol.launch_dependents``, so the strict down launched after it gets no PDL overlap: the fair T = 1
reference for a lab pair is ~25.1 us, and the lab at the strict kernel's knobs (8 B x U8, SINK 1, 2 warps) measured
25.9 us. Identical lab kernels swept in separate runs today agree within 0.1 us at T = 1 (one pair 0.9 us apart),
mostly within ~1 us at T = 8 (but some jump 12-33 us with small IQRs: 8 B x U8 138.0 vs 167.1 us) and by up to
~13 % at T = 32 (16 B x U2: 530.7 / 532.2 / 597.0 us), so T = 32 differences below ~10-15 % are not evidence,
whatever the within-run IQR.

Against the prediction (SINK=1 10-20 % faster gate_up at U >= 4, i.e. ~1.5-3 us of the layer; within ~3 % at
U = 2): at T = 1 SINK=1 wins in 5 of 6 pairs, by 0.2 us (8 B U4) to 2.1 us (16 B U4, 8 % of the layer); at the
strict kernel's 8 B U8 by 0.9 us. The direction holds, the size only at 16 B, and not by U. The sixth pair
contradicts it: at 16 B U8 forcing the loads ahead costs 126 registers (16 warps / SM) and SINK=1 is 3.0 us slower,
while SINK=0 there (40 registers, ptxas' own schedule) ties the best SINK=1 point (25.6 us both). At T = 8 SINK=1 is
1.5-2.6 us (<= 2 %) faster at U2 / U4 except 16 B U4 (noisy, IQR 11.3 us); its two U8 points were slow in this run
(167.1 / 169.0 us; the same 8 B U8 kernel measured 138.0 us in the load-width run). T = 32: nothing resolvable.

Conclusion: forcing a round's loads ahead of the FMAs is worth ~1-2 us per layer at T = 1 as long as it costs <= 72
registers, and harmful once it pushes the kernel past ~100. The strict gate_up keeps ``all_loads_arrived`` at 8 B x
U8 (72 registers; 0.9 us better than SINK=0 at the same knobs). No new default: the best lab points (25.6 us) beat
the strict knobs (25.9-26.0 us) by less than the cross-run spread.
"""

from __future__ import annotations

from kernels.variants import Variant, register
from prototypes import _gate_up_lab as lab

register(
    Variant(
        name="proto:gate-up-sink",
        backend="cupy",
        family="proto-gate-up-lab",
        build=lab.build,
        reference_mode="warp_decode",
        params=dict(lab.DEFAULTS),
        description="gate_up lab: loads of a round forced ahead of the FMAs (LAB_SINK=1) or not; strict down",
        grid={"LAB_SINK": [0, 1], "LAB_UNROLL": [2, 4, 8], "LAB_BYTES": [8, 16]},
    )
)
