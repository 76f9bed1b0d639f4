"""Workloads for compute-sanitizer and Nsight Compute (run on the H200 on 2026-12-01; their reports are
results/sanitizer-2026-12-01-{memcheck,racecheck}.txt and results/ncu-2026-12-01-{mma-30b-t64,strict-fused-30b-t1}.txt).

Run from the repo root on a GPU: ``PYTHONPATH=. python3 notes/diag_sanitizer_ncu.py WHAT`` under a tool, e.g.
``compute-sanitizer --tool memcheck python3 notes/diag_sanitizer_ncu.py small`` or
``ncu --clock-control none --section SpeedOfLight ... python3 notes/diag_sanitizer_ncu.py t64``.

* ``small``  the warp-decode paths (strict, batched, MMA; mixed until it left) and the fused prototype, eagerly, on
             small odd shapes and on qwen3-30b-a3b T = 1; every output compared with the references (NaN-poisoned
             first), so a checker run also says the results were right under the tool.
* ``skew``   the tensor-core batched kernels' work units (tiles of pairs, whole slots, the grouped down with its
             slot sum) under skewed routings on odd shapes and qwen3-30b-a3b T = 40, outputs compared with the
             references (added 2026-12-01 evening; its run also covered the gate_up cp.async ring before that left
             the library: results/sanitizer-2026-12-01-skew-work-units.txt).
* ``t64``    the MMA path at qwen3-30b-a3b T = 64, uniform routing: 3 layers (the profiler takes the last one).
* ``zipf64`` the MMA path at qwen3-235b-a22b T = 64, Zipf routing: 3 layers (added 2026-12-01 evening).
* ``t1``     strict warp decode and the fused prototype at qwen3-30b-a3b T = 1: 3 layers each.
* ``fp8``    every path reading fp8-block128 weights (strict CuPy and Numba, batched, tensor-core with tiles and
             the grouped down, the W8A8 expert-centric path, the batch-invariant pair) on odd shapes with partial
             scale blocks and skewed routings, outputs compared with the references on the same weights (added
             2026-12-01, for the FP8 and batch-invariance work).
* ``new``    the batch-invariant pair (per-pair and grouped) in bf16 under skewed routings, compared with the
             references (added 2026-12-01); ``new-odd`` its two odd shapes only (the qwen3-30b case outlasts
             racecheck's time limit).
* ``fp8-mma-t32`` / ``fp8-strict-t1`` the tensor-core FP8 path at qwen3-30b-a3b T = 32 / strict FP8 at T = 1,
             uniform routing: 2 layers (the profiler takes the second; added 2026-12-02, for where FP8 time goes).
* ``fp8-point VARIANT MODEL T ROUTING [KNOB=v ...]`` one layer of an FP8 variant at one point, with the routed
             experts' unique FP8 bytes printed and knob overrides (added 2026-12-03, for where the qwen3-235b FP8 time
             goes at T = 16 uniform and T = 64 Zipf; overrides 2026-12-04, for GB_WARPS 4 / 8 under
             ``ncu --metrics`` of L1 / L2 sectors and DRAM bytes: results/ncu-2026-12-04-fp8-235b-t64-zipf-memory.txt).
* ``point VARIANT MODEL T ROUTING`` one layer of a bf16 variant at one point, with the routed experts' unique weight
             bytes printed, for Nsight Compute's DRAM bytes against them (added 2026-12-03 evening, for where bf16
             time goes under Zipf).
* ``whole-flush`` the whole-rounds grouped down (DB_WHOLE_RANGES 1) and the one-loop split-chain gate_up
             (GB_RANGE_FLUSH 1), bf16 (grouped and plain tensor-core paths) and FP8 (grouped), on a small shape where
             both can run, under Zipf and all-on-one-set routings, outputs compared with the references (added
             2026-12-02, for those two forms).
* ``hot``    a hot expert's tile in one pass of 2 / 3 8-pair blocks (HOT_NBLK), bf16 and FP8, the grouped and the
             balanced downs, under Zipf and all-on-one-set routings, outputs compared with the references (added
             2026-12-02, for hot tiles; the bf16 two-block passes under the 96-register caps added 2026-12-03).
* ``fp8-pair`` the FP8 batch-invariant pair (grouped and per-pair forms) at its 4 k ranges -- two groups of 8 neurons
             per per-pair block -- on odd shapes with partial scale blocks and at qwen3-30b-a3b T = 3, outputs
             compared with the references (added 2026-12-02, for the FP8 pair's 4 ranges).
* ``row-tiles`` the widening's multiply on B (FP8_PRMT 2 and 3) on the FP8 tensor-core paths and the grouped down
             at two row tiles per warp (DB_ROW_TILES 2), FP8 and bf16, hot tiles, a shape whose H is not a multiple
             of 32, Zipf and all-on-one-set routings, outputs compared with the references (added 2026-12-03).
* ``t16``    the three tensor-core FP8 paths on fp8-block128-t16 tiles (W_TILED) on shapes with partial scale blocks
             at both edges and at qwen3-30b-a3b T = 20, skewed routings, outputs compared with the references on
             the row layout's same values (added 2026-12-04, for the tiles).
* ``bf16-t16`` the three tensor-core bf16 paths on bf16-t16 tiles (W_TILED without W_FP8) on odd tiling shapes and at
             qwen3-30b-a3b T = 20, skewed routings, outputs compared with the references on the row layout
             (added 2026-12-04, for the bf16 tiles).
* ``families`` every batched family on every weight format it reads (kernels.batched.PATHS) on odd shapes and at
             qwen3-30b-a3b T = 20, skewed routings, hot tiles in two-block passes, outputs compared with the
             references (added 2026-12-04, for the families and their loaders); ``families-odd`` the odd shapes only
             (for racecheck's time).
* ``fp8-chunks`` strict FP8 at 16-value chunks (and 8 slots at 16-value gate_up chunks) on a shape with partial
             scale blocks at both edges and at qwen3-30b-a3b T = 2 (added 2026-12-01 late).
"""

