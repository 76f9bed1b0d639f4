"""Prototype: strict FP8 warp decode whose gate_up prefetches the down's w2 into L2 (``GU_PREFETCH_W2``), for the
FP8 issue's T = 1 bar.

Hypothesis. At qwen3-30b-a3b T = 1 strict FP8 takes 19.3 us for 37.7 MB (43 % of the read roofline): its gate_up
streams 25 MB in ~11 us at ~51 % of DRAM (issue- and latency-bound: ~6 instructions per weight, 0.59 issues per
cycle, results/ncu-2026-12-02-fp8-strict-30b-t1.txt), then its down streams 12.6 MB in ~9 us at ~31 % -- a short
kernel of 2048 warps whose time is round trips, not bytes. The down's w2 (the 8 routed experts' H x I matrices) fits
in L2 many times over, and the gate_up leaves half of DRAM's bandwidth idle. With ``GU_PREFETCH_W2`` 1 each gate_up
block's thread 0 asks the copy engine (``cp.async.bulk.prefetch.L2``, sm_90) for its even share of the pairs' w2
bytes at its start -- no registers, nothing waited on -- so the w2 bytes cross DRAM while the gate_up runs and the
down's loads hit L2. Unlike the strict kernels' own-row prefetches measured on 2026-11-30 (``GU_PREFETCH`` /
``DN_PREFETCH``: slower, removed), these bytes belong to the next kernel. Numerics unchanged (a prefetch changes no
value).

Prediction (H200, uniform): qwen3-30b T = 1 from 19.3 to ~15-16 us (the down from ~9 to ~4 us at L2 latency, the
gate_up ~1 us slower for sharing DRAM); qwen3-235b T = 1 (per-pair in the table, strict 53.9) and T = 2 a smaller
gain, since their gate_up already streams near 70 %. A loss where the gate_up's own loads lose more than the down
gains.

Checked on the CPU: the g++ emulation logs every prefetch -- together they cover each routed pair's w2 matrix
exactly once (an expert routed twice, twice; nothing for a bad id) in 16-byte pieces inside one matrix, and the
outputs are bitwise those without it (``test_w2_prefetch_asks_for_exactly_the_pairs_w2_emulated``); sm_90 compiles
at the same registers (gate_up 56, no spill).

Result: not yet measured on a GPU. Run ``python -m tools.bench --prototypes --variants
'proto:fp8-strict-w2-prefetch,cupy:warp-decode-fp8' --model qwen3-30b-a3b,qwen3-235b-a22b --batch 1,2,4`` (uniform
and Zipf) and ``python -m tools.sweep proto:fp8-strict-w2-prefetch --model qwen3-30b-a3b --batch 1,2 --grid
GU_PREFETCH_W2=0,1 --grid DN_SLOTS=4,8``. A win makes it an auto rule of ``kernels/warp_decode_fp8.py`` (and a
candidate for the per-pair FP8 gate_up); a loss removes the knob.
"""

from __future__ import annotations

from kernels import warp_decode_fp8 as wdf
from kernels.formats import FP8_BLOCK128
from kernels.variants import register

register(wdf.FAMILY.variant(
    "proto:fp8-strict-w2-prefetch",
    knobs={"GU_PREFETCH_W2": 1},
    reference_mode="warp_decode",
    weight_format=FP8_BLOCK128.name,
    description="strict FP8 warp decode whose gate_up blocks prefetch the down's w2 bytes into L2",
    grid={"GU_PREFETCH_W2": [0, 1], "DN_SLOTS": [4, 8], "GU_WARPS": [4, 8]},
))
