"""Warp decode, CuPy RawKernel backend (kernels/warp_decode_cupy.py).

CPU tests (run anywhere): argument checking happens before any device call, so wrong kinds / dtypes /
ranks / shapes are caught with stand-in "cupy" arrays; knob validation and the auto heuristics; the
variant registration.

GPU tests (``-m gpu``, the H200): every preset at T in {1, 3, 8, 64}, odd shapes, every routing, fp32 out,
bitwise repeatability, bad expert ids (ValueError outside capture, NaN rows inside the kernels), CUDA-graph
capture, the stages, the registered variant and a sample of its grid.

How results are compared with ``reference.moe_decode(mode="warp_decode")`` -- within one bf16 ulp, not
bitwise. Both accumulate in fp32 and round the same places (the intermediate once, the output once), but
the reference's fp32 sums run in BLAS order and multiply the routing weight after each expert's dot product,
while the kernels sum in a per-lane + warp-butterfly order with the weight folded into one accumulator.
The two fp32 values differ by a few fp32 ulps, which (a) flips a final bf16 rounding now and then: at most
1 ulp of the output, and (b) rarely flips the bf16 rounding of one intermediate element, which moves the
fp32 output of that token by ~|w2| * weight * ulp(intermediate) ~ RMS(out) * 2**-8 / sqrt(I) -- an
absolute error, large in ulps only for outputs near zero. So the tolerance is
``|got - ref| <= ulp(|ref|) + ulp(RMS(ref) / 4)`` (one final-rounding ulp, plus an absolute allowance of
~RMS * 2**-10 for the pre-rounding difference), and at least 85 % of the outputs must be bitwise equal
(typically > 99 %; 91 % measured for mixtral, whose 14336-long sums flip more roundings). float32 out has
no final rounding: ``|got - ref| <= 2**-16 |ref| + 2**-9 RMS``.
Against the fp64 oracle: rel-L2 < 5e-3.

The CPU tests also compile the kernels' CUDA C with g++ (one thread per lane, shuffles through a barrier)
and check it against the reference on small odd shapes: index math, guards, shuffles and rounding are
exercised before any GPU run.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kernels import warp_decode_cupy as wdc
from kernels.contract import BF16, Dims
from kernels.problem import Problem, make_problem
from kernels.reference import moe_decode
from kernels.routing import GENERATORS
from kernels.shapes import PRESETS, MoEShape
from tests.warp_checks import (
    EMULATION_LOAD,
    EMULATION_PRELUDE,
    ODD_SHAPES,
    ROUTINGS,
    WARP_LOCKSTEP_LAUNCH,
    FakeCupyArray,
    _assert_matches,
    _fake_inputs,
    _poisoned_out,
    _references,
    _seed,
    assert_pdl_chain_bitwise,
    build_emulator,
    run_emulator,
    slow_except,
)

# ---------------------------------------------------------------------------------------------------
# CPU: argument checks before any device call
# ---------------------------------------------------------------------------------------------------






def _call(**arrays: Any) -> Any:
    return wdc.warp_decode(arrays["x"], arrays["w13"], arrays["w2"], arrays["topk_ids"], arrays["topk_weights"])


def test_numpy_inputs_are_a_type_error() -> None:
    problem = make_problem("tiny", 2, seed=3)
    with pytest.raises(TypeError, match="cupy"):
        wdc.warp_decode(*problem.arrays)
    with pytest.raises(TypeError, match="cupy"):
        import kernels

        kernels.warp_decode(*problem.arrays, backend="cupy")


def test_mixed_kinds_are_a_type_error() -> None:
    arrays = _fake_inputs()
    arrays["w2"] = np.zeros((3, 16, 8), BF16)
    with pytest.raises(TypeError, match="w2"):
        _call(**arrays)


@pytest.mark.parametrize(
    ("name", "replacement", "error", "match"),
    [
        ("x", FakeCupyArray((2, 16), np.float32), TypeError, "x must have dtype"),
        ("w13", FakeCupyArray((3, 16, 16), np.float16), TypeError, "w13 must have dtype"),
        ("topk_ids", FakeCupyArray((2, 2), np.int64), TypeError, "topk_ids must have dtype"),
        ("topk_weights", FakeCupyArray((2, 2), np.float64), TypeError, "topk_weights must have dtype"),
        ("x", FakeCupyArray((2, 16, 1), BF16), ValueError, "x must have 2 dimensions"),
        ("w2", FakeCupyArray((3, 16), BF16), ValueError, "w2 must have 3 dimensions"),
        ("w2", FakeCupyArray((3, 16, 16), BF16), ValueError, "w2 must be"),
        ("w13", FakeCupyArray((3, 16, 24), BF16), ValueError, "w13 is"),
        ("topk_ids", FakeCupyArray((3, 2), np.int32), ValueError, "topk_ids must be"),
        ("topk_weights", FakeCupyArray((2, 3), np.float32), ValueError, "topk_weights must be"),
    ],
)
def test_bad_inputs_raise_before_any_device_call(name: str, replacement: Any, error: type, match: str) -> None:
    arrays = _fake_inputs()
    arrays[name] = replacement
    with pytest.raises(error, match=match):
        _call(**arrays)


@pytest.mark.parametrize(
    ("out", "workspace", "error", "match"),
    [
        (FakeCupyArray((2, 8), BF16), None, ValueError, "out must be"),
        (FakeCupyArray((2, 16), np.float16), None, TypeError, "out must have dtype"),
        (np.zeros((2, 16), BF16), None, TypeError, "out must be a cupy"),
        (None, FakeCupyArray((2, 2, 16), BF16), ValueError, "workspace must have shape"),
        (None, FakeCupyArray((2, 2, 8), np.float32), TypeError, "workspace must have dtype"),
        (None, np.zeros((2, 2, 8), BF16), TypeError, "workspace must be a cupy"),
    ],
)
def test_bad_out_and_workspace(out: Any, workspace: Any, error: type, match: str) -> None:
    arrays = _fake_inputs()
    with pytest.raises(error, match=match):
        wdc.warp_decode(*arrays.values(), out=out, workspace=workspace)


def test_sizes_not_multiple_of_8_rejected() -> None:
    arrays = _fake_inputs(H=12)
    with pytest.raises(ValueError, match="multiple of 8"):
        _call(**arrays)


def test_stage_functions_check_kinds_first() -> None:
    x = np.zeros((1, 8), BF16)
    with pytest.raises(TypeError, match="cupy"):
        wdc.gate_up(x, x, x, x)
    with pytest.raises(TypeError, match="cupy"):
        wdc.down(x, x, x, x, x)


def test_make_workspace_rejects_bad_sizes() -> None:
    for args in ((0, 1, 8), (1, -1, 8), (1, 1, 2.5), (True, 1, 8)):
        with pytest.raises(ValueError):
            wdc.make_workspace(*args)


# ---------------------------------------------------------------------------------------------------
# CPU: knobs
# ---------------------------------------------------------------------------------------------------
def test_resolve_params_validates() -> None:
    with pytest.raises(ValueError, match="unknown"):
        wdc.resolve_params(None, WARPS=4)
    with pytest.raises(ValueError, match="GU_BYTES"):
        wdc.resolve_params(None, GU_BYTES=12)
    with pytest.raises(ValueError, match="DN_WARPS"):
        wdc.resolve_params(None, DN_WARPS=33)
    with pytest.raises(ValueError, match="DN_SLOTS"):
        wdc.resolve_params(None, DN_SLOTS=40)
    with pytest.raises(TypeError, match="GU_OUTS"):
        wdc.resolve_params(None, GU_OUTS=True)
    with pytest.raises(TypeError, match="GU_OUTS"):
        wdc.resolve_params(None, GU_OUTS=1.5)
    assert wdc.resolve_params(None) == wdc.DEFAULTS


def test_auto_params_are_what_the_h200_sweep_chose() -> None:
    def auto(name: str, tokens: int) -> tuple[int, int, int]:
        s = PRESETS[name]
        p = wdc.resolve_params(Dims(tokens, s.hidden, s.intermediate, s.experts, s.top_k))
        return p["DN_SLOTS"], p["DN_UNROLL"], p["DN_MIN_BLOCKS"]

    def warps(name: str, tokens: int) -> int:
        s = PRESETS[name]
        return wdc.resolve_params(Dims(tokens, s.hidden, s.intermediate, s.experts, s.top_k))["DN_WARPS"]

    assert (warps("qwen3-30b-a3b", 1), warps("qwen3-30b-a3b", 2), warps("qwen3-235b-a22b", 1)) == (1, 4, 4)
    # one round of 4 slots (4 x 16 B per lane), <= 64 registers (8 blocks of 4 warps), or of 8 slots at <= 128
    # registers when the down grid (T x H warps) is one wave anyway: the fastest in the H200 sweeps
    assert auto("qwen3-30b-a3b", 1) == (8, 1, 17)  # 2048 down warps in one-warp blocks: 17 blocks -> 120 regs
    assert auto("qwen3-30b-a3b", 8) == (4, 1, 8)
    assert auto("qwen3-235b-a22b", 1) == (4, 1, 8)  # 4096 down warps
    assert auto("mixtral-8x7b", 1)[:2] == (2, 1)  # K = 2
    for shape in PRESETS.values():
        for tokens in (1, 3, 8, 64, 512):
            p = wdc.resolve_params(Dims(tokens, shape.hidden, shape.intermediate, shape.experts, shape.top_k))
            assert all(p[k] >= 1 for k in wdc.AUTO_KNOBS)
            assert p["DN_SLOTS"] <= shape.top_k
    explicit = wdc.resolve_params(Dims(1, 2048, 768, 128, 8), DN_SLOTS=2, DN_UNROLL=6, DN_MIN_BLOCKS=1)
    assert (explicit["DN_SLOTS"], explicit["DN_UNROLL"], explicit["DN_MIN_BLOCKS"]) == (2, 6, 1)
    # explicit loads, auto register cap sized for them: 2 x 6 items -> 128 registers -> 4 blocks of 4 warps
    assert wdc.resolve_params(Dims(1, 2048, 768, 128, 8), DN_SLOTS=2, DN_UNROLL=6, DN_WARPS=4)["DN_MIN_BLOCKS"] == 4


def test_auto_register_caps_never_spill() -> None:
    """The auto __launch_bounds__ cap (_down_min_blocks) leaves room for the loads it was sized for: every
    point of the down sweep grids compiles for sm_90 with zero spill bytes (an older formula capped 8 slots
    at 96 registers and spilled 40 bytes, which the first H200 sweep timed without noticing)."""
    from concurrent.futures import ThreadPoolExecutor

    from kernels.compile import offline_report

    dims = Dims(1, 2048, 768, 128, 8)
    points = [dict(DN_SLOTS=s, DN_UNROLL=u, DN_OUTS=o) for s in (1, 2, 4, 8) for u in (1, 2) for o in (1, 2)
              if s * u * o <= 8]

    def spills(point: dict) -> tuple[dict, int, int]:
        resolved = wdc.resolve_params(dims, **point)
        down = next(r for r in offline_report(wdc.SOURCE, **resolved) if r.kernel == wdc.DOWN)
        return point, down.spills, down.registers

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(spills, points))
    assert [(p, s, r) for p, s, r in results if s] == []


def test_source_and_variant_are_registered() -> None:
    from kernels.compile import SOURCES
    from kernels.variants import get_variant

    assert SOURCES["warp_decode_cupy"] is wdc.SOURCE is wdc.FAMILY.source
    assert wdc.SOURCE.kernels == ("moe_gate_up_3d_batched", "moe_down_3d_batched")
    variant = get_variant("cupy:warp-decode")
    assert variant is wdc.VARIANT and variant.kernel_family is wdc.FAMILY and variant.source is wdc.SOURCE
    assert variant.backend == "cupy" and variant.family == "warp-decode" and variant.reference_mode == "warp_decode"
    assert set(variant.params) == set(wdc.DEFAULTS)
    assert set(variant.grid) <= set(wdc.DEFAULTS)
    for values in variant.grid.values():
        for value in values:
            assert isinstance(value, int)
    # every knob the offline report compiles renders (unknown knobs would raise)
    for overrides in wdc.SOURCE.variants:
        wdc.SOURCE.render(**overrides)


def test_family_resolves_like_resolve_params() -> None:
    """The module is one kernel family: ``resolve_params`` is ``FAMILY.resolve``, the variant resolves through it,
    the offline report's extra knob sets are what the presets resolve to, and PDL needs sm_90."""
    from kernels.compile import preset_variants

    dims = Dims(1, 2048, 768, 128, 8)
    assert wdc.FAMILY.name == "warp-decode" and wdc.FAMILY.defaults == wdc.DEFAULTS
    assert wdc.FAMILY.resolve(dims) == wdc.resolve_params(dims) == wdc.VARIANT.resolve(dims)
    assert wdc.VARIANT.resolve(dims, DN_SLOTS=2)["DN_SLOTS"] == 2
    assert wdc.SOURCE.variants == preset_variants(wdc.resolve_params, wdc.DEFAULTS)
    assert wdc.FAMILY.device_needs == {"PDL": 90}
    assert wdc.FAMILY.workspace is not None and wdc.FAMILY.stages is not None