from __future__ import annotations

import sys

import cupy

import prototypes
from kernels.contract import Dims
from kernels.problem import make_problem
from kernels.shapes import MoEShape
from kernels.variants import get_variant
from tests.warp_checks import ODD_SHAPES, _assert_matches, _poisoned_out, _references

PATHS = ("cupy:warp-decode", "cupy:warp-decode-batched", "cupy:warp-decode-mma", "proto:fused-layer")


def _dims(problem: object) -> Dims:
    s = problem.shape  # type: ignore[attr-defined]
    return Dims(problem.tokens, s.hidden, s.intermediate, s.experts, s.top_k)  # type: ignore[attr-defined]


def small() -> None:
    prototypes.load()
    for shape, tokens in ((ODD_SHAPES["h264-i40"], 5), (ODD_SHAPES["h64-k40"], 2), ("qwen3-30b-a3b", 1)):
        problem = make_problem(shape, tokens, seed=8, xp=cupy)
        dims = _dims(problem)
        faithful, oracle = _references(problem)
        for name in PATHS:
            variant = get_variant(name)
            if not variant.can_run(dims):
                continue
            launch = variant.make(dims)
            out = _poisoned_out(cupy, dims.tokens, dims.hidden)
            launch(*problem.arrays, out)
            cupy.cuda.runtime.deviceSynchronize()
            _assert_matches(cupy.asnumpy(out), faithful, oracle, f"{name} {dims}", own_order=True)
            print("ok", name, dims, flush=True)


SKEW_KNOBS = ({"DB_GROUPED": 0}, {"DB_GROUPED": 1})  # the balanced down's runs, the grouped down and its sum


