"""Prototype: gate and up rows interleaved in one contiguous row per neuron (gate_up lab, prepacked w13).

Hypothesis. In the stacked layout (w13 [E, 2I, H] as checkpoints ship it) a warp streams two rows
I * H * 2 bytes apart (3.1 MB at qwen3-30b-a3b): two DRAM streams, two 64-bit row pointers. Prepacked
(``proto:gate-up-interleaved``: :func:`prototypes._gate_up_lab.prepack`, once per weight copy, outside
the timing) row i of [E, I, 2H] holds gate_i and up_i in alternating 16-byte pieces, so a lane's gate and
up chunks are one contiguous span (LAB_BYTES 16: 32 bytes = one full sector, two adjacent ld.v4; 32:
64 bytes) and a warp streams one 8 KB (16 KB) region. Fewer DRAM pages open per warp, full 32-byte
sectors per lane and one pointer fewer might buy a few percent; the arithmetic is identical (outputs are
bitwise those of the stacked layout at the same LAB_BYTES / LAB_UNROLL -- tested).

Two variants because a prepack cannot see the grid's params: ``proto:gate-up-interleaved`` (prepacked,
LAB_INTERLEAVED=1) and ``proto:gate-up-stacked`` (w13 as given, LAB_INTERLEAVED=0), same grid: sweep both
and compare point by point. The launch checks w13's shape against its layout (a stacked w13 given to the
interleaved build is a ValueError, never a wrong answer).

Prediction (H200, T = 1, gate_up stage; roofline ~4.5 TB/s):

    qwen3-30b-a3b    50.3 MB -> 11.2 us at 100 %. Both layouts move the same sectors; HBM3e pages
                     (~1-2 KB) are streamed to the end either way, so interleaving changes locality only
                     within a warp's round: predicted within +-3 % of the stacked layout (~15 us).
    qwen3-235b-a22b  201 MB -> 44.7 us at 100 %: same, +-3 % (~52 us).
    A gain > 5 % would make prepacking worth a loader change; less is noise (IQR ~1-2 %).

Offline registers (SINK=1, 2 warps / block), interleaved vs stacked: 16 B U2 45 vs 47, U4 64 vs 72;
32 B U2 64 vs 72, U4 112 vs 121 -- the interleaved kernel needs fewer (one row pointer).
Grid: LAB_BYTES 16/32 x LAB_UNROLL 2/4 (4 points per variant, spill-free for sm_90).

Result on the H200 (2026-11-30, NVIDIA H200, cupy-cuda13x 14.2.0; results/sweep-proto-gate-up-interleaved.json and
results/sweep-proto-gate-up-stacked.json, two separate runs; qwen3-30b-a3b only -- qwen3-235b-a22b was not swept;
uniform routing, decode-step CUDA graphs, weights rotated past 3x L2, 8 repeats). Whole layer (lab gate_up + strict
down), median us, % of each run's 4.47 / 4.48 TB/s read roofline; T = 1 / 8 IQRs <= 0.7 us. Registers: interleaved
from the JSON, stacked (no compile columns in its JSON) from the offline figures above:

    point     layout        registers   T = 1 us       T = 8 us       T = 32 us (IQR)
    16 B U2   interleaved   45          26.0 (65 %)    139.6 (76 %)   534.7 (0.8)
              stacked       47          25.7 (66 %)    137.8 (77 %)   530.7 (0.6)
    16 B U4   interleaved   64          27.1 (62 %)    139.4 (76 %)   534.1 (0.3)
              stacked       72          25.4 (66 %)    137.4 (77 %)   530.6 (0.1)
    32 B U2   interleaved   64          27.7 (61 %)    140.6 (75 %)   676.1 (150)
              stacked       72          26.6 (63 %)    138.8 (76 %)   600.9 (128)
    32 B U4   interleaved   112         28.4 (59 %)    143.8 (73 %)   557.6 (7.2)
              stacked       121         28.7 (59 %)    153.5 (69 %)   587.1 (6.3)

Baselines (same GPU, same day): ``cupy:warp-decode`` at its defaults 23.2 / 134.3 / 530.0 us at T = 1 / 8 / 32
(results/sweep-proto-outputs-per-warp.json, GU_OUTS 1 x DN_OUTS 1) and 25.1 us at T = 1 with PDL = 0
(results/sweep-dn-qwen3-30b-a3b-after-race-fix.json). The lab gate_up never executes
``griddepcontrol.launch_dependents``, so the strict down launched after it gets no PDL overlap: the fair T = 1
reference for a lab pair is ~25.1 us, and the lab at the strict kernel's knobs (8 B x U8, SINK 1, 2 warps) measured
25.9 us. Identical lab kernels swept in separate runs today agree within 0.1 us at T = 1 (one pair 0.9 us apart),
mostly within ~1 us at T = 8 (but some jump 12-33 us with small IQRs: 8 B x U8 138.0 vs 167.1 us) and by up to
~13 % at T = 32 (16 B x U2: 530.7 / 532.2 / 597.0 us), so T = 32 differences below ~10-15 % are not evidence,
whatever the within-run IQR.

Against the prediction (within +-3 %; > 5 % would justify a loader change): no gain anywhere. At T = 1 the
interleaved layout is slower at three of four points (+0.3, +1.7, +1.1 us) and 0.3 us faster at 32 B U4; 16 B U4
(+1.7 us, +7 %) is outside the +-3 % band in the wrong direction -- cause not measured (a ``tools.bench`` stage
timing would isolate gate_up). At T = 8 it is 1.8-2.0 us (~1.4 %) slower at three points and 9.7 us faster at
32 B U4, where the stacked run sat in a slow state (the same stacked kernel measured 186.0 us in the load-width
run): not a layout effect. T = 32: no resolvable difference. The two layouts ran in separate sweeps, so
sub-microsecond differences are not firm, but none favours interleaving; its fewer registers bought nothing.

Conclusion: prepacking gate and up rows interleaved does not pay on the H200 at qwen3-30b-a3b. The library keeps
w13 as checkpoints ship it ([E, 2I, H], no prepack step in the loader).
"""

from __future__ import annotations

from kernels.variants import Variant, register
from prototypes import _gate_up_lab as lab

GRID = {"LAB_BYTES": [16, 32], "LAB_UNROLL": [2, 4]}

register(
    Variant(
        name="proto:gate-up-interleaved",
        backend="cupy",
        family="proto-gate-up-lab",
        build=lab.build,
        reference_mode="warp_decode",
        params={**lab.DEFAULTS, "LAB_INTERLEAVED": 1, "LAB_BYTES": 16, "LAB_UNROLL": 4},
        description="gate_up lab on w13 prepacked to [E, I, 2H] (gate/up interleaved in 16 B pieces)",
        grid=dict(GRID),
        prepack=lab.prepack,
    )
)
register(
    Variant(
        name="proto:gate-up-stacked",
        backend="cupy",
        family="proto-gate-up-lab",
        build=lab.build,
        reference_mode="warp_decode",
        params={**lab.DEFAULTS, "LAB_INTERLEAVED": 0, "LAB_BYTES": 16, "LAB_UNROLL": 4},
        description="gate_up lab on w13 as given [E, 2I, H]: the baseline of proto:gate-up-interleaved",
        grid=dict(GRID),
    )
)