def test_kernel_source_guards_and_comments() -> None:
    code = wdc.CODE
    # strict warp decode: no shared memory, no block-level sync, no atomics
    assert "#include" not in code and "__shared__" not in code and "__syncthreads" not in code
    assert "atomic" not in code
    assert code.count("(unsigned)experts") >= 2  # both kernels range-check ids
    assert "__ldg" in code and "uint4" in code


# ---------------------------------------------------------------------------------------------------
# CPU: the CUDA C itself, emulated (g++; one lane per CUDA thread, shuffles through a barrier)
# ---------------------------------------------------------------------------------------------------
EMULATION_HARNESS = EMULATION_PRELUDE + '#include "kernel.cu"\n' + WARP_LOCKSTEP_LAUNCH + EMULATION_LOAD + r"""
int main(int argc, char** argv) {
    int T = atoi(argv[1]), H = atoi(argv[2]), I = atoi(argv[3]), E = atoi(argv[4]), K = atoi(argv[5]);
    int f32 = atoi(argv[6]);
    long long gu_blocks = atoll(argv[7]), dn_blocks = atoll(argv[8]);
    std::string dir = argv[9];
    auto x = load<uint16_t>(dir + "/x.bin", (size_t)T * H);
    auto w13 = load<uint16_t>(dir + "/w13.bin", (size_t)E * 2 * I * H);
    auto w2 = load<uint16_t>(dir + "/w2.bin", (size_t)E * H * I);
    auto ids = load<int>(dir + "/ids.bin", (size_t)T * K);
    auto wts = load<float>(dir + "/wts.bin", (size_t)T * K);
    std::vector<uint16_t> inter((size_t)T * K * I, 0x7fc0);
    std::vector<uint32_t> out((size_t)T * H, 0x7fc07fc0u);  // NaN poison in either view
    launch(gu_blocks, GU_WARPS * 32,
           [&] { moe_gate_up_3d_batched(x.data(), w13.data(), ids.data(), inter.data(), T, H, I, E, K); });
    launch(dn_blocks, DN_WARPS * 32, [&] {
        moe_down_3d_batched(inter.data(), w2.data(), ids.data(), wts.data(), out.data(), f32, T, H, I, E, K);
    });
    FILE* f = fopen((dir + "/out.bin").c_str(), "wb");
    fwrite(out.data(), 1, (size_t)T * H * (f32 ? 4 : 2), f);
    fclose(f);
    return 0;
}
"""


