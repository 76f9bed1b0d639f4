"""The decode GEMV (kernels/decode/gemv.py): offline compile, the CUDA C emulated on the CPU bit for bit against the
NumPy twins of the order contract (kernels.numerics: dot_chain, rms_norm_chain), fp8 against fp64, the input
checks, and GPU tests (H200)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kernels.arrays import BF16
from kernels.compile import offline_report
from kernels.contract import Dims
from kernels.decode.gemv import (
    GEMV,
    MAX_ARGMAX_BLOCKS,
    SOURCE,
    GemvWorkspace,
    check_gemv_inputs,
    dense_gemv,
    gemv_launch,
    make_gemv_workspace,
    quantize_matrix,
    row_groups,
    with_modes,
)
from kernels.formats import dequantize_blocks
from kernels.numerics import bf16_to_f32, dot_chain, rms_norm_chain
from tests.warp_checks import (
    BLOCK_EMULATION,
    EMULATION_LOAD,
    EMULATION_PRELUDE,
    FakeCupyArray,
    build_emulator,
    run_emulator,
)

QWEN3_30B = {"qkv": (5120, 2048), "o": (2048, 4096), "lm_head": (151936, 2048)}  # (N, K)


# ---------------------------------------------------------------------------------------------------
# NumPy twins
# ---------------------------------------------------------------------------------------------------
def _prologue(x: np.ndarray, add: np.ndarray | None, norm: np.ndarray | None, eps: float) -> tuple[np.ndarray, ...]:
    """(the row the GEMV multiplies, the summed residual or None), bf16."""
    summed = None
    if add is not None:
        summed = (bf16_to_f32(x) + bf16_to_f32(add)).astype(BF16)
        x = summed
    return (rms_norm_chain(x, norm, eps) if norm is not None else x), summed


def _chain(xn: np.ndarray, w: np.ndarray, rows: int = 2048) -> np.ndarray:
    """dot_chain of every token with every weight row: y [T, N] float32 (rows at a time: bounded memory)."""
    return np.concatenate([dot_chain(xn[:, None, :], w[None, n0:n0 + rows]) for n0 in range(0, len(w), rows)],
                          axis=1)


def _argmax(y: np.ndarray) -> np.ndarray:
    """Greater value, ties to the lower row, NaN never wins (-1 if every value is NaN)."""
    clean = np.where(np.isnan(y), -np.inf, y)
    ids = np.argmax(clean, axis=1).astype(np.int32)
    return np.where(np.isnan(y).all(axis=1), -1, ids).astype(np.int32)


def _fp8_bound(xn: np.ndarray, deq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(fp64 y of the dequantized weights, the FP32 summation's error bound ~ K * 2^-24 * sum |x w|)."""
    x64 = bf16_to_f32(xn).astype(np.float64)
    d64 = deq.astype(np.float64)
    return x64 @ d64.T, (np.abs(x64) @ np.abs(d64).T) * (deq.shape[1] * 2.0**-24)


def _inputs(rng: np.random.Generator, tokens: int, n: int, k: int) -> dict[str, np.ndarray]:
    return {
        "x": rng.standard_normal((tokens, k)).astype(BF16),
        "add": rng.standard_normal((tokens, k)).astype(BF16),
        "norm": (1.0 + 0.05 * rng.standard_normal(k)).astype(BF16),
        "w": (rng.standard_normal((n, k)) * k**-0.5).astype(BF16),
        "residual_in": rng.standard_normal((tokens, n)).astype(BF16),
    }


# ---------------------------------------------------------------------------------------------------
# Offline compile (NVRTC for sm_90, no GPU)
# ---------------------------------------------------------------------------------------------------
MODE_SETS = {
    "store": {}, "residual": {"EPILOGUE": 1}, "norm": {"NORM": 1}, "add-norm": {"NORM": 1, "ADD": 1},
    "add": {"ADD": 1}, "argmax": {"NORM": 1, "EPILOGUE": 2}, "argmax-logits": {"NORM": 1, "EPILOGUE": 3},
}
KNOB_SETS = {"defaults-t1": {"TOKENS": 1}, "defaults-t4": {"TOKENS": 4}, "defaults-t8": {},
             "w8-r2-u4-pdl": {"WARPS": 8, "ROWS": 2, "UNROLL": 4, "PDL": 1, "TOKENS": 4},
             "w8-r4-u4-t1": {"WARPS": 8, "ROWS": 4, "UNROLL": 4, "TOKENS": 1}}


QUICK_COMPILES = {("defaults-t8", "add-norm", 1)}  # the case that needs MAX_REGS; every mode at T = 1 is quick too