def skew() -> None:
    from kernels import batched

    for shape, tokens, routing in ((ODD_SHAPES["h264-i40"], 9, "same"), (ODD_SHAPES["h2880-i264"], 37, "zipf"),
                                   ("qwen3-30b-a3b", 40, "zipf-2")):
        problem = make_problem(shape, tokens, seed=8, routing=routing, xp=cupy)
        dims = _dims(problem)
        faithful, oracle = _references(problem)
        for knobs in SKEW_KNOBS:
            out = _poisoned_out(cupy, dims.tokens, dims.hidden)
            batched.warp_decode_batched(*problem.arrays, out=out, path="mma", **knobs)
            cupy.cuda.runtime.deviceSynchronize()
            _assert_matches(cupy.asnumpy(out), faithful, oracle, f"{knobs} {dims} {routing}", own_order=True)
            print("ok", knobs, dims, routing, flush=True)


FP8_PATHS = ("cupy:warp-decode-fp8", "numba:warp-decode-fp8", "cupy:warp-decode-batched-fp8",
             "cupy:warp-decode-mma-fp8", "cupy:warp-decode-mma-grouped-fp8", "cupy:warp-decode-mma-pairs-fp8",
             "cupy:expert-centric-w8a8")


def _run_checked(name: str, problem: object, weights: tuple[object, object], faithful: object, oracle: object,
                 tag: str, **knobs: int) -> None:
    from kernels.checks import BENCH_W8A8, check_output

    dims = _dims(problem)
    variant = get_variant(name)
    launch = variant.make(dims, **knobs)
    out = _poisoned_out(cupy, dims.tokens, dims.hidden)
    launch(problem.x, *weights, problem.topk_ids, problem.topk_weights, out)  # type: ignore[attr-defined]
    cupy.cuda.runtime.deviceSynchronize()
    if variant.quant:  # W8A8: its own tolerance (its fp64 distance is the design's, ~4e-2)
        record = check_output(cupy.asnumpy(out), faithful, BENCH_W8A8, oracle=oracle)
        assert record["ok"], f"{name} {tag}: {record['why']}"
    else:
        _assert_matches(cupy.asnumpy(out), faithful, oracle, f"{name} {knobs} {tag}", own_order=True)
    print("ok", name, knobs, tag, flush=True)


def _fp8_case(shape: object, tokens: int, routing: str) -> tuple[object, tuple[object, object], tuple, object]:
    """A problem on the device with its weights quantized there; the host arguments of the references on the same
    FP8 weights, and the fp64 oracle."""
    from kernels.formats import quantize_weights
    from kernels.reference import moe_decode

    problem = make_problem(shape, tokens, seed=8, routing=routing, xp=cupy)
    weights = quantize_weights(problem.w13, problem.w2, "fp8-block128")
    host = problem.compact()
    h13, h2 = quantize_weights(host.w13, host.w2, "fp8-block128")
    args = (host.x, h13, h2, host.topk_ids, host.topk_weights)
    return problem, weights, args, moe_decode(*args, mode="fp64", weight_format="fp8-block128")


def fp8() -> None:
    from kernels.reference import moe_decode

    for shape, tokens, routing in ((ODD_SHAPES["h2880-i264"], 7, "zipf"), (ODD_SHAPES["h264-i40"], 9, "same"),
                                   ("qwen3-30b-a3b", 20, "correlated")):
        problem, weights, args, oracle = _fp8_case(shape, tokens, routing)
        for name in FP8_PATHS:
            mode, quant = ("classical", "fp8") if "w8a8" in name else ("warp_decode", None)
            faithful = moe_decode(*args, mode=mode, quant=quant, weight_format="fp8-block128")
            _run_checked(name, problem, weights, faithful, oracle, f"{_dims(problem)} {routing}")


T16_PATHS = ("cupy:warp-decode-mma-fp8-t16", "cupy:warp-decode-mma-pairs-fp8-t16",
             "cupy:warp-decode-mma-grouped-fp8-t16")


