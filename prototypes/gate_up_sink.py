"""Prototype: does forcing a round's loads ahead of the FMAs (``all_loads_arrived``) pay? (gate_up lab)

Hypothesis. Left alone, ptxas sinks each weight load next to its FMAs: with LAB_SINK=0 the lab stays at 32-45
registers whatever LAB_UNROLL is, one chunk per row in flight per lane (SASS at 8 B x U8: 8 times "LDG gate, LDG
up, LDG x, 8 FFMA"). LAB_SINK=1 (the strict kernel's trick) issues every load of a round first (8 B x U8: all 24
loads, then 88 FFMAs) at 39-126 registers. The question: does occupancy (many warps, one load each) hide the latency
as well as depth (fewer warps, many loads each)?

Prediction (H200, T = 1, gate_up stage): SINK=1 wins by 10-20 % at U >= 4 (qwen3-30b-a3b ~15 us vs ~17-18;
qwen3-235b-a22b ~52 us vs ~60) and is within ~3 % at U = 2.

Both settings do the FMAs in the same order: their outputs are bitwise equal (CPU emulation and GPU), so the sweep
compares timing only. Grid: LAB_SINK 0/1 x LAB_UNROLL 2/4/8 x LAB_BYTES 8/16 (12 points, spill-free for sm_90). The
lab pair runs without PDL (fair T = 1 reference: 25.1 us; notes/PROTOTYPES.md, "The gate_up lab").

Result on the H200 (2026-11-30; qwen3-30b-a3b only -- qwen3-235b-a22b was not swept): at T = 1 SINK=1 wins in 5 of 6
pairs, by 0.2 us (8 B U4) to 2.1 us (16 B U4, 8 % of the layer), by 0.9 us at the strict 8 B U8; at 16 B U8 forcing
costs 126 registers and SINK=1 is 3.0 us slower, while SINK=0 there (40 registers) ties the best SINK=1 point
(25.6 us). At T = 8 SINK=1 is 1.5-2.6 us (<= 2 %) faster at U2 / U4; T = 32 not resolvable. Full table:
notes/PROTOTYPES.md.

Conclusion: forcing a round's loads ahead is worth ~1-2 us per layer at T = 1 as long as it costs <= 72 registers,
and harmful past ~100. The strict gate_up keeps ``all_loads_arrived`` at 8 B x U8 (72 registers); no new default (the
best lab points, 25.6 us, beat the strict knobs' 25.9-26.0 by less than the cross-run spread).

Results: results/sweep-proto-gate-up-sink.json.
"""

from __future__ import annotations

from kernels.variants import register
from prototypes import _gate_up_lab as lab

register(
    lab.FAMILY.variant(
        "proto:gate-up-sink",
        build=lab.build,
        knobs=lab.DEFAULTS,
        reference_mode="warp_decode",
        description="gate_up lab: loads of a round forced ahead of the FMAs (LAB_SINK=1) or not; strict down",
        grid={"LAB_SINK": [0, 1], "LAB_UNROLL": [2, 4, 8], "LAB_BYTES": [8, 16]},
    )
)