def _emulate(problem: Problem, ids: np.ndarray | None = None, out_dtype: Any = BF16, **params: int) -> np.ndarray:
    """Run the kernels' CUDA C on the CPU (same launch geometry as the CuPy path); returns out [T, H]."""
    import tempfile

    shape = problem.shape
    dims = Dims(problem.tokens, shape.hidden, shape.intermediate, shape.experts, shape.top_k)
    resolved = wdc.resolve_params(dims, **params)
    gu_warps = dims.tokens * dims.top_k * -(-dims.intermediate // resolved["GU_OUTS"])
    dn_warps = dims.tokens * -(-dims.hidden // resolved["DN_OUTS"])
    f32 = int(np.dtype(out_dtype) == np.float32)
    binary = build_emulator(wdc.SOURCE.render(**resolved), EMULATION_HARNESS)
    with tempfile.TemporaryDirectory() as tmp:
        problem.x.tofile(f"{tmp}/x.bin")
        problem.w13.tofile(f"{tmp}/w13.bin")
        problem.w2.tofile(f"{tmp}/w2.bin")
        np.ascontiguousarray(problem.topk_ids if ids is None else ids, np.int32).tofile(f"{tmp}/ids.bin")
        problem.topk_weights.tofile(f"{tmp}/wts.bin")
        run_emulator(binary, dims.tokens, dims.hidden, dims.intermediate, dims.experts, dims.top_k, f32,
                     -(-gu_warps // resolved["GU_WARPS"]), -(-dn_warps // resolved["DN_WARPS"]), tmp)
        raw = np.fromfile(f"{tmp}/out.bin", np.float32 if f32 else np.uint16)
    return raw.reshape(dims.tokens, dims.hidden) if f32 else raw.view(BF16).reshape(dims.tokens, dims.hidden)


EMULATED = [  # small: the emulation runs ~1 ms per warp on 2 cores
    ("tiny", 2, "uniform", {}, True),
    ("tiny", 1, "zipf", {"GU_OUTS": 2, "DN_OUTS": 3, "DN_SLOTS": 1, "DN_UNROLL": 2}, False),
    (MoEShape("h8-i8-e1-k1", 8, 8, 1, 1), 3, "uniform", {}, True),
    (MoEShape("h264-i40", 264, 40, 3, 2), 1, [2, 2],
     {"GU_BYTES": 16, "GU_UNROLL": 1, "GU_OUTS": 2, "DN_BYTES": 8, "DN_OUTS": 4}, False),
    (MoEShape("h64-k40", 64, 24, 44, 40), 1, "uniform", {"GU_BYTES": 4, "GU_OUTS": 4, "DN_BYTES": 4, "DN_SLOTS": 6},
     False),
    (MoEShape("h136-i264-k1", 136, 264, 2, 1), 1, "same", {"GU_OUTS": 3, "GU_WARPS": 3, "DN_SLOTS": 2}, False),
]


# the quick subset: the defaults on the tiny preset (bf16 and fp32 out) and H, I not multiples of 256; the rest slow
@pytest.mark.parametrize(("shape", "tokens", "routing", "params", "fp32"),
                         slow_except(EMULATED, [f"{getattr(c[0], 'name', c[0])}-T{c[1]}" for c in EMULATED], {0, 3}))
def test_cuda_source_emulated_on_cpu(rng: np.random.Generator, shape: Any, tokens: int, routing: Any,
                                     params: dict[str, int], fp32: bool) -> None:
    """The real kernel text (index math, guards, shuffles, rounding) against the reference, on the CPU."""
    problem = make_problem(shape, tokens, seed=_seed(rng), routing=routing)
    got = _emulate(problem, **params)
    faithful = moe_decode(*problem.arrays, mode="warp_decode")
    oracle = moe_decode(*problem.arrays, mode="fp64")
    _assert_matches(got, faithful, oracle, f"emulated {problem.shape.name} {params}")
    if not fp32:
        return
    got32 = _emulate(problem, out_dtype=np.float32, **params)
    faithful32 = moe_decode(*problem.arrays, mode="warp_decode", out_dtype=np.float32)
    _assert_matches(got32, faithful32, oracle, f"emulated fp32 out {problem.shape.name} {params}")


def test_bad_ids_emulated_on_cpu(rng: np.random.Generator) -> None:
    """Out-of-range ids reach the kernels (as under capture): those tokens' rows NaN, the others exact."""
    problem = make_problem("tiny", 4, seed=_seed(rng))
    ids = problem.topk_ids.copy()
    ids[0, 1] = problem.shape.experts
    ids[2, 0] = -3
    got = _emulate(problem, ids=ids, GU_OUTS=4, DN_OUTS=4)
    assert np.all(np.isnan(got[[0, 2]].astype(np.float32)))
    good = [1, 3]
    sub = Problem(problem.shape, 2, 0, "fixed", problem.x[good], problem.w13, problem.w2, problem.topk_ids[good],
                  problem.topk_weights[good])
    _assert_matches(got[good], moe_decode(*sub.arrays, mode="warp_decode"), moe_decode(*sub.arrays, mode="fp64"),
                    "emulated good tokens")




# ---------------------------------------------------------------------------------------------------
# GPU helpers
# ---------------------------------------------------------------------------------------------------




def _poisoned_workspace(cupy: Any, dims: Dims) -> Any:
    ws = wdc.make_workspace(dims.tokens, dims.top_k, dims.intermediate)
    ws.view(cupy.uint16).fill(0x7FC0)
    return ws








def _run_and_check(cupy: Any, problem: Problem, what: str, out_dtype: Any = BF16, **params: Any) -> np.ndarray:
    dims = Dims(problem.tokens, problem.shape.hidden, problem.shape.intermediate, problem.shape.experts,
                problem.shape.top_k)
    out = _poisoned_out(cupy, dims.tokens, dims.hidden, out_dtype)
    ws = _poisoned_workspace(cupy, dims)
    returned = wdc.warp_decode(*problem.arrays, out=out, workspace=ws, **params)
    assert returned is out
    cupy.cuda.runtime.deviceSynchronize()
    got = cupy.asnumpy(out)
    faithful, oracle = _references(problem, out_dtype)
    _assert_matches(got, faithful, oracle, what)
    return got


# ---------------------------------------------------------------------------------------------------
# GPU tests
# ---------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 3, 8, 64])
@pytest.mark.parametrize("model", list(PRESETS))
def test_presets(cupy_mod: Any, rng: np.random.Generator, model: str, tokens: int) -> None:
    problem = make_problem(model, tokens, seed=_seed(rng), routing="uniform", xp=cupy_mod)
    _run_and_check(cupy_mod, problem, f"{model} T={tokens}")
    del problem




@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 5, 37])
@pytest.mark.parametrize("name", list(ODD_SHAPES))
def test_odd_shapes(cupy_mod: Any, rng: np.random.Generator, name: str, tokens: int) -> None:
    problem = make_problem(ODD_SHAPES[name], tokens, seed=_seed(rng), xp=cupy_mod)
    _run_and_check(cupy_mod, problem, f"{name} T={tokens}")




@pytest.mark.gpu
@pytest.mark.parametrize("routing", list(ROUTINGS))
def test_routings(cupy_mod: Any, rng: np.random.Generator, routing: str) -> None:
    for model, ids in zip(("tiny", "qwen3-30b-a3b"), ROUTINGS[routing], strict=True):
        problem = make_problem(model, 6, seed=_seed(rng), routing=ids, xp=cupy_mod)
        _run_and_check(cupy_mod, problem, f"{model} routing {routing}")


@pytest.mark.gpu
@pytest.mark.parametrize("routing", GENERATORS)
def test_generated_routings(cupy_mod: Any, rng: np.random.Generator, routing: str) -> None:
    """Every routing generator, the skewed and correlated ones included (kernels.routing.GENERATORS)."""
    problem = make_problem("qwen3-30b-a3b", 8, seed=_seed(rng), routing=routing, xp=cupy_mod)
    _run_and_check(cupy_mod, problem, f"qwen3-30b T=8 routing {routing}")


@pytest.mark.gpu
def test_float32_out(cupy_mod: Any, rng: np.random.Generator) -> None:
    for model, tokens in (("tiny", 3), ("qwen3-30b-a3b", 4)):
        problem = make_problem(model, tokens, seed=_seed(rng), routing="zipf", xp=cupy_mod)
        _run_and_check(cupy_mod, problem, f"{model} fp32 out", out_dtype=np.float32)


@pytest.mark.gpu
def test_bitwise_identical_over_three_runs(cupy_mod: Any, rng: np.random.Generator) -> None:
    for model, tokens in (("qwen3-30b-a3b", 8), ("h264-i40", 5)):
        shape = ODD_SHAPES.get(model, model)
        problem = make_problem(shape, tokens, seed=_seed(rng), xp=cupy_mod)
        results = []
        for _ in range(3):
            out = _poisoned_out(cupy_mod, tokens, problem.x.shape[1])
            wdc.warp_decode(*problem.arrays, out=out)
            cupy_mod.cuda.runtime.deviceSynchronize()
            results.append(cupy_mod.asnumpy(out).view(np.uint16))
        assert np.array_equal(results[0], results[1]) and np.array_equal(results[0], results[2])


@pytest.mark.gpu
def test_allocating_call_returns_new_output(cupy_mod: Any, rng: np.random.Generator) -> None:
    problem = make_problem("tiny", 2, seed=_seed(rng), xp=cupy_mod)
    out = wdc.warp_decode(*problem.arrays)
    assert isinstance(out, cupy_mod.ndarray) and out.dtype == BF16 and out.shape == (2, 136)
    faithful, oracle = _references(problem)
    _assert_matches(cupy_mod.asnumpy(out), faithful, oracle, "allocating call")


@pytest.mark.gpu
def test_out_of_range_ids_raise_outside_capture(cupy_mod: Any, rng: np.random.Generator) -> None:
    problem = make_problem("tiny", 3, seed=_seed(rng), xp=cupy_mod)
    for bad in (problem.shape.experts, -1):
        ids = problem.topk_ids.copy()
        ids[1, 0] = bad
        with pytest.raises(ValueError, match="topk_ids"):
            wdc.warp_decode(problem.x, problem.w13, problem.w2, ids, problem.topk_weights)


@pytest.mark.gpu
def test_bad_ids_in_kernel_give_nan_rows(cupy_mod: Any, rng: np.random.Generator) -> None:
    """The stages do no value checks (as under capture): bad tokens -> NaN rows, the rest still exact."""
    for shape, tokens in ((PRESETS["tiny"], 4), (ODD_SHAPES["h64-k40"], 3)):
        problem = make_problem(shape, tokens, seed=_seed(rng), xp=cupy_mod)
        ids = problem.topk_ids.copy()
        ids[0, -1] = shape.experts  # one past the end
        ids[2, 0] = -7
        ids[2, -1] = 2**31 - 1
        dims = Dims(tokens, shape.hidden, shape.intermediate, shape.experts, shape.top_k)
        out = _poisoned_out(cupy_mod, tokens, shape.hidden)
        ws = _poisoned_workspace(cupy_mod, dims)
        wdc.gate_up(problem.x, problem.w13, ids, ws)
        wdc.down(ws, problem.w2, ids, problem.topk_weights, out)
        cupy_mod.cuda.runtime.deviceSynchronize()
        got = cupy_mod.asnumpy(out).astype(np.float32)
        assert np.all(np.isnan(got[0])) and np.all(np.isnan(got[2]))
        good = [t for t in range(tokens) if t not in (0, 2)]
        sub = Problem(shape, len(good), 0, "fixed", problem.x[good], problem.w13, problem.w2,
                      problem.topk_ids[good], problem.topk_weights[good])
        faithful, oracle = _references(sub)
        _assert_matches(cupy_mod.asnumpy(out)[good], faithful, oracle, "good tokens beside bad ids")


@pytest.mark.gpu
def test_graph_capture(cupy_mod: Any, rng: np.random.Generator) -> None:
    cupy = cupy_mod
    problem = make_problem("qwen3-30b-a3b", 4, seed=_seed(rng), xp=cupy)
    dims = Dims(4, problem.shape.hidden, problem.shape.intermediate, problem.shape.experts, problem.shape.top_k)
    out = _poisoned_out(cupy, dims.tokens, dims.hidden)
    ws = _poisoned_workspace(cupy, dims)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        wdc.warp_decode(*problem.arrays, out=out, workspace=ws)  # compile outside the capture
        stream.synchronize()
        out.view(cupy.uint16).fill(0x7FC0)
        stream.synchronize()
        stream.begin_capture()
        wdc.warp_decode(*problem.arrays, out=out, workspace=ws)
        graph = stream.end_capture()
        assert bool(np.all(np.isnan(cupy.asnumpy(out).astype(np.float32))))  # capture launched nothing
        graph.launch(stream)
        stream.synchronize()
    faithful, oracle = _references(problem)
    _assert_matches(cupy.asnumpy(out), faithful, oracle, "graph replay")
    # replay on new inputs written into the same buffers
    from kernels.routing import make_routing

    ids, weights = make_routing(4, dims.experts, dims.top_k, "zipf", _seed(rng))
    x = rng.standard_normal((4, dims.hidden), dtype=np.float32).astype(BF16)
    with stream:  # on the replay's stream: a non-blocking stream does not wait for the legacy default stream
        problem.x.view(cupy.uint16)[...] = cupy.asarray(x.view(np.uint16))
        problem.topk_ids[...] = cupy.asarray(ids)
        problem.topk_weights[...] = cupy.asarray(weights)
        out.view(cupy.uint16).fill(0x7FC0)
        graph.launch(stream)
        stream.synchronize()
    faithful, oracle = _references(problem)
    _assert_matches(cupy.asnumpy(out), faithful, oracle, "graph replay on new inputs")


@pytest.mark.gpu
def test_stages_and_variant_match_the_entry_point(cupy_mod: Any, rng: np.random.Generator) -> None:
    from kernels.variants import get_variant

    cupy = cupy_mod
    problem = make_problem(ODD_SHAPES["h264-i40"], 7, seed=_seed(rng), xp=cupy)
    shape = problem.shape
    dims = Dims(7, shape.hidden, shape.intermediate, shape.experts, shape.top_k)
    expected = cupy.asnumpy(wdc.warp_decode(*problem.arrays)).view(np.uint16)

    ws = _poisoned_workspace(cupy, dims)
    out = _poisoned_out(cupy, dims.tokens, dims.hidden)
    wdc.gate_up(problem.x, problem.w13, problem.topk_ids, ws)
    wdc.down(ws, problem.w2, problem.topk_ids, problem.topk_weights, out)
    cupy.cuda.runtime.deviceSynchronize()
    assert np.array_equal(cupy.asnumpy(out).view(np.uint16), expected)

    variant = get_variant("cupy:warp-decode")
    launch = variant.make(dims)
    out = _poisoned_out(cupy, dims.tokens, dims.hidden)
    launch(*problem.arrays, out)
    cupy.cuda.runtime.deviceSynchronize()
    assert np.array_equal(cupy.asnumpy(out).view(np.uint16), expected)
    out = _poisoned_out(cupy, dims.tokens, dims.hidden)
    stages = launch.stages(*problem.arrays, out)
    assert [name for name, _ in stages] == ["gate_up", "down"]
    for _, fn in stages:
        fn()
    cupy.cuda.runtime.deviceSynchronize()
    assert np.array_equal(cupy.asnumpy(out).view(np.uint16), expected)


GRID_SAMPLE = [
    {"GU_OUTS": 2, "DN_OUTS": 2},
    {"GU_OUTS": 3, "GU_UNROLL": 1, "DN_OUTS": 3, "DN_SLOTS": 3, "DN_UNROLL": 2},
    {"GU_BYTES": 16, "GU_UNROLL": 2, "DN_BYTES": 8, "DN_UNROLL": 4},
    {"GU_BYTES": 4, "DN_BYTES": 4, "GU_WARPS": 1, "DN_WARPS": 1},
    {"GU_WARPS": 8, "DN_WARPS": 8, "DN_SLOTS": 8, "DN_UNROLL": 1, "DN_MIN_BLOCKS": 1},
    {"DN_SLOTS": 1, "DN_UNROLL": 6, "GU_MIN_BLOCKS": 8},
    {"DN_EARLY_INTER": 0, "PDL": 0},
]


@pytest.mark.slow
def test_grid_sample_and_variant_grid_compile() -> None:
    """Every knob set the GPU tests use, and the variant grid's corners, compile for sm_90 (CPU, NVRTC; two at a
    time, NVRTC runs outside the GIL)."""
    from concurrent.futures import ThreadPoolExecutor

    from kernels.compile import offline_report
    from kernels.variants import get_variant

    grid = get_variant("cupy:warp-decode").grid
    corners = [{k: max(v) for k, v in grid.items()}, {k: min(v) for k, v in grid.items()}]
    all_resolved = [wdc.resolve_params(Dims(3, 2048, 768, 128, 8), **params) for params in GRID_SAMPLE + corners]
    with ThreadPoolExecutor(2) as pool:
        all_reports = list(pool.map(lambda resolved: offline_report(wdc.SOURCE, **resolved), all_resolved))
    for resolved, reports in zip(all_resolved, all_reports, strict=True):
        assert {r.kernel for r in reports} == {wdc.GATE_UP, wdc.DOWN}
        assert set(wdc.SOURCE.compiled_kernels(**resolved)) == {wdc.GATE_UP, wdc.DOWN}


@pytest.mark.gpu
@pytest.mark.parametrize("params", GRID_SAMPLE, ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()))
def test_knobs_keep_results(cupy_mod: Any, rng: np.random.Generator, params: dict[str, int]) -> None:
    for shape, tokens in ((ODD_SHAPES["h264-i40"], 5), (ODD_SHAPES["h64-k40"], 2), (PRESETS["qwen3-30b-a3b"], 3)):
        problem = make_problem(shape, tokens, seed=_seed(rng), xp=cupy_mod)
        _run_and_check(cupy_mod, problem, f"{shape.name} {params}", **params)


@pytest.mark.gpu
@pytest.mark.parametrize("model, tokens", [("qwen3-30b-a3b", 1), ("qwen3-235b-a22b", 3), ("tiny", 5)])
def test_programmatic_dependent_launch_is_bitwise_the_same(cupy_mod: Any, rng: np.random.Generator, model: str,
                                                           tokens: int) -> None:
    """PDL=1 changes only when the kernels start, never what they compute: eager and graph-replayed layer
    chains (each layer's gate_up overlapping the previous down) equal PDL=0 bitwise."""
    cupy = cupy_mod
    problem = make_problem(model, tokens, seed=_seed(rng), xp=cupy)
    dims = Dims(tokens, problem.shape.hidden, problem.shape.intermediate, problem.shape.experts, problem.shape.top_k)
    plain = wdc.FAMILY.build(dims, PDL=0)
    pdl = wdc.FAMILY.build(dims, PDL=1)
    expect = _poisoned_out(cupy, tokens, dims.hidden)
    plain(*problem.arrays, expect)
    got = _poisoned_out(cupy, tokens, dims.hidden)
    pdl(*problem.arrays, got)
    cupy.cuda.runtime.deviceSynchronize()
    assert bool((got.view(cupy.uint16) == expect.view(cupy.uint16)).all())
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        got.view(cupy.uint16).fill(0x7FC0)
        stream.begin_capture()
        for _ in range(4):  # a chain of layers, as in a decode step
            pdl(*problem.arrays, got)
        graph = stream.end_capture()
        graph.launch(stream)
        stream.synchronize()
    assert bool((got.view(cupy.uint16) == expect.view(cupy.uint16)).all())


@pytest.mark.gpu
@pytest.mark.parametrize("params", [{}, {"GU_UNROLL": 4, "GU_BYTES": 8}, {"DN_EARLY_INTER": 0, "DN_SLOTS": 8}],
                         ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()) or "defaults")
def test_pdl_chain_where_each_layer_reads_the_last(cupy_mod: Any, rng: np.random.Generator,
                                                   params: dict[str, int]) -> None:
    """A decode step's true dependency chain under PDL: layer l + 1's x is layer l's output, and every layer
    shares one poisoned workspace. A load hoisted above griddepcontrol.wait (the H200 caught the compiler
    doing this to __ldg loads of the intermediate) reads stale or NaN data; replayed graphs must equal the
    PDL=0 chain bitwise, every time."""
    cupy = cupy_mod
    problem = make_problem("qwen3-30b-a3b", 2, seed=_seed(rng), xp=cupy)
    shape = problem.shape
    dims = Dims(2, shape.hidden, shape.intermediate, shape.experts, shape.top_k)
    assert_pdl_chain_bitwise(cupy, problem, wdc.FAMILY.build, dims,
                             lambda launch: launch.workspace.view(cupy.uint16).fill(0x7FC0), **params)