def t16() -> None:
    """The three tensor-core paths on fp8-block128-t16 tiles (W_TILED), on shapes with partial scale blocks at both
    edges and at qwen3-30b-a3b, under skewed routings, against the references on the row layout's same values."""
    from kernels.formats import FP8_BLOCK128_T16
    from kernels.reference import moe_decode

    for shape, tokens, routing in ((MoEShape("h192-i320", 192, 320, 12, 4), 9, "zipf"),
                                   (MoEShape("h576-i448", 576, 448, 24, 6), 37, "same"),
                                   ("qwen3-30b-a3b", 20, "correlated")):
        problem, weights, args, oracle = _fp8_case(shape, tokens, routing)
        tiles = FP8_BLOCK128_T16.from_rows(*weights)
        faithful = moe_decode(*args, mode="warp_decode", weight_format="fp8-block128")
        for name in T16_PATHS:
            _run_checked(name, problem, tiles, faithful, oracle, f"{_dims(problem)} {routing}")


BF16_T16_PATHS = ("cupy:warp-decode-mma-t16", "cupy:warp-decode-mma-pairs-t16", "cupy:warp-decode-mma-grouped-t16")


def bf16_t16() -> None:
    """The three tensor-core bf16 paths on bf16-t16 tiles, on shapes whose H and I are odd multiples of 32 and at
    qwen3-30b-a3b, under skewed routings, against the references on the row layout."""
    from kernels.formats import BF16_T16

    for shape, tokens, routing in ((MoEShape("h160-i96", 160, 96, 12, 4), 9, "zipf"),
                                   (MoEShape("h544-i224", 544, 224, 24, 6), 37, "same"),
                                   ("qwen3-30b-a3b", 20, "correlated")):
        problem = make_problem(shape, tokens, seed=8, routing=routing, xp=cupy)
        tiles = BF16_T16.from_rows(problem.w13, problem.w2)
        faithful, oracle = _references(problem)
        for name in BF16_T16_PATHS:
            _run_checked(name, problem, tiles, faithful, oracle, f"{_dims(problem)} {routing}")


def fp8_chunks() -> None:
    """The strict FP8 kernels at 16-value chunks on a shape with partial scale blocks at both edges."""
    from kernels.reference import moe_decode

    for shape, tokens, routing in ((MoEShape("h2880-i368", 2880, 368, 16, 4), 5, "zipf"), ("qwen3-30b-a3b", 2, "same")):
        problem, weights, args, oracle = _fp8_case(shape, tokens, routing)
        faithful = moe_decode(*args, mode="warp_decode", weight_format="fp8-block128")
        for knobs in ({"GU_CHUNK": 16, "DN_CHUNK": 16, "DN_SLOTS": 4}, {"GU_CHUNK": 16, "DN_SLOTS": 8}):
            _run_checked("cupy:warp-decode-fp8", problem, weights, faithful, oracle, f"{_dims(problem)} {routing}",
                         **knobs)


def _print_routed_bytes(problem: object, value_bytes: int, label: str) -> None:
    """The routed experts' unique weight bytes, for Nsight Compute's DRAM bytes against them."""
    experts, s = problem.unique_experts, problem.shape  # type: ignore[attr-defined]
    print(f"{experts} experts routed: gate_up {experts * 2 * s.intermediate * s.hidden * value_bytes} B, down "
          f"{experts * s.hidden * s.intermediate * value_bytes} B ({label})", flush=True)


def fp8_layers(name: str, model: str, tokens: int, count: int = 2, routing: str = "uniform",
               overrides: dict[str, int] | None = None) -> None:
    from kernels.formats import quantize_weights

    problem = make_problem(model, tokens, seed=8, routing=routing, xp=cupy)
    weights = quantize_weights(problem.w13, problem.w2, "fp8-block128")
    launch = get_variant(name).make(_dims(problem), **(overrides or {}))
    _print_routed_bytes(problem, 1, "FP8 values")
    out = _poisoned_out(cupy, tokens, problem.shape.hidden)
    for _ in range(count):
        launch(problem.x, *weights, problem.topk_ids, problem.topk_weights, out)  # type: ignore[attr-defined]
    cupy.cuda.runtime.deviceSynchronize()
    print("ran", name, model, tokens, flush=True)