@pytest.mark.parametrize(("knobs", "mode", "fp8"), [
    pytest.param(knobs, mode, fp8, id=f"{knobs}-{mode}-{'fp8' if fp8 else 'bf16'}",
                 marks=() if knobs == "defaults-t1" or (knobs, mode, fp8) in QUICK_COMPILES else pytest.mark.slow)
    for knobs in KNOB_SETS for mode in MODE_SETS for fp8 in (0, 1)])
def test_compiles_without_spills(knobs: str, mode: str, fp8: int) -> None:
    params = with_modes(GEMV.resolve(**KNOB_SETS[knobs]), {**MODE_SETS[mode], "FP8": fp8})
    (report,) = offline_report(SOURCE, **params)
    assert report.kernel == "decode_gemv"
    assert report.spills == 0 and report.stack_bytes == 0, report


def test_rules() -> None:
    assert GEMV.resolve()["TOKENS"] == 8

    assert GEMV.resolve(Dims(3, 64, 16, 1, 1))["TOKENS"] == 3
    assert GEMV.resolve(Dims(64, 64, 16, 1, 1))["TOKENS"] == 8
    assert GEMV.resolve(Dims(64, 64, 16, 1, 1), TOKENS=16)["TOKENS"] == 16
    with pytest.raises(ValueError, match="UNROLL"):
        GEMV.resolve(WARPS=32, UNROLL=16, ROWS=4)
    with pytest.raises(ValueError, match="WARPS"):
        GEMV.resolve(WARPS=33)
    with pytest.raises(ValueError, match="TOKENS"):
        GEMV.resolve(TOKENS=17)
    with pytest.raises(ValueError, match="PDL"):
        GEMV.resolve(PDL=2)
    with pytest.raises(ValueError, match="FP8"):  # a mode, not a knob
        GEMV.resolve(FP8=1)
    assert row_groups(37, GEMV.resolve(WARPS=2, ROWS=3)) == 7


def test_source_is_registered_for_the_compile_report() -> None:
    import subprocess
    import sys

    code = "from tools.compile_report import load_sources; print('decode_gemv' in load_sources())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "True", done.stderr[-2000:]


# ---------------------------------------------------------------------------------------------------
# CPU: the CUDA C emulated (g++; a block's threads as lanes, blocks one after another in a chosen order)
# ---------------------------------------------------------------------------------------------------
HARNESS = EMULATION_PRELUDE + BLOCK_EMULATION + r"""
std::vector<uint4> g_smem;
#define GEMV_DYNAMIC_SMEM uint4* gemv_smem = g_smem.data()
#include "kernel.cu"
""" + EMULATION_LOAD + r"""
template <class T> void save(const std::string& path, const std::vector<T>& v) {
    FILE* f = fopen(path.c_str(), "wb"); fwrite(v.data(), sizeof(T), v.size(), f); fclose(f);
}
int main(int argc, char** argv) {
    const int T = atoi(argv[1]), N = atoi(argv[2]), K = atoi(argv[3]), grid = atoi(argv[5]);
    const float eps = (float)atof(argv[4]);
    const std::string dir = argv[6];
    auto x = load<uint16_t>(dir + "/x.bin", (size_t)T * K);
    auto add = load<uint16_t>(dir + "/add.bin", (size_t)T * K);
    auto norm = load<uint16_t>(dir + "/norm.bin", (size_t)K);
    auto residual_in = load<uint16_t>(dir + "/residual_in.bin", (size_t)T * N);
    const size_t wbytes = FP8 ? (size_t)N * K : (size_t)N * K * 2;
    auto w = load<uint4>(dir + "/w.bin", wbytes / 16);
    const size_t nscales = (size_t)((N + 127) / 128) * ((K + 127) / 128);
    auto scales = load<float>(dir + "/scales.bin", nscales);
    std::vector<uint16_t> out((size_t)T * N), residual_out((size_t)T * K), first_out;
    std::vector<float> logits((size_t)T * N), best_values((size_t)T * grid), first_logits;
    std::vector<int> best_rows((size_t)T * grid), argmax((size_t)T), first_argmax;
    unsigned ticket = 0;
    g_smem.assign((size_t)TOKENS * K / 8, make_uint4(0x7fc07fc0u, 0x7fc07fc0u, 0x7fc07fc0u, 0x7fc07fc0u));
    const int threads = WARPS * 32;
    EmuBarrier block_bar(threads);
    g_block = &block_bar;
    std::vector<std::unique_ptr<WarpCtx>> warps;
    for (int i = 0; i < WARPS; ++i) warps.emplace_back(new WarpCtx);
    gridDim.x = grid;
    // two launches over poisoned outputs, blocks in order then in reverse (another block takes the last ticket)
    for (int launch = 0; launch < 2; ++launch) {
        std::fill(out.begin(), out.end(), (uint16_t)0x7fc0);
        std::fill(residual_out.begin(), residual_out.end(), (uint16_t)0x7fc0);
        std::fill(logits.begin(), logits.end(), __uint_as_float(0x7fc00000u));
        std::fill(argmax.begin(), argmax.end(), -12345);
        if (EPILOGUE == 1) out = residual_in;                     // out aliases residual_in
        for (int i = 0; i < grid; ++i) {
            const int b = launch == 0 ? i : grid - 1 - i;
            run_lanes(threads, [&](int l) {
                g_warp = warps[l / 32].get();
                threadIdx.x = l;
                blockIdx.x = (unsigned)b;
                decode_gemv(reinterpret_cast<const bf16_t*>(x.data()), reinterpret_cast<const bf16_t*>(add.data()),
                            reinterpret_cast<const bf16_t*>(norm.data()), w.data(), scales.data(),
                            reinterpret_cast<bf16_t*>(out.data()), reinterpret_cast<const bf16_t*>(out.data()),
                            reinterpret_cast<bf16_t*>(residual_out.data()), logits.data(), best_values.data(),
                            best_rows.data(), &ticket, argmax.data(), T, N, K, eps);
            });
        }
        if (ticket != 0u) { fprintf(stderr, "the ticket was left at %u\n", ticket); return 3; }
        if (launch == 0) { first_out = out; first_logits = logits; first_argmax = argmax; }
    }
    if (out != first_out || argmax != first_argmax ||
        memcmp(logits.data(), first_logits.data(), 4 * logits.size()) != 0) {
        fprintf(stderr, "the second launch differs from the first\n");
        return 4;
    }
    save(dir + "/out.bin", out);
    save(dir + "/residual_out.bin", residual_out);
    save(dir + "/logits.bin", logits);
    save(dir + "/argmax.bin", argmax);
    return 0;
}
"""


