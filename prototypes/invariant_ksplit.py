"""Prototype: the batch-invariant pair with its gate_up k chains in fixed ranges (``GB_KSPLIT``), to close its
small-T cost.

Hypothesis. The batch-invariant policy costs 17-28 % over ``policy="fastest"`` at T <= 2 (H200, 2026-12-01,
``results/h200-2026-12-01-batch-invariant-policy-uniform.json``), and the per-stage run puts the gap in the per-pair
form's gate_up: 19.0 vs strict's 14.1 us at qwen3-30b-a3b T = 1 (``results/h200-2026-12-01-stage-split-t1-t4.json``).
A tensor-core warp owns 16 rows for all of H, so T = 1 has 768 gate_up warps (six per SM) against strict's 12288: too
few loads in flight. With GB_KSPLIT = S the numerics become S fixed k ranges (a function of H alone), each its own
mma chain, added in range order. The per-pair form then gives each range its own warp (S x the warps, partials
through shared memory); the grouped path runs the ranges one after another in one warp, with the same bytes and S
accumulators at a time, so the two forms still give a token the same bits whatever its batch. (The strict FMA kernel's
split-K lost, ``gate_up_split_k.py``: it already had a warp per output. The per-pair form has sixteen outputs per
warp.)

Prediction (H200, uniform): S = 4 brings the per-pair gate_up at qwen3-30b T = 1 from 19.0 to ~14-15 us, and the
policy's cost at T = 1 / 2 from +28 / +17 % to under +10 %. The grouped path stays within 1-2 % of S = 1 from T = 16.
It holds two accumulator sets, and the FP8 gate_up compiles to 99-102 registers against 93, 25 % occupancy instead
of 31 %; that may cost the FP8 grouped path at large T.

Checked on the CPU: the g++ emulation gives a probe token the same bits alone and in batches through both forms at
S = 3 and 4 (short and empty last ranges). A crafted row whose ranges sum to 2^26, -2^26 and 1 pins the order:
range order gives 1, any other order 0. Every knob set compiles for sm_90 without spills.

Result: not yet measured on a GPU. Run ``python -m tools.bench --prototypes --variants 'proto:invariant-*'
--model qwen3-30b-a3b,qwen3-235b-a22b`` beside ``cupy:auto-invariant``, then tests/test_batch_invariance.py with
these knobs. If S = 4 wins, it becomes the policy's numerics (``GROUPED_KNOBS`` / ``PER_PAIR_KNOBS``, both forms at
once); if it loses, GB_KSPLIT leaves the library.
"""

from __future__ import annotations

from kernels import warp_decode_batched as wdb
from kernels.variants import register

SPLIT = 4

register(wdb.FAMILY.variant(
    "proto:invariant-pairs-ksplit",
    knobs={**wdb.PER_PAIR_KNOBS, "GB_KSPLIT": SPLIT, "GB_WARPS": SPLIT},
    reference_mode="warp_decode",
    description="the batch-invariant per-pair form with its gate_up k chains in 4 fixed ranges, a warp per range",
    grid={"GB_KSPLIT": [1, 2, 4], "GB_WARPS": [4, 8], "GB_UNROLL": [4, 8]},
))
register(wdb.FAMILY.variant(
    "proto:invariant-grouped-ksplit",
    knobs={**wdb.GROUPED_KNOBS, "GB_KSPLIT": SPLIT},
    reference_mode="warp_decode",
    description="the batch-invariant grouped path with its gate_up k chains in 4 fixed ranges, one after another",
    grid={"GB_KSPLIT": [1, 2, 4], "GB_NBLK": [1, 2]},
))