def new(odd_only: bool = False) -> None:
    cases = ((ODD_SHAPES["h264-i40"], 9, "same"), (ODD_SHAPES["h2880-i264"], 37, "zipf"),
             ("qwen3-30b-a3b", 24, "zipf-2"))
    for shape, tokens, routing in cases[:2] if odd_only else cases:
        problem = make_problem(shape, tokens, seed=8, routing=routing, xp=cupy)
        faithful, oracle = _references(problem)
        tag = f"{_dims(problem)} {routing}"
        for name in ("cupy:warp-decode-mma-pairs", "cupy:warp-decode-mma-grouped"):
            _run_checked(name, problem, (problem.w13, problem.w2), faithful, oracle, tag)


WHOLE_FLUSH_SHAPE = MoEShape("h1024-i128", 1024, 128, 8, 4)  # 16-chunk gate_up ranges, 16-chunk down rows


def whole_flush() -> None:
    """Both forms where the rules derive them (the shape's ranges are whole rounds), printed from the resolved knobs."""
    from kernels.reference import moe_decode

    for tokens, routing in ((9, "zipf"), (6, "same")):
        problem = make_problem(WHOLE_FLUSH_SHAPE, tokens, seed=8, routing=routing, xp=cupy)
        faithful, oracle = _references(problem)
        tag = f"{_dims(problem)} {routing}"
        _run_checked("cupy:warp-decode-mma-grouped", problem, (problem.w13, problem.w2), faithful, oracle, tag)
        _run_checked("cupy:warp-decode-mma", problem, (problem.w13, problem.w2), faithful, oracle, tag, DB_GROUPED=1)
        problem, weights, args, oracle = _fp8_case(WHOLE_FLUSH_SHAPE, tokens, routing)
        faithful = moe_decode(*args, mode="warp_decode", weight_format="fp8-block128")
        _run_checked("cupy:warp-decode-mma-grouped-fp8", problem, weights, faithful, oracle, tag, GB_UNROLL=2)
    print("resolved", get_variant("cupy:warp-decode-mma-grouped").resolve(_dims(problem)), flush=True)


HOT_CASES = (  # (variant, knobs): a hot tile in one pass of 2 / 3 blocks, the grouped and the balanced downs
    ("cupy:warp-decode-mma-grouped", {"HOT_NBLK": 3}),
    ("cupy:warp-decode-mma", {"HOT_NBLK": 2, "DB_GROUPED": 0}),
    ("cupy:warp-decode-mma-grouped-fp8", {"GB_UNROLL": 2, "HOT_NBLK": 2}),
    ("cupy:warp-decode-mma-fp8", {"HOT_NBLK": 2, "DB_GROUPED": 0}),
    # bf16 two-block hot passes as auto_hot_nblk gives them at large experts: the grouped down, both kernels under
    # the 96-register caps (PASS_REGS), the share groups as resolved (added 2026-12-03)
    ("cupy:warp-decode-mma", {"HOT_NBLK": 2}),
    ("cupy:warp-decode-mma-grouped", {"HOT_NBLK": 2}),
)


def hot() -> None:
    """HOT_NBLK: tiles of up to 16 / 24 pairs, a hot expert's tile in one pass of 2 / 3 8-pair blocks, bf16 and FP8,
    under Zipf and all-on-one-set routings (added 2026-12-02, for hot tiles; the tensor-core cases run the
    single-chain gate_up's hot passes at GB_UNROLL k blocks since auto_hot_gate_up_unroll, 2026-12-03)."""
    problem = _bf16_and_fp8_cases(WHOLE_FLUSH_SHAPE, HOT_CASES)
    print("resolved", get_variant("cupy:warp-decode-mma").resolve(_dims(problem), **HOT_CASES[-1][1]), flush=True)


