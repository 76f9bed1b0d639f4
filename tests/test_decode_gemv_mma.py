"""The decode GEMV on tensor cores (kernels/decode/gemv_mma.py): offline compile at qwen3-30b's shapes, the CUDA C
emulated on the CPU (mma.sync through tests.warp_checks.EMULATED_MMA, part of BLOCK_EMULATION) against the lane-chain
twin within the FP32 summation's tolerance, the path selection, and GPU tests (H200)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kernels.arrays import BF16
from kernels.compile import offline_report
from kernels.contract import Dims
from kernels.decode.gemv import GemvCall, select_path
from kernels.decode.gemv_mma import FP8_SOURCE, GEMV_MMA, SOURCE, resolve_call, row_groups, shared_bytes
from kernels.numerics import bf16_to_f32
from tests.test_decode_gemv import HARNESS as FMA_HARNESS
from tests.test_decode_gemv import (
    QWEN3_30B,
    _argmax,
    _bits,
    _chain,
    _device,
    _inputs,
    _poisoned,
    _prologue,
)
from tests.warp_checks import build_emulator, run_emulator

MODES = {"store": {}, "residual": {"EPILOGUE": 1}, "norm": {"NORM": 1}, "add-norm": {"NORM": 1, "ADD": 1},
         "argmax": {"NORM": 1, "EPILOGUE": 2}, "argmax-logits": {"NORM": 1, "ADD": 1, "EPILOGUE": 3}}


def _call(tokens: int, k: int, n: int, modes: dict[str, int], fp8: int = 0) -> GemvCall:
    return GemvCall(tokens, k, n, {"FP8": fp8, "NORM": 0, "ADD": 0, "EPILOGUE": 0, **modes})


# ---------------------------------------------------------------------------------------------------
# Offline compile (NVRTC for sm_90, no GPU)
# ---------------------------------------------------------------------------------------------------
QUICK = {(0, "qkv", 64, "add-norm"), (0, "lm_head", 64, "argmax-logits"), (1, "qkv", 64, "add-norm"),
         (1, "o", 64, "residual")}


@pytest.mark.parametrize(("fp8", "shape", "tokens", "mode"), [
    pytest.param(fp8, shape, tokens, mode, id=f"{'fp8' if fp8 else 'bf16'}-{shape}-t{tokens}-{mode}",
                 marks=() if (fp8, shape, tokens, mode) in QUICK else pytest.mark.slow)
    for fp8 in (0, 1) for shape in (("qkv", "o") if fp8 else QWEN3_30B) for tokens in (16, 32, 64)
    for mode in MODES])
def test_compiles_without_spills(fp8: int, shape: str, tokens: int, mode: str) -> None:
    """Each format's compile (fp8-block128: the batched fp8 loader's 16-value loads and byte permutes) at qwen3-30b's
    shapes: no spills, no stack, shared memory within the SM's."""
    n, k = QWEN3_30B[shape]
    params = resolve_call(_call(tokens, k, n, MODES[mode], fp8), {})
    if fp8:
        assert (params["FP8_LOAD16"], params["FP8_PRMT"]) == (1, 1)
    (report,) = offline_report(FP8_SOURCE if fp8 else SOURCE, **params)
    assert report.kernel == "decode_gemv_mma"
    assert report.spills == 0 and report.stack_bytes == 0, report
    assert shared_bytes(params, params["NT"]) + report.shared_bytes <= 227 * 1024


def test_rules_and_selection() -> None:
    qkv, o, lm = (Dims(64, k, n, 1, 1) for n, k in QWEN3_30B.values())
    assert (GEMV_MMA.resolve(qkv)["KSPLIT"], GEMV_MMA.resolve(o)["KSPLIT"], GEMV_MMA.resolve(lm)["KSPLIT"]) == (4, 8, 1)
    assert GEMV_MMA.resolve(qkv)["UNROLL"] == 2 and GEMV_MMA.resolve(Dims(16, 2048, 5120, 1, 1))["UNROLL"] == 4
    with pytest.raises(ValueError, match="KSPLIT"):
        GEMV_MMA.resolve(WARPS=6, KSPLIT=4)
    assert row_groups(37, GEMV_MMA.resolve(WARPS=4, KSPLIT=2)) == 2
    bf16, fp8 = _call(13, 64, 40, {}), GemvCall(13, 64, 40, {"FP8": 1, "NORM": 0, "ADD": 0, "EPILOGUE": 0})
    assert select_path(bf16, 0, {}) == "mma" and select_path(_call(8, 64, 40, {}), 0, {}) == "fma"
    assert select_path(bf16, -1, {}) == "fma" and select_path(_call(1, 64, 40, {}), 1, {}) == "mma"
    assert select_path(fp8, 0, {}) == "mma" and select_path(bf16, 0, {"TOKENS": 8}) == "fma"
    for bad, match in [((fp8, 1, {"MAX_REGS": 96}), "MAX_REGS"), ((bf16, 1, {"ROWS": 2}), "ROWS"),
                       ((bf16, 2, {}), "MMA"), ((bf16, True, {}), "MMA")]:
        with pytest.raises(ValueError, match=match):
            select_path(*bad)


