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

Result on the H200 (2026-11-30, bench, 12 repeats, uniform routing; median us per layer, PDL=0 -> PDL=1;
results/h200-2026-11-30-pdl-cmp.json): qwen3-30b-a3b T = 1 27.47 -> 26.10 (-5.0 %), T = 8 145.96 -> 142.92
(-2.1 %), T = 64 noise; qwen3-235b-a22b T = 1 82.92 -> 80.87 (-2.5 %), T = 8 and 64 within noise.

Conclusion: PDL buys 1.4-2 us per layer at T = 1, about what down's ramp-up costs, and nothing where the kernels
are long. It became the library default the same day (``PDL=1`` in ``kernels.warp_decode_cupy.DEFAULTS``), after
a race it exposed was fixed (notes/PROTOTYPES.md, "PDL"); this variant now differs from ``cupy:warp-decode`` only in
naming PDL explicitly, and its grid still compares PDL 0 and 1.
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