def _bf16_and_fp8_cases(shape: MoEShape, cases: tuple[tuple[str, dict[str, int]], ...]) -> object:
    """Each (variant, knobs) of ``cases`` on ``shape`` at T = 12 Zipf and T = 16 all-on-one-set, on bf16 weights or
    (variants ending in fp8) the same problem's FP8 weights, every output checked; returns the last bf16 problem."""
    from kernels.reference import moe_decode

    for tokens, routing in ((12, "zipf"), (16, "same")):
        problem = make_problem(shape, tokens, seed=8, routing=routing, xp=cupy)
        faithful, oracle = _references(problem)
        fp8_problem, weights, args, fp8_oracle = _fp8_case(shape, tokens, routing)
        fp8_faithful = moe_decode(*args, mode="warp_decode", weight_format="fp8-block128")
        tag = f"{_dims(problem)} {routing}"
        for name, knobs in cases:
            if name.endswith("fp8"):
                _run_checked(name, fp8_problem, weights, fp8_faithful, fp8_oracle, tag, **knobs)
            else:
                _run_checked(name, problem, (problem.w13, problem.w2), faithful, oracle, tag, **knobs)
    return problem


def fp8_pair() -> None:
    """The FP8 invariant pair at its library knobs (FP8_INVARIANT_KSPLIT ranges), Zipf / all-on-one-set routings."""
    from kernels.reference import moe_decode

    for shape, tokens, routing in ((ODD_SHAPES["h2880-i264"], 7, "zipf"), (ODD_SHAPES["h264-i40"], 9, "same"),
                                   ("qwen3-30b-a3b", 3, "zipf")):
        problem, weights, args, oracle = _fp8_case(shape, tokens, routing)
        faithful = moe_decode(*args, mode="warp_decode", weight_format="fp8-block128")
        for name in ("cupy:warp-decode-mma-pairs-fp8", "cupy:warp-decode-mma-grouped-fp8"):
            _run_checked(name, problem, weights, faithful, oracle, f"{_dims(problem)} {routing}")


ROW_TILES_SHAPE = MoEShape("h1040-i128", 1040, 128, 8, 4)  # 32.5 warps of 32 rows: the last one's second tile past H


def row_tiles() -> None:
    """The FP8 tensor-core kernels (the widening's multiply on B: FP8_PRMT 2 on the tensor-core pair, 3 on the
    per-pair pair) and the grouped down at two row tiles per warp (DB_ROW_TILES 2, with hot tiles), FP8 and bf16, on
    a shape whose H is not a multiple of a warp's 32 rows, under Zipf and all-on-one-set routings (added 2026-12-03,
    for those knobs)."""
    cases = (("cupy:warp-decode-mma-grouped-fp8", {"DB_ROW_TILES": 2, "HOT_NBLK": 2}),
             ("cupy:warp-decode-mma-fp8", {"DB_GROUPED": 1, "DB_ROW_TILES": 2}),
             ("cupy:warp-decode-mma-pairs-fp8", {}),
             ("cupy:warp-decode-mma-grouped", {"DB_ROW_TILES": 2}),
             ("cupy:warp-decode-mma-fp8", {"GB_UNROLL": 2}))
    _bf16_and_fp8_cases(ROW_TILES_SHAPE, cases)


FAMILY_SHAPES = ((MoEShape("h160-i96", 160, 96, 12, 4), 9, "zipf"),
                 (MoEShape("h576-i448", 576, 448, 24, 6), 37, "same"),
                 (ODD_SHAPES["h264-i40"], 9, "same"), (ODD_SHAPES["h2880-i264"], 37, "zipf"),
                 ("qwen3-30b-a3b", 20, "zipf-2"))


