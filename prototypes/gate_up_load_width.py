"""Prototype: gate_up load width x loads in flight (the lab kernel, ``prototypes/_gate_up_lab.py``).

Hypothesis. gate_up is the larger stage (2/3 of the bytes) and runs below the roofline at T = 1 (the strict kernel
moves 50.3 MB in ~15.8 us = 3.2 TB/s on qwen3-30b-a3b). With 8-byte loads the strict default needs two rounds of 8
chunks per row (2 memory latencies per warp, plus the tail); 16-byte or 32-byte loads fetch a lane's whole row share
in one round with half / a quarter of the load instructions, at the price of registers and so of resident warps.

Prediction (H200, T = 1, gate_up stage): at qwen3-30b-a3b the one-round-per-row points (16 B x U8, 32 B x U4) save
~1.5 us per layer (gate_up ~13.5 us vs ~15); 8 B x U1 ~+20 % (too few bytes in flight); 32 B x U8 (218 registers)
slower. qwen3-235b-a22b (256 B per lane per row) was predicted to separate the widths more (16 B x U8 or 32 B x U4
best, ~50 us gate_up). Differences at equal bytes in flight: < 5 %.

Grid: LAB_BYTES 8/16/32 x LAB_UNROLL 1/2/4/8, LAB_SINK 1, 2 warps / block (12 points, all spill-free for sm_90);
``python -m tools.sweep proto:gate-up-load-width --model qwen3-30b-a3b --batch 1,8``. The layer time includes the
strict down at its defaults; the lab gate_up runs without PDL, so its fair T = 1 reference is the PDL-free strict
pair (25.1 us), and the lab at the strict kernel's knobs measured 25.9 us (notes/PROTOTYPES.md, "The gate_up lab").

Result on the H200 (2026-11-30; qwen3-30b-a3b only -- qwen3-235b-a22b was not swept): the 9 points at <= 72 registers
span only 25.5-26.7 us at T = 1 with no width pattern (16 B x U4 first, 0.4 us ahead of the strict knobs: the size
of a cross-run difference); every point above ~100 registers loses 10-55 % (16 B x U8 and 32 B x U4 28.7 us, 32 B x U8
40.1 us). T = 8: 137.6-142.3 us at <= 72 registers; T = 32 not resolvable. Full table: notes/PROTOTYPES.md.

Conclusion: load width is not the lever; the strict gate_up keeps GU_BYTES 8 x GU_UNROLL 8. Next, if anything: a
``tools.bench`` stage timing of 16 B x U4 against 8 B x U8 in one run, and the qwen3-235b-a22b shape.

Results: results/sweep-proto-gate-up-load-width.json.
"""

from __future__ import annotations

from kernels.variants import register
from prototypes import _gate_up_lab as lab

register(
    lab.FAMILY.variant(
        "proto:gate-up-load-width",
        build=lab.build,
        knobs=lab.DEFAULTS,
        reference_mode="warp_decode",
        description="gate_up lab: bytes per lane per load (8/16/32) x chunks in flight; strict down",
        grid={"LAB_BYTES": [8, 16, 32], "LAB_UNROLL": [1, 2, 4, 8]},
    )
)
