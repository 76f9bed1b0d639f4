"""Prototype: the batch-invariant pair with its down's k chains in fixed ranges too (``DB_KSPLIT``), for the cost
left at T <= 2.

Hypothesis. With the gate_up's chains split (``GB_KSPLIT`` 8, the library's since 2026-12-01) the batch-invariant
policy still costs +10 % over ``policy="fastest"`` at qwen3-30b-a3b T = 1 and +8 % at T = 2 (uniform;
``results/h200-2026-12-01-invariant-ksplit8-uniform.json``), and the per-stage times put half of it in the
per-pair down: 9.5 vs strict's 8.8 us at qwen3-30b T = 1, 26.4 vs 24.8 at qwen3-235b. Its block owns one token and
16 hidden rows with one warp per slot over all of I: 128 blocks of 8 warps at qwen3-30b T = 1, one block per SM
and four SMs idle. ``DB_KSPLIT`` S cuts each pair's dot over I into S fixed ranges (a function of I alone) added in
range order before the routing weight: the per-pair down gives each (slot, range) a warp (K x S <= 16 warps per
block, S x the loads in flight per SM), the grouped down runs the ranges in turn, so both forms keep one numerics.

Prediction (H200, uniform): S = 2 brings the per-pair down at qwen3-30b T = 1 from 9.5 to ~8.8-9.0 us and the
policy's T = 1 cost from +10 % to ~+6-7 %; the grouped path (95 registers against 87) stays within 1 % from T = 16.

Checked on the CPU: the g++ emulation gives a probe token the same FP32 bits alone and in batches through both
forms at S = 2 and 3 (I = 136: ranges 12 + 5 and 8 + 8 + 1 chunks), at the reference's distance; the FP32 view
matters -- a per-pair form that weighted each range before adding passed the bf16 comparison and failed this one.
Every knob set compiles for sm_90 without spills (per-pair down 121 registers, 128 on FP8; grouped down 95 / 110).
The split code exists only under ``DB_KSPLIT > 1``: the library's 50 batched knob sets at the qwen3 shapes compile
to the same sm_90 cubins as before the knob.

Result: not yet measured on a GPU. Run ``python -m tools.bench --prototypes --variants
'proto:invariant-*-dsplit,cupy:auto-invariant,cupy:auto' --model qwen3-30b-a3b,qwen3-235b-a22b --batch 1,2,4,16,64``
under uniform and Zipf routing, then tests/test_batch_invariance.py with these knobs. A win puts ``DB_KSPLIT`` in
``GROUPED_KNOBS`` and ``PER_PAIR_KNOBS`` together; a loss removes the knob.
"""

from __future__ import annotations

from kernels import warp_decode_batched as wdb
from kernels.variants import register

SPLIT = 2

register(wdb.FAMILY.variant(
    "proto:invariant-pairs-dsplit",
    knobs={**wdb.PER_PAIR_KNOBS, "DB_KSPLIT": SPLIT},
    reference_mode="warp_decode",
    description="the batch-invariant per-pair form with its down's k chains in 2 fixed ranges, a warp per range",
    grid={"DB_KSPLIT": [1, 2], "DB_UNROLL": [4, 8]},
))
register(wdb.FAMILY.variant(
    "proto:invariant-grouped-dsplit",
    knobs={**wdb.GROUPED_KNOBS, "DB_KSPLIT": SPLIT},
    reference_mode="warp_decode",
    description="the batch-invariant grouped path with its down's k chains in 2 fixed ranges, one after another",
    grid={"DB_KSPLIT": [1, 2, 4], "DB_NBLK": [1, 2]},
))