def families(odd_only: bool = False) -> None:
    """Every registered batched path (kernels.batched.PATHS: each family on each weight format) on odd shapes and
    qwen3-30b-a3b under skewed routings, with hot tiles in two-block passes and the grouped down where they apply,
    outputs compared with the references on the same weights (added 2026-12-04, for the families)."""
    from kernels import batched
    from kernels.formats import get_format
    from kernels.reference import moe_decode

    for shape, tokens, routing in FAMILY_SHAPES[:-1] if odd_only else FAMILY_SHAPES:
        problem, fp8_weights, args, fp8_oracle = _fp8_case(shape, tokens, routing)
        faithful, oracle = _references(problem)
        fp8_faithful = moe_decode(*args, mode="warp_decode", weight_format="fp8-block128")
        tag = f"{_dims(problem)} {routing}"
        for name in batched.PATHS:
            variant = get_variant(name)
            fmt = get_format(variant.weight_format)
            if not variant.can_run(_dims(problem)):
                continue
            try:
                variant.resolve(_dims(problem))
            except ValueError as error:  # a tiled format on dims it cannot tile
                print("skip", name, tag, error, flush=True)
                continue
            fp8 = fmt.scaled
            rows = fp8_weights if fp8 else (problem.w13, problem.w2)
            weights = fmt.from_rows(*rows) if fmt.tiled else rows
            extra = ({"HOT_NBLK": 2},) if variant.resolve(_dims(problem)).get("HOT_NBLK") == 0 else ()
            for knobs in ({}, *extra):
                _run_checked(name, problem, weights, fp8_faithful if fp8 else faithful, fp8_oracle if fp8 else oracle,
                             tag, **knobs)


def layers(name: str, model: str, tokens: int, count: int = 3, routing: str = "uniform", seed: int = 8) -> None:
    prototypes.load()
    problem = make_problem(model, tokens, seed=seed, routing=routing, xp=cupy)
    _print_routed_bytes(problem, 2, "bf16")
    launch = get_variant(name).make(_dims(problem))
    out = _poisoned_out(cupy, tokens, problem.shape.hidden)
    for _ in range(count):
        launch(*problem.arrays, out)
    cupy.cuda.runtime.deviceSynchronize()
    print("ran", name, model, tokens, flush=True)


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "small"
    if what == "small":
        small()
    elif what == "skew":
        skew()
    elif what == "t64":
        layers("cupy:warp-decode-mma", "qwen3-30b-a3b", 64)
    elif what == "zipf64":
        layers("cupy:warp-decode-mma", "qwen3-235b-a22b", 64, routing="zipf")
    elif what == "t1":
        layers("cupy:warp-decode", "qwen3-30b-a3b", 1)
        layers("proto:fused-layer", "qwen3-30b-a3b", 1)
    elif what == "fp8":
        fp8()
    elif what == "whole-flush":
        whole_flush()
    elif what == "hot":
        hot()
    elif what == "t16":
        t16()
    elif what == "bf16-t16":
        bf16_t16()
    elif what == "fp8-chunks":
        fp8_chunks()
    elif what == "fp8-pair":
        fp8_pair()
    elif what == "row-tiles":
        row_tiles()
    elif what == "fp8-mma-t32":
        fp8_layers("cupy:warp-decode-mma-fp8", "qwen3-30b-a3b", 32)
    elif what == "fp8-strict-t1":
        fp8_layers("cupy:warp-decode-fp8", "qwen3-30b-a3b", 1)
    elif what == "fp8-point":
        variant, model, tokens, routing = sys.argv[2:6]
        knobs = {k: int(v) for k, v in (a.split("=", 1) for a in sys.argv[6:])}  # KNOB=value overrides
        fp8_layers(variant, model, int(tokens), count=1, routing=routing, overrides=knobs)
    elif what == "point":
        variant, model, tokens, routing = sys.argv[2:6]
        layers(variant, model, int(tokens), count=1, routing=routing, seed=0)
    elif what == "families":
        families()
    elif what == "families-odd":
        families(odd_only=True)
    elif what == "new":
        new()
    elif what == "new-odd":
        new(odd_only=True)
    else:
        raise SystemExit(f"unknown workload {what!r}: small, skew, t64, zipf64, t1, fp8, fp8-chunks, fp8-pair, "
                         "fp8-mma-t32, fp8-strict-t1, fp8-point, point, new, new-odd, whole-flush, hot, row-tiles, "
                         "t16, families or families-odd")
