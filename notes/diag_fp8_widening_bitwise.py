"""FP8_PRMT 0 vs 1 on the FP8 tensor-core paths (tensor-core, per-pair, grouped): the outputs must be bitwise equal
(both widenings give value x 2^-112 fragments) and right against the reference. Run on a GPU from the repo root:
``PYTHONPATH=. python3 notes/diag_fp8_widening_bitwise.py`` (the H200's answer, 2026-12-02: equal everywhere --
results/h200-2026-12-02-fp8-widening-checks.log; notes/PROTOTYPES.md, "FP8 fragments by byte permute")."""

from __future__ import annotations

import cupy
import numpy as np

from kernels import warp_decode_batched as wdb
from kernels.problem import make_problem
from kernels.shapes import get_shape
from tests.test_warp_decode_batched_fp8 import _device, _fp8_problem, _references
from tests.warp_checks import _assert_matches, _poisoned_out

PATHS = {"mma": wdb.MMA_FP8_KNOBS, "pairs": wdb.FP8_PER_PAIR_KNOBS, "grouped": wdb.FP8_GROUPED_KNOBS}
CASES = (("qwen3-30b-a3b", 5, "zipf"), ("qwen3-30b-a3b", 40, "uniform"), ("qwen3-235b-a22b", 3, "correlated"),
         ("qwen3-235b-a22b", 64, "zipf"))

for model, tokens, routing in CASES:
    shape = get_shape(model).with_(experts=16)  # the host quantizes every expert for the reference
    host = _fp8_problem(make_problem(shape, tokens, seed=tokens, routing=routing))
    dev = _device(cupy, make_problem(shape, tokens, seed=tokens, routing=routing))
    faithful, oracle = _references(host)
    for name, knobs in PATHS.items():
        outs = []
        for widening in (0, 1):
            out = _poisoned_out(cupy, tokens, shape.hidden)
            wdb.warp_decode_batched(dev.x, dev.w13, dev.w2, dev.topk_ids, dev.topk_weights, out=out,
                                    **{**knobs, "FP8_PRMT": widening})
            cupy.cuda.runtime.deviceSynchronize()
            outs.append(out.get())
            what = f"{model} T={tokens} {name} FP8_PRMT={widening}"
            _assert_matches(outs[-1], faithful, oracle, what, own_order=True)
        bits = [o.view(np.uint16) for o in outs]
        diff = int(np.count_nonzero(bits[0] != bits[1]))
        print(f"{model} T={tokens} {routing} {name}: bitwise equal {diff == 0} ({diff} of {bits[0].size} differ)",
              flush=True)