def _emulate(inputs: dict[str, np.ndarray], modes: dict[str, int], tmp_path: Any, eps: float = 1e-6,
             **knobs: int) -> dict[str, np.ndarray]:
    x, w = inputs["x"], inputs["w"]
    tokens, k = x.shape
    n = w.shape[0]
    params = with_modes(GEMV.resolve(Dims(tokens, k, n, 1, 1), **knobs), modes, knobs)
    binary = build_emulator(SOURCE.render(**params), HARNESS)
    for name in ("x", "add", "norm", "residual_in"):
        inputs[name].view(np.uint16).tofile(tmp_path / f"{name}.bin")
    if modes.get("FP8"):
        q = quantize_matrix(bf16_to_f32(w))
        q.values.view(np.uint8).tofile(tmp_path / "w.bin")
        q.scales.astype(np.float32).tofile(tmp_path / "scales.bin")
    else:
        w.view(np.uint16).tofile(tmp_path / "w.bin")
        np.ones((-(-n // 128)) * (-(-k // 128)), np.float32).tofile(tmp_path / "scales.bin")
    groups = row_groups(n, params)
    grid = min(groups, params["ARGMAX_BLOCKS"]) if modes.get("EPILOGUE", 0) >= 2 else groups
    run_emulator(binary, tokens, n, k, repr(float(np.float32(eps))), grid, tmp_path)
    return {
        "out": np.fromfile(tmp_path / "out.bin", np.uint16).view(BF16).reshape(tokens, n),
        "residual_out": np.fromfile(tmp_path / "residual_out.bin", np.uint16).view(BF16).reshape(tokens, k),
        "logits": np.fromfile(tmp_path / "logits.bin", np.float32).reshape(tokens, n),
        "argmax": np.fromfile(tmp_path / "argmax.bin", np.int32),
    }


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint16 if a.dtype == BF16 else np.uint32)


def _expect_bf16(inputs: dict[str, np.ndarray], modes: dict[str, int], got: dict[str, np.ndarray],
                 eps: float = 1e-6) -> None:
    """The emulated kernel's outputs equal the NumPy twins bit for bit."""
    xn, summed = _prologue(inputs["x"], inputs["add"] if modes.get("ADD") else None,
                           inputs["norm"] if modes.get("NORM") else None, eps)
    y = _chain(xn, inputs["w"])
    epilogue = modes.get("EPILOGUE", 0)
    if summed is not None:
        np.testing.assert_array_equal(_bits(got["residual_out"]), _bits(summed))
    if epilogue == 0:
        np.testing.assert_array_equal(_bits(got["out"]), _bits(y.astype(BF16)))
    elif epilogue == 1:
        want = (bf16_to_f32(inputs["residual_in"]) + y).astype(BF16)
        np.testing.assert_array_equal(_bits(got["out"]), _bits(want))
    else:
        np.testing.assert_array_equal(got["argmax"], _argmax(y))
        if epilogue == 3:
            np.testing.assert_array_equal(_bits(got["logits"]), _bits(y))
        else:
            assert np.isnan(got["logits"]).all()  # not written


EMULATED = [  # (tokens, n, k, modes, knobs)
    (3, 37, 264, {}, {"WARPS": 2, "ROWS": 3, "UNROLL": 1}),                          # K % 256 != 0, N % 6 != 0
    (1, 37, 264, {"NORM": 1}, {}),                                                   # T = 1, the defaults
    (7, 37, 264, {"NORM": 1, "ADD": 1, "EPILOGUE": 1}, {"ROWS": 2, "UNROLL": 2, "TOKENS": 4}),  # two passes
    (3, 37, 72, {"ADD": 1}, {"WARPS": 2, "UNROLL": 1, "PDL": 1}),
    (7, 37, 264, {"NORM": 1, "EPILOGUE": 3}, {"WARPS": 2, "ROWS": 2, "UNROLL": 1, "TOKENS": 3, "ARGMAX_BLOCKS": 4}),
    (3, 41, 136, {"EPILOGUE": 2}, {"WARPS": 4, "ROWS": 1, "UNROLL": 2}),
]


@pytest.mark.parametrize(("tokens", "n", "k", "modes", "knobs"), EMULATED,
                         ids=["store-t3", "norm-t1-defaults", "add-norm-residual-t7", "add-t3-pdl",
                              "argmax-logits-t7", "argmax-t3"])
def test_emulated_bitwise(rng: np.random.Generator, tmp_path: Any, tokens: int, n: int, k: int,
                          modes: dict[str, int], knobs: dict[str, int]) -> None:
    inputs = _inputs(rng, tokens, n, k)
    got = _emulate(inputs, modes, tmp_path, **knobs)
    _expect_bf16(inputs, modes, got)


def test_emulated_argmax_ties_and_nan(tmp_path: Any) -> None:
    """Rows 5, 17 and 30 are equal and lead (the same y, bitwise): argmax is 5 whichever block finishes last; a token
    with a NaN in x has NaN logits everywhere and argmax -1."""
    rng = np.random.default_rng(3)
    inputs = _inputs(rng, 3, 37, 72)
    inputs["w"][[5, 17, 30]] = (inputs["x"][0].astype(np.float32) * 0.25).astype(BF16)
    inputs["x"][2, 7] = np.nan
    got = _emulate(inputs, {"EPILOGUE": 3}, tmp_path, WARPS=2, ROWS=2, UNROLL=1, ARGMAX_BLOCKS=3)
    assert got["argmax"][0] == 5 and got["argmax"][2] == -1
    assert np.isnan(got["logits"][2]).all()
    _expect_bf16(inputs, {"EPILOGUE": 3}, got)


@pytest.mark.parametrize(("tokens", "modes", "knobs"), [
    (1, {"FP8": 1}, {}),
    (3, {"FP8": 1, "NORM": 1, "EPILOGUE": 3}, {"WARPS": 2, "ROWS": 2, "UNROLL": 1, "ARGMAX_BLOCKS": 2}),
    (7, {"FP8": 1, "NORM": 1, "ADD": 1, "EPILOGUE": 1}, {"TOKENS": 3, "UNROLL": 2}),
], ids=["store-t1", "norm-argmax-logits-t3", "add-norm-residual-t7"])
def test_emulated_fp8_within_tolerance(rng: np.random.Generator, tmp_path: Any, tokens: int, modes: dict[str, int],
                                       knobs: dict[str, int]) -> None:
    """fp8-block128 weights (K = 272: a partial 128-column block, N = 150: a partial row block): y within the FP32
    summation's bound of fp64 over the dequantized weights; bf16 outputs within one bf16 rounding of it."""
    n, k = 150, 272
    inputs = _inputs(rng, tokens, n, k)
    inputs["w"][:, 130:] *= np.asarray(8.0, BF16)  # the two column blocks' scales differ
    got = _emulate(inputs, modes, tmp_path, **knobs)
    q = quantize_matrix(bf16_to_f32(inputs["w"]))
    deq = dequantize_blocks(q.values, q.scales)
    xn, summed = _prologue(inputs["x"], inputs["add"] if modes.get("ADD") else None,
                           inputs["norm"] if modes.get("NORM") else None, 1e-6)
    want, bound = _fp8_bound(xn, deq)
    if summed is not None:
        np.testing.assert_array_equal(_bits(got["residual_out"]), _bits(summed))
    if modes.get("EPILOGUE", 0) >= 2:
        assert (np.abs(got["logits"] - want) <= bound).all()
        clear = np.sort(want, axis=1)[:, -1] - np.sort(want, axis=1)[:, -2] > 2 * bound.max(axis=1)
        np.testing.assert_array_equal(got["argmax"][clear], np.argmax(want, axis=1)[clear])
        np.testing.assert_array_equal(got["argmax"], _argmax(got["logits"]))
        return
    if modes.get("EPILOGUE", 0) == 1:
        want = bf16_to_f32(inputs["residual_in"]).astype(np.float64) + want
    out = bf16_to_f32(got["out"]).astype(np.float64)
    assert (np.abs(out - want) <= bound + np.abs(want) * 2.0**-8 + 1e-30).all()


# ---------------------------------------------------------------------------------------------------
# Input checks (CPU: they run before any device call)
# ---------------------------------------------------------------------------------------------------
def _fakes(T: int = 3, N: int = 40, K: int = 64) -> dict[str, Any]:
    return {"x": FakeCupyArray((T, K), BF16), "w": FakeCupyArray((N, K), BF16), "out": FakeCupyArray((T, N), BF16)}


def _fake_fp8(N: int = 40, K: int = 64) -> Any:
    from kernels.formats import Quantized

    return Quantized(FakeCupyArray((N, K), np.uint8), FakeCupyArray((1, 1), np.float32))


def test_checks_accept_good_inputs() -> None:
    f = _fakes()
    call = check_gemv_inputs(f["x"], f["w"], f["out"])
    assert (call.tokens, call.k, call.n, call.modes) == (3, 64, 40, {"FP8": 0, "NORM": 0, "ADD": 0, "EPILOGUE": 0})
    call = check_gemv_inputs(f["x"], _fake_fp8(), None, norm=FakeCupyArray((64,), BF16),
                             add=FakeCupyArray((3, 64), BF16), residual_out=FakeCupyArray((3, 64), BF16),
                             argmax=FakeCupyArray((3,), np.int32), logits=FakeCupyArray((3, 40), np.float32))
    assert call.modes == {"FP8": 1, "NORM": 1, "ADD": 1, "EPILOGUE": 3}
    call = check_gemv_inputs(f["x"], f["w"], f["out"], residual_in=FakeCupyArray((3, 40), BF16))
    assert call.modes["EPILOGUE"] == 1


@pytest.mark.parametrize(("change", "error", "name"), [
    ({"x": np.zeros((3, 64), BF16)}, TypeError, "x must be a cupy"),
    ({"x": FakeCupyArray((3, 64), np.float32)}, TypeError, "x must have dtype bfloat16"),
    ({"x": FakeCupyArray((64,), BF16)}, ValueError, "x must be"),
    ({"x": FakeCupyArray((65, 64), BF16)}, ValueError, "T"),
    ({"x": FakeCupyArray((3, 60), BF16), "w": FakeCupyArray((40, 60), BF16)}, ValueError, "multiple of 8"),
    ({"w": FakeCupyArray((40, 72), BF16)}, ValueError, "w must be"),
    ({"w": FakeCupyArray((40, 64), np.float16)}, TypeError, "w must have dtype"),
    ({"w": np.zeros((40, 64), BF16)}, TypeError, "w must be a 2-D cupy"),
    ({"w": "fp8"}, TypeError, "w must be"),
    ({"out": FakeCupyArray((3, 41), BF16)}, ValueError, "out must be"),
    ({"out": FakeCupyArray((3, 40), np.float32)}, TypeError, "out must have dtype"),
    ({"out": None}, ValueError, "out"),
    ({"norm": FakeCupyArray((63,), BF16)}, ValueError, "norm"),
    ({"norm": FakeCupyArray((64,), np.float32)}, TypeError, "norm"),
    ({"add": FakeCupyArray((3, 64), BF16)}, ValueError, "residual_out"),
    ({"residual_out": FakeCupyArray((3, 64), BF16)}, ValueError, "residual_out"),
    ({"add": FakeCupyArray((2, 64), BF16), "residual_out": FakeCupyArray((3, 64), BF16)}, ValueError, "add"),
    ({"add": FakeCupyArray((3, 64), BF16), "residual_out": FakeCupyArray((3, 40), BF16)}, ValueError,
     "residual_out"),
    ({"residual_in": FakeCupyArray((3, 40), np.float32)}, TypeError, "residual_in"),
    ({"argmax": FakeCupyArray((3,), np.int32)}, ValueError, "either out"),
    ({"out": None, "argmax": FakeCupyArray((3,), np.int64)}, TypeError, "argmax"),
    ({"out": None, "argmax": FakeCupyArray((3,), np.int32), "logits": FakeCupyArray((3, 41), np.float32)},
     ValueError, "logits"),
    ({"logits": FakeCupyArray((3, 40), np.float32)}, ValueError, "logits"),
    ({"out": None, "argmax": FakeCupyArray((3,), np.int32), "residual_in": FakeCupyArray((3, 40), BF16)},
     ValueError, "residual_in"),
    ({"out": None, "argmax": FakeCupyArray((3,), np.int32), "workspace": 3}, TypeError, "workspace"),
    ({"workspace": GemvWorkspace(None, None, None)}, ValueError, "workspace"),
    ({"eps": "1e-6"}, TypeError, "eps"),
    ({"eps": -1.0}, ValueError, "eps"),
    ({"eps": True}, TypeError, "eps"),
    ({"WARPS": 0}, ValueError, "WARPS"),
    ({"FP8": 1}, ValueError, "FP8"),
    ({"WARPS": "4"}, TypeError, "WARPS"),
], ids=lambda v: None if isinstance(v, dict | type) else str(v)[:24])
def test_checks_refuse(change: dict[str, Any], error: type, name: str) -> None:
    args = {**_fakes(), **change}
    x, w, out = args.pop("x"), args.pop("w"), args.pop("out")
    with pytest.raises(error, match=name):
        dense_gemv(x, w, out, **args)


def test_checks_refuse_fp8_shapes() -> None:
    from kernels.formats import Quantized

    f = _fakes(K=136)
    f["w"] = Quantized(FakeCupyArray((40, 136), np.uint8), FakeCupyArray((1, 2), np.float32))
    with pytest.raises(ValueError, match="multiple of 16"):
        dense_gemv(f["x"], f["w"], f["out"])
    f = _fakes()
    with pytest.raises(ValueError, match="w.scales"):
        dense_gemv(f["x"], Quantized(FakeCupyArray((40, 64), np.uint8), FakeCupyArray((1, 2), np.float32)), f["out"])
    with pytest.raises(TypeError, match="w.values"):
        dense_gemv(f["x"], Quantized(FakeCupyArray((40, 64), np.int8), FakeCupyArray((1, 1), np.float32)), f["out"])
    with pytest.raises(ValueError, match="rows"):
        dense_gemv(f["x"], Quantized(FakeCupyArray((40, 64), np.uint8), FakeCupyArray((1, 1), np.float32), "t16"),
                   f["out"])


def test_checks_refuse_non_contiguous() -> None:
    f = _fakes()
    f["x"].flags = type("Flags", (), {"c_contiguous": False})()
    with pytest.raises(ValueError, match="x must be C-contiguous"):
        dense_gemv(f["x"], f["w"], f["out"])


# ---------------------------------------------------------------------------------------------------
# GPU (H200)
# ---------------------------------------------------------------------------------------------------


def _device(cupy: Any, inputs: dict[str, np.ndarray]) -> dict[str, Any]:
    return {name: cupy.asarray(value) for name, value in inputs.items()}


def _poisoned(cupy: Any, shape: tuple[int, ...], dtype: Any) -> Any:
    arr = cupy.empty(shape, dtype)
    if np.dtype(dtype) == BF16:
        arr.view(cupy.uint16).fill(0x7FC0)
    elif np.dtype(dtype) == np.int32:
        arr.fill(-12345)
    else:
        arr.fill(np.nan)
    return arr


def _run_gpu(cupy: Any, d: dict[str, Any], mode: str, fp8: bool, knobs: dict[str, int],
             workspace: Any = None) -> dict[str, Any]:
    """One launch of ``mode`` over poisoned outputs; returns the outputs (device)."""
    tokens, k = d["x"].shape
    n = d["w"].shape[0] if not fp8 else d["wq"].values.shape[0]
    w = d["wq"] if fp8 else d["w"]
    kw: dict[str, Any] = dict(knobs)
    outs: dict[str, Any] = {}
    if mode in ("norm", "add-norm", "argmax", "argmax-logits"):
        kw["norm"] = d["norm"]
    if mode == "add-norm":
        kw["add"] = d["add"]
        kw["residual_out"] = outs["residual_out"] = _poisoned(cupy, (tokens, k), BF16)
    if mode.startswith("argmax"):
        kw["argmax"] = outs["argmax"] = _poisoned(cupy, (tokens,), np.int32)
        kw["workspace"] = workspace
        if mode == "argmax-logits":
            kw["logits"] = outs["logits"] = _poisoned(cupy, (tokens, n), np.float32)
        dense_gemv(d["x"], w, None, **kw)
    else:
        out = outs["out"] = _poisoned(cupy, (tokens, n), BF16)
        if mode == "residual":
            out[...] = d["residual_in"]
            kw["residual_in"] = out  # in place
        dense_gemv(d["x"], w, out, **kw)
    cupy.cuda.runtime.deviceSynchronize()
    return {name: cupy.asnumpy(arr) for name, arr in outs.items()}


def _check_gpu_bf16(inputs: dict[str, np.ndarray], mode: str, got: dict[str, np.ndarray]) -> None:
    modes = {"store": {}, "residual": {"EPILOGUE": 1}, "norm": {"NORM": 1}, "add-norm": {"NORM": 1, "ADD": 1},
             "argmax": {"NORM": 1, "EPILOGUE": 2}, "argmax-logits": {"NORM": 1, "EPILOGUE": 3}}[mode]
    full = {"out": got.get("out"), "residual_out": got.get("residual_out"), "argmax": got.get("argmax"),
            "logits": got.get("logits", np.full((1,), np.nan, np.float32))}
    _expect_bf16(inputs, modes, full)


GPU_MODES = ["store", "residual", "norm", "add-norm", "argmax", "argmax-logits"]


@pytest.mark.gpu
@pytest.mark.parametrize("mode", GPU_MODES)
@pytest.mark.parametrize("tokens", [1, 4, 13])
@pytest.mark.parametrize("shape", ["qkv", "o"])
def test_gpu_bf16_bitwise_and_repeats(cupy_mod: Any, rng: np.random.Generator, shape: str, tokens: int,
                                      mode: str) -> None:
    cupy = cupy_mod
    n, k = QWEN3_30B[shape]
    inputs = _inputs(rng, tokens, n, k)
    d = _device(cupy, inputs)
    first = _run_gpu(cupy, d, mode, False, {"MMA": -1})  # T = 13: the FMA kernel, bitwise (auto: tensor cores)
    _check_gpu_bf16(inputs, mode, first)
    for _ in range(2):
        again = _run_gpu(cupy, d, mode, False, {"MMA": -1})
        for name, value in first.items():
            assert np.array_equal(_bits(value) if value.dtype != np.int32 else value,
                                  _bits(again[name]) if value.dtype != np.int32 else again[name])


@pytest.mark.gpu
@pytest.mark.parametrize("knobs", [{"WARPS": 8, "ROWS": 2, "UNROLL": 4}, {"WARPS": 2, "ROWS": 4, "UNROLL": 2},
                                   {"TOKENS": 3, "PDL": 1}, {"WARPS": 8, "ROWS": 4, "UNROLL": 4, "TOKENS": 16}],
                         ids=["w8-r2-u4", "w2-r4-u2", "t3-pdl", "w8-r4-u4-t16"])
@pytest.mark.parametrize("mode", ["add-norm", "residual", "argmax-logits"])
def test_gpu_knobs_keep_the_bits(cupy_mod: Any, rng: np.random.Generator, mode: str, knobs: dict[str, int]) -> None:
    cupy, tokens = cupy_mod, 7
    n, k = 3000, 4104  # N not a multiple of any block's rows, K not of 256
    inputs = _inputs(rng, tokens, n, k)
    _check_gpu_bf16(inputs, mode, _run_gpu(cupy, _device(cupy, inputs), mode, False, knobs))


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 4, 13])
def test_gpu_lm_head_argmax(cupy_mod: Any, rng: np.random.Generator, tokens: int) -> None:
    """qwen3-30b's LM head (N = 151936): argmax and logits bitwise, the workspace's ticket back at 0. T = 13: two
    passes of the FMA kernel's 8 tokens (T = 64's NumPy twin took ~100 s on one BLAS thread; at T >= 9 the step runs
    the tensor-core GEMV, whose LM head tests go to T = 64)."""
    cupy = cupy_mod
    n, k = QWEN3_30B["lm_head"]
    inputs = _inputs(rng, tokens, n, k)
    workspace = make_gemv_workspace(tokens)
    d = _device(cupy, inputs)
    got = _run_gpu(cupy, d, "argmax-logits", False, {"MMA": -1}, workspace)  # the FMA kernel at every T
    _check_gpu_bf16(inputs, "argmax-logits", got)
    assert not cupy.asnumpy(workspace.ticket).any()
    again = _run_gpu(cupy, d, "argmax", False, {"WARPS": 8, "ROWS": 4, "UNROLL": 4}, workspace)
    np.testing.assert_array_equal(again["argmax"], got["argmax"])


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["store", "add-norm", "residual", "argmax-logits"])
@pytest.mark.parametrize("tokens", [1, 4, 13])
def test_gpu_fp8_within_tolerance(cupy_mod: Any, rng: np.random.Generator, tokens: int, mode: str) -> None:
    cupy = cupy_mod
    n, k = 5120, 2048
    inputs = _inputs(rng, tokens, n, k)
    q = quantize_matrix(bf16_to_f32(inputs["w"]))
    d = _device(cupy, inputs)
    from kernels.formats import Quantized

    d["wq"] = Quantized(cupy.asarray(q.values.view(np.uint8)), cupy.asarray(q.scales))
    got = _run_gpu(cupy, d, mode, True, {"MMA": -1})  # T = 13: this kernel (auto: tensor cores, their own tests)
    deq = dequantize_blocks(q.values, q.scales)
    xn, summed = _prologue(inputs["x"], inputs["add"] if mode == "add-norm" else None,
                           inputs["norm"] if mode in ("add-norm", "argmax-logits") else None, 1e-6)
    want, bound = _fp8_bound(xn, deq)
    if summed is not None:
        np.testing.assert_array_equal(_bits(got["residual_out"]), _bits(summed))
    if mode == "argmax-logits":
        assert (np.abs(got["logits"] - want) <= bound).all()
        np.testing.assert_array_equal(got["argmax"], _argmax(got["logits"]))
        return
    if mode == "residual":
        want = bf16_to_f32(inputs["residual_in"]).astype(np.float64) + want
    out = bf16_to_f32(got["out"]).astype(np.float64)
    assert (np.abs(out - want) <= bound + np.abs(want) * 2.0**-8).all()


