"""Prototype: gate and up rows interleaved in one contiguous row per neuron (gate_up lab, prepacked w13).

Hypothesis. In the stacked layout (w13 [E, 2I, H] as checkpoints ship it) a warp streams two rows I * H * 2 bytes
apart (3.1 MB at qwen3-30b-a3b): two DRAM streams, two row pointers. Prepacked (``proto:gate-up-interleaved``:
:func:`prototypes._gate_up_lab.prepack`, once per weight copy, outside the timing) row i of [E, I, 2H] holds gate_i
and up_i in alternating 16-byte pieces, so a lane's gate and up chunks are one contiguous span and a warp streams one
region: fewer DRAM pages open per warp, full 32-byte sectors per lane, one pointer fewer. The arithmetic is identical
(outputs bitwise those of the stacked layout at the same LAB_BYTES / LAB_UNROLL -- tested).

Two variants because a prepack cannot see the grid's params: ``proto:gate-up-interleaved`` (prepacked,
LAB_INTERLEAVED=1) and ``proto:gate-up-stacked`` (w13 as given), same grid (LAB_BYTES 16/32 x LAB_UNROLL 2/4): sweep
both and compare point by point. The launch checks w13's shape against its layout (ValueError, never a wrong answer).

Prediction (H200, T = 1): within +-3 % of the stacked layout at qwen3-30b-a3b (~15 us gate_up) and qwen3-235b-a22b
(~52 us); a gain > 5 % would make prepacking worth a loader change.

Result on the H200 (2026-11-30; qwen3-30b-a3b only -- qwen3-235b-a22b was not swept; two separate runs): no gain
anywhere. At T = 1 interleaved is slower at three of four points (+0.3, +1.7, +1.1 us) and 0.3 us faster at 32 B U4;
at T = 8 1.8-2.0 us (~1.4 %) slower at three points (9.7 us faster at 32 B U4, where the stacked run sat in a slow
state); T = 32 not resolvable. Its fewer registers (one row pointer) bought nothing. Full table: notes/PROTOTYPES.md.

Conclusion: prepacking gate and up rows interleaved does not pay on the H200 at qwen3-30b-a3b. The library keeps w13
as checkpoints ship it ([E, 2I, H], no prepack step in the loader).

Results: results/sweep-proto-gate-up-interleaved.json, results/sweep-proto-gate-up-stacked.json.
"""

from __future__ import annotations

from kernels.variants import register
from prototypes import _gate_up_lab as lab

GRID = {"LAB_BYTES": [16, 32], "LAB_UNROLL": [2, 4]}

register(
    lab.FAMILY.variant(
        "proto:gate-up-interleaved",
        build=lab.build,
        knobs={**lab.DEFAULTS, "LAB_INTERLEAVED": 1, "LAB_BYTES": 16, "LAB_UNROLL": 4},
        reference_mode="warp_decode",
        description="gate_up lab on w13 prepacked to [E, I, 2H] (gate/up interleaved in 16 B pieces)",
        grid=dict(GRID),
        prepack=lab.prepack,
    )
)
register(
    lab.FAMILY.variant(
        "proto:gate-up-stacked",
        build=lab.build,
        knobs={**lab.DEFAULTS, "LAB_INTERLEAVED": 0, "LAB_BYTES": 16, "LAB_UNROLL": 4},
        reference_mode="warp_decode",
        description="gate_up lab on w13 as given [E, 2I, H]: the baseline of proto:gate-up-interleaved",
        grid=dict(GRID),
    )
)