# ---------------------------------------------------------------------------------------------------
# CPU: the CUDA C emulated (the FMA kernel's harness, this kernel and the emulated mma)
# ---------------------------------------------------------------------------------------------------
HARNESS = (FMA_HARNESS
           .replace("#define GEMV_DYNAMIC_SMEM uint4* gemv_smem = g_smem.data()\n",
                    "#define GEMV_MMA_SMEM uint4* mma_smem = g_smem.data()\n")  # the mma: BLOCK_EMULATION's
           .replace("g_smem.assign((size_t)TOKENS * K / 8,", "g_smem.assign((size_t)atoi(argv[7]),")
           .replace("decode_gemv(reinterpret_cast", "decode_gemv_mma(reinterpret_cast")
           .replace("w.data(), scales.data(),", "reinterpret_cast<const weight_t*>(w.data()), scales.data(),"))


def _emulate(inputs: dict[str, np.ndarray], modes: dict[str, int], tmp_path: Any, **knobs: int) -> dict[str, Any]:
    x, w = inputs["x"], inputs["w"]
    tokens, k = x.shape
    n = w.shape[0]
    params = resolve_call(_call(tokens, k, n, modes), knobs)
    binary = build_emulator(SOURCE.render(**params), HARNESS, "-DFP8=0")
    for name in ("x", "add", "norm", "residual_in", "w"):
        inputs[name].view(np.uint16).tofile(tmp_path / f"{name}.bin")
    np.ones((-(-n // 128)) * (-(-k // 128)), np.float32).tofile(tmp_path / "scales.bin")
    groups = row_groups(n, params)
    grid = min(groups, params["ARGMAX_BLOCKS"]) if modes.get("EPILOGUE", 0) >= 2 else groups
    run_emulator(binary, tokens, n, k, repr(float(np.float32(1e-6))), grid, tmp_path,
                 shared_bytes(params, params["NT"]) // 16)
    return {
        "out": np.fromfile(tmp_path / "out.bin", np.uint16).view(BF16).reshape(tokens, n),
        "residual_out": np.fromfile(tmp_path / "residual_out.bin", np.uint16).view(BF16).reshape(tokens, k),
        "logits": np.fromfile(tmp_path / "logits.bin", np.float32).reshape(tokens, n),
        "argmax": np.fromfile(tmp_path / "argmax.bin", np.int32),
    }


EXACT_PAST = 4_000_000  # outputs (T x N) past which expect_within_tolerance checks against the float64 product


def expect_within_tolerance(inputs: dict[str, np.ndarray], modes: dict[str, int], got: dict[str, Any]) -> None:
    """y within K 2^-23 sum |x w| of the lane-chain twin (dot_chain): the logits themselves; a bf16 output within
    that plus one bf16 rounding of the twin's value; the prologue's residual bitwise; every output written (the
    poison gone); argmax equal to the twin's where its top two logits are clear of the bound, and always the
    argmax of the kernel's own logits. Past EXACT_PAST outputs (the LM head at T >= 27) the twin's NumPy chain took
    ~100 s a test on one BLAS thread: there the float64 product stands in for it, with the bound 1.5x (the chain is
    within K 2^-24 sum |x w| of the exact dot)."""
    xn, summed = _prologue(inputs["x"], inputs["add"] if modes.get("ADD") else None,
                           inputs["norm"] if modes.get("NORM") else None, 1e-6)
    x64, w64 = bf16_to_f32(xn).astype(np.float64), bf16_to_f32(inputs["w"]).astype(np.float64)
    k = xn.shape[1]
    bound = (np.abs(x64) @ np.abs(w64).T) * k * 2.0**-23
    if xn.shape[0] * w64.shape[0] > EXACT_PAST:
        twin, bound = x64 @ w64.T, 1.5 * bound
    else:
        twin = _chain(xn, inputs["w"]).astype(np.float64)
    if summed is not None:
        np.testing.assert_array_equal(_bits(got["residual_out"]), _bits(summed))
    epilogue = modes.get("EPILOGUE", 0)
    if epilogue >= 2:
        if epilogue == 3:
            assert np.isfinite(got["logits"]).all()
            assert (np.abs(got["logits"] - twin) <= bound).all()
            np.testing.assert_array_equal(got["argmax"], _argmax(got["logits"]))
        top = np.sort(twin, axis=1)
        clear = top[:, -1] - top[:, -2] > 2 * bound.max(axis=1)
        np.testing.assert_array_equal(got["argmax"][clear], np.argmax(twin, axis=1)[clear])
        assert ((got["argmax"] >= 0) & (got["argmax"] < twin.shape[1])).all()
        return
    if epilogue == 1:
        twin = bf16_to_f32(inputs["residual_in"]).astype(np.float64) + twin
    out = bf16_to_f32(got["out"]).astype(np.float64)
    assert np.isfinite(out).all()
    assert (np.abs(out - twin) <= bound + np.abs(twin) * 2.0**-8).all()


EMULATED = [  # (tokens, n, k, mode, knobs): N % 16 != 0, K % 8 == 0 but not of 32 / 64
    pytest.param(9, 37, 136, "add-norm", {"WARPS": 4, "KSPLIT": 2, "UNROLL": 1}, id="t9-add-norm-ksplit2"),
    pytest.param(13, 53, 200, "argmax-logits", {"WARPS": 2, "KSPLIT": 1, "UNROLL": 2, "ARGMAX_BLOCKS": 2},
                 id="t13-argmax-logits-strided"),
    pytest.param(24, 37, 264, "residual", {"WARPS": 4, "KSPLIT": 4, "UNROLL": 1}, id="t24-residual-ksplit4",
                 marks=pytest.mark.slow),
    pytest.param(13, 41, 72, "store", {"WARPS": 2, "KSPLIT": 2, "UNROLL": 2, "PDL": 1}, id="t13-store-pdl",
                 marks=pytest.mark.slow),
    pytest.param(24, 70, 136, "argmax", {"WARPS": 4, "KSPLIT": 2, "UNROLL": 1, "ARGMAX_BLOCKS": 2},
                 id="t24-argmax", marks=pytest.mark.slow),
    pytest.param(9, 37, 136, "norm", {}, id="t9-norm-defaults", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("tokens", "n", "k", "mode", "knobs"), EMULATED)
def test_emulated_within_tolerance(rng: np.random.Generator, tmp_path: Any, tokens: int, n: int, k: int, mode: str,
                                   knobs: dict[str, int]) -> None:
    inputs = _inputs(rng, tokens, n, k)
    got = _emulate(inputs, MODES[mode], tmp_path, **knobs)
    expect_within_tolerance(inputs, MODES[mode], got)


@pytest.mark.slow
def test_emulated_argmax_ties_and_nan(tmp_path: Any) -> None:
    """Equal leading rows (5, 17, 30: the same y bitwise, whatever the order) give the lowest; a NaN in a token's x
    gives NaN logits and argmax -1."""
    rng = np.random.default_rng(3)
    inputs = _inputs(rng, 11, 37, 72)
    inputs["w"][[5, 17, 30]] = (inputs["x"][0].astype(np.float32) * 0.25).astype(BF16)
    inputs["x"][2, 7] = np.nan
    got = _emulate(inputs, {"EPILOGUE": 3}, tmp_path, WARPS=2, KSPLIT=1, UNROLL=1, ARGMAX_BLOCKS=2)
    assert got["argmax"][0] == 5 and got["argmax"][2] == -1
    assert np.isnan(got["logits"][2]).all()
    keep = np.arange(11) != 2
    np.testing.assert_array_equal(got["argmax"][keep], _argmax(got["logits"])[keep])


# ---------------------------------------------------------------------------------------------------
# GPU (H200)
# ---------------------------------------------------------------------------------------------------
def _run(cupy: Any, d: dict[str, Any], mode: str, workspace: Any = None, **knobs: int) -> dict[str, np.ndarray]:
    """One launch of ``mode`` over poisoned outputs (``d["w"]`` bf16 or an fp8 Quantized on the device); the outputs
    on the host."""
    from kernels.decode.gemv import dense_gemv

    tokens, k = d["x"].shape
    n = (d["w"].values if hasattr(d["w"], "values") else d["w"]).shape[0]
    modes, kw, outs = MODES[mode], dict(knobs), {}
    if modes.get("NORM"):
        kw["norm"] = d["norm"]
    if modes.get("ADD"):
        kw["add"] = d["add"]
        kw["residual_out"] = outs["residual_out"] = _poisoned(cupy, (tokens, k), BF16)
    if modes.get("EPILOGUE", 0) >= 2:
        kw["argmax"] = outs["argmax"] = _poisoned(cupy, (tokens,), np.int32)
        kw["workspace"] = workspace
        if modes["EPILOGUE"] == 3:
            kw["logits"] = outs["logits"] = _poisoned(cupy, (tokens, n), np.float32)
        dense_gemv(d["x"], d["w"], None, **kw)
    else:
        out = outs["out"] = _poisoned(cupy, (tokens, n), BF16)
        if modes.get("EPILOGUE") == 1:
            out[...] = d["residual_in"]
            kw["residual_in"] = out
        dense_gemv(d["x"], d["w"], out, **kw)
    cupy.cuda.runtime.deviceSynchronize()
    return {name: cupy.asnumpy(arr) for name, arr in outs.items()}


@pytest.mark.gpu
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("tokens", [9, 16, 33, 64])
@pytest.mark.parametrize("shape", list(QWEN3_30B))
def test_gpu_within_tolerance_and_repeats(cupy_mod: Any, rng: np.random.Generator, shape: str,
                                          tokens: int, mode: str) -> None:
    cupy = cupy_mod
    n, k = QWEN3_30B[shape]
    inputs = _inputs(rng, tokens, n, k)
    d = _device(cupy, inputs)
    first = _run(cupy, d, mode)
    expect_within_tolerance(inputs, MODES[mode], first)
    again = _run(cupy, d, mode, MMA=1)
    for name, value in first.items():
        assert np.array_equal(value.view(np.uint8), again[name].view(np.uint8)), name


@pytest.mark.gpu
@pytest.mark.parametrize("knobs", [{"WARPS": 4, "KSPLIT": 1, "UNROLL": 1}, {"WARPS": 8, "KSPLIT": 8, "UNROLL": 4},
                                   {"WARPS": 16, "KSPLIT": 2, "PDL": 1}], ids=["w4-k1-u1", "w8-k8-u4", "w16-k2-pdl"])
@pytest.mark.parametrize("mode", ["add-norm", "residual", "argmax-logits"])
def test_gpu_knobs_odd_shape(cupy_mod: Any, rng: np.random.Generator, mode: str,
                             knobs: dict[str, int]) -> None:
    cupy, tokens = cupy_mod, 13
    n, k = 3000, 4104
    inputs = _inputs(rng, tokens, n, k)
    expect_within_tolerance(inputs, MODES[mode], _run(cupy, _device(cupy, inputs), mode, MMA=1, **knobs))


@pytest.mark.gpu
def test_gpu_fma_path_kept(cupy_mod: Any, rng: np.random.Generator) -> None:
    """MMA=-1 at T = 16 is the FMA kernel: bitwise the lane chain."""
    cupy = cupy_mod
    inputs = _inputs(rng, 16, 512, 1024)
    got = _run(cupy, _device(cupy, inputs), "store", MMA=-1)
    np.testing.assert_array_equal(_bits(got["out"]), _bits(_chain(inputs["x"], inputs["w"]).astype(BF16)))


@pytest.mark.gpu
def test_gpu_graph_capture_and_pdl_chain(cupy_mod: Any, rng: np.random.Generator) -> None:
    """QKV-like add + norm then an O-like residual GEMV reading its output, PDL=1, captured and replayed on new
    contents: bitwise the eager PDL=0 launches every replay."""
    from kernels.decode.gemv import gemv_launch

    cupy, tokens = cupy_mod, 32
    n1, k1 = QWEN3_30B["o"][1], QWEN3_30B["qkv"][1]
    inputs = _inputs(rng, tokens, n1, k1)
    w2 = (rng.standard_normal((k1, n1)) * n1**-0.5).astype(BF16)
    d = _device(cupy, inputs)
    w2_d = cupy.asarray(w2)
    mid, summed = _poisoned(cupy, (tokens, n1), BF16), _poisoned(cupy, (tokens, k1), BF16)
    out = cupy.asarray(inputs["x"])

    def launches(pdl: int) -> list[Any]:
        return [gemv_launch(d["x"], d["w"], mid, norm=d["norm"], add=d["add"], residual_out=summed, PDL=pdl),
                gemv_launch(mid, w2_d, out, residual_in=out, PDL=pdl)]

    eager = launches(0)
    for launch in eager:
        launch()
    cupy.cuda.runtime.deviceSynchronize()
    want = cupy.asnumpy(out).view(np.uint16).copy()
    expect_within_tolerance({**inputs}, MODES["add-norm"], {"out": cupy.asnumpy(mid),
                                                            "residual_out": cupy.asnumpy(summed)})
    replays_bitwise(cupy, launches(1), [mid, summed], out, inputs["x"], want)


def replays_bitwise(cupy: Any, graph_launches: list[Any], poisoned: list[Any], out: Any, initial: np.ndarray,
                    want: np.ndarray) -> None:
    """``graph_launches`` captured in one CUDA graph and replayed 3 times, ``poisoned`` refilled with NaN and ``out``
    reset to ``initial`` before each: ``out``'s bits equal ``want`` every time."""
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        for launch in graph_launches:
            launch()
        graph = stream.end_capture()
        for _ in range(3):
            for arr in poisoned:
                arr.view(cupy.uint16).fill(0x7FC0)
            out.set(initial)
            graph.launch(stream)
            stream.synchronize()
            assert np.array_equal(cupy.asnumpy(out).view(np.uint16), want)