@pytest.mark.gpu
def test_gpu_graph_capture_replays_on_new_inputs(cupy_mod: Any, rng: np.random.Generator) -> None:
    """gemv_launch's callable captured (add + norm + residual out, then the argmax head), replayed on new contents."""
    cupy, tokens = cupy_mod, 4
    n, k = QWEN3_30B["qkv"]
    inputs = _inputs(rng, tokens, n, k)
    d = _device(cupy, inputs)
    out = _poisoned(cupy, (tokens, n), BF16)
    summed = _poisoned(cupy, (tokens, k), BF16)
    ids = _poisoned(cupy, (tokens,), np.int32)
    workspace = make_gemv_workspace(tokens)
    first = gemv_launch(d["x"], d["w"], out, norm=d["norm"], add=d["add"], residual_out=summed)
    second = gemv_launch(summed, d["w"], None, argmax=ids, workspace=workspace, PDL=1)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        first()
        second()
        graph = stream.end_capture()
        for _ in range(2):
            inputs = {**inputs, **_inputs(rng, tokens, n, k)}
            for name in ("x", "add", "norm", "w"):
                d[name].set(inputs[name])
            out.view(cupy.uint16).fill(0x7FC0)
            summed.view(cupy.uint16).fill(0x7FC0)
            ids.fill(-12345)
            graph.launch(stream)
            stream.synchronize()
            _expect_bf16(inputs, {"NORM": 1, "ADD": 1}, {"out": cupy.asnumpy(out),
                                                         "residual_out": cupy.asnumpy(summed)})
            want = _argmax(_chain(cupy.asnumpy(summed), inputs["w"]))
            np.testing.assert_array_equal(cupy.asnumpy(ids), want)
            assert not cupy.asnumpy(workspace.ticket).any()


