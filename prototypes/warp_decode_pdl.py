"""Prototype: strict warp decode with programmatic dependent launch (PDL) between its two kernels.

Hypothesis. At small batch each kernel is short (qwen3-30b-a3b T = 1: gate_up ~14 us, down ~12 us on the
H200) and pays a ramp-up and a tail in which the HBM pipe is half empty. With PDL (``PDL=1``: both kernels
launched through ``kernels.compile.launch_ex`` with the programmatic-serialization attribute) the down
kernel's blocks become resident while gate_up drains, issue their first round of w2 loads (w2 does not
depend on gate_up), and only then execute ``griddepcontrol.wait`` before reading the intermediate. gate_up
waits first thing (its inputs may come from the kernel right before it) and releases its dependents right
after, so in a decode-step graph every layer's down overlaps its gate_up's tail. Prediction: 2-4 us saved per
layer at T = 1 (qwen3-30b-a3b 28 -> ~25 us), nothing at large T where the kernels are long.

Same numerics and bitwise the same outputs as ``cupy:warp-decode`` (only the launch order changes).

Result on the H200: not yet measured (run ``python -m tools.bench --variants 'cupy:warp-decode*'``).
"""

from __future__ import annotations

from kernels.variants import Variant, register
from kernels.warp_decode_cupy import AUTO_KNOBS, DEFAULTS, build

register(
    Variant(
        name="cupy:warp-decode-pdl",
        backend="cupy",
        family="warp-decode",
        build=build,
        reference_mode="warp_decode",
        params={**DEFAULTS, **{knob: 0 for knob in AUTO_KNOBS}, "PDL": 1},
        description="strict warp decode, down's first w2 loads overlapped with gate_up's tail (PDL, sm_90+)",
        grid={"PDL": [0, 1], "DN_SLOTS": [2, 4], "DN_UNROLL": [1, 2]},
    )
)