@pytest.mark.gpu
def test_gpu_pdl_chain_of_two(cupy_mod: Any, rng: np.random.Generator) -> None:
    """Two PDL launches back to back, the second reading the first's output (x := out of the first): the wait keeps
    the second's reads behind the first's writes. Repeated with a big first kernel so the overlap is real."""
    cupy, tokens = cupy_mod, 4
    n1, k1 = 2048, 4096
    inputs = _inputs(rng, tokens, n1, k1)
    w2 = (rng.standard_normal((5120, n1)) * n1**-0.5).astype(BF16)
    d = _device(cupy, inputs)
    w2_d = cupy.asarray(w2)
    mid = _poisoned(cupy, (tokens, n1), BF16)
    out = _poisoned(cupy, (tokens, 5120), BF16)
    one = gemv_launch(d["x"], d["w"], mid, norm=d["norm"], PDL=1)
    two = gemv_launch(mid, w2_d, out, PDL=1)
    for _ in range(3):
        mid.view(cupy.uint16).fill(0x7FC0)
        out.view(cupy.uint16).fill(0x7FC0)
        one()
        two()
        cupy.cuda.runtime.deviceSynchronize()
        xn = rms_norm_chain(inputs["x"], inputs["norm"], 1e-6)
        want_mid = _chain(xn, inputs["w"]).astype(BF16)
        np.testing.assert_array_equal(_bits(cupy.asnumpy(mid)), _bits(want_mid))
        np.testing.assert_array_equal(_bits(cupy.asnumpy(out)), _bits(_chain(want_mid, w2).astype(BF16)))


def test_workspace_shape_constant() -> None:
    assert MAX_ARGMAX_BLOCKS >= GEMV.resolve()["ARGMAX_BLOCKS"]


def test_numpy_twins() -> None:
    """exp_rn within 3e-7 of exp on [-87, 88] (exact at 0, 0 below -87); dot_chain within FP32 rounding of fp64."""
    from kernels.numerics import exp_rn

    x = np.linspace(-87, 88, 20001).astype(np.float32)
    rel = np.abs(exp_rn(x) / np.exp(x.astype(np.float64)) - 1)
    assert rel.max() < 3e-7
    assert exp_rn(np.float32([0.0]))[0] == 1.0 and exp_rn(np.float32([-87.5]))[0] == 0.0
    rng = np.random.default_rng(5)
    a, b = rng.standard_normal((4, 1032)).astype(BF16), rng.standard_normal((4, 1032)).astype(BF16)
    exact = (a.astype(np.float64) * b.astype(np.float64)).sum(axis=1)
    assert np.allclose(dot_chain(a, b), exact, rtol=0, atol=1e-4)
