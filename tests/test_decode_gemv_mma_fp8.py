"""fp8-block128 weights on the decode GEMV's tensor cores (kernels/decode/gemv_mma.py, the batched families' fp8
loader in front of the kernel text): offline compile at qwen3-30b's shapes, the CUDA C emulated on the CPU at odd
shapes (partial 128 x 128 scale blocks) against fp64 over the dequantized weights, the path selection, and GPU tests
(H200).

The tolerance (:func:`fp8_mma_bound`), derived from what the kernel computes. Each weight is the e4m3 value e widened
exactly to bf16 as e x 2^-112 (the byte permute and x 2^8 on A, FP8_PRMT 1); an activation x is bf16, so each product
e x 2^-112 is exact in FP32 (at most 4 x 8 significant bits) down to FP32's subnormal range; the mma sum a 128-wide
scale block's products into an FP32 partial p (or fewer: a k block of 64 where the warp's k blocks of the slice end);
the flush does acc = fmaf(p x 2^112, s, acc) (x 2^112 exact, one rounding); KSPLIT > 1 adds the k ranges' sums in
shared memory. Against y = sum x d over the dequantized d = fl32(e s) in fp64, with S = sum |x d|:

* the dequantization the kernel never does: |e s - d| <= 2^-24 |d|, at most 2^-24 S;
* a partial's FP32 sums: at most 128 roundings (16 per mma), each within u |partial so far|, u = 2^-23 (the tensor
  core's FP32 accumulation is not promised round-to-nearest: the bf16 path's allowance), at most 128 u S in all;
* the flushes (one per k block at most: ceil(K / 64)) and the KSPLIT - 1 range adds, each within 2^-24 S;
* FP32 subnormals: each product and add in the partial's scale (x 2^-112) rounds to 2^-150 at worst: per output at
  most 2 K x 2^-150 x 2^112 x s_max = K 2^-37 s_max.

So |y_kernel - y| <= (2^-24 + 128 x 2^-23 + (ceil(K / 64) + KSPLIT) 2^-24) S + K 2^-37 s_max (x 1.01 for the
second-order terms): 2^-15.6 S at K = 2048, tighter than the FMA kernel's K 2^-24 S (2^-13). A bf16 output adds
its rounding (2^-8 of the value) and, with the residual, one FP32 add.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kernels.arrays import BF16
from kernels.batched.loaders import loader_for
from kernels.contract import Dims
from kernels.decode.gemv import GemvCall, quantize_matrix, select_path
from kernels.decode.gemv_mma import (
    FP8_SOURCE,
    GEMV_MMA,
    GEMV_MMA_FP8,
    SOURCE,
    resolve_call,
    row_groups,
    shared_bytes,
    slice_chunks,
)
from kernels.formats import Quantized, dequantize_blocks
from kernels.numerics import bf16_to_f32
from tests.test_decode_gemv import (
    QWEN3_30B,
    _argmax,
    _bits,
    _device,
    _fp8_bound,
    _inputs,
    _poisoned,
    _prologue,
)
from tests.test_decode_gemv_mma import HARNESS, MODES, _run, replays_bitwise
from tests.test_decode_gemv_mma import _call as mma_call
from tests.warp_checks import build_emulator, run_emulator


def _call(tokens: int, k: int, n: int, modes: dict[str, int]) -> GemvCall:
    return mma_call(tokens, k, n, modes, fp8=1)


# ---------------------------------------------------------------------------------------------------
# The rules and the path (the offline compiles of both formats: tests/test_decode_gemv_mma.py)
# ---------------------------------------------------------------------------------------------------
def test_the_format_is_the_batched_loader() -> None:
    """One kernel text, two compiles: the sources differ by the loader alone (the batched families' tensor-core
    loader of each format), and the kernel text names no format."""
    bf16_code, fp8_code = SOURCE.code, FP8_SOURCE.code
    bf16_loader, fp8_loader = loader_for("bf16", "mma"), loader_for("fp8-block128", "mma")
    assert bf16_loader in bf16_code and fp8_loader in fp8_code
    assert bf16_code.replace(bf16_loader, "") == fp8_code.replace(fp8_loader, "")
    kernel = fp8_code[fp8_code.index("// ==== the decode GEMV on tensor cores"):]
    assert "fp8" not in kernel.lower().replace("fp8_block", "").replace("fp8_load16", "")


def test_rules_shared_memory_and_selection() -> None:
    qkv, o = (Dims(64, k, n, 1, 1) for n, k in (QWEN3_30B["qkv"], QWEN3_30B["o"]))
    p_qkv, p_o = GEMV_MMA_FP8.resolve(qkv), GEMV_MMA_FP8.resolve(o)
    assert (p_qkv["KSPLIT"], p_qkv["UNROLL"], p_o["KSPLIT"], p_o["UNROLL"]) == (4, 2, 8, 1)  # 64-wide k blocks
    assert GEMV_MMA_FP8.resolve(Dims(16, 4096, 2048, 1, 1))["UNROLL"] == 4
    # a staged row: 8 chunks a k block; stride odd in chunks (16 mod 32 bytes): lanes q read chunks 2q + h
    assert slice_chunks(p_qkv) == 8 * 4 * 2 + 1 and shared_bytes(p_qkv, 8) == 64 * 65 * 16
    assert slice_chunks(GEMV_MMA.resolve(qkv)) == 4 * 4 * 2 + 4  # bf16 unchanged: 64 mod 128 bytes
    for tokens, want in [(1, "fma"), (8, "fma"), (9, "mma"), (64, "mma")]:
        assert select_path(_call(tokens, 2048, 5120, {}), 0, {}) == want
    assert select_path(_call(16, 2048, 5120, {}), -1, {}) == "fma"
    assert select_path(_call(4, 2048, 5120, {}), 1, {}) == "mma"
    assert select_path(_call(16, 2048, 5120, {}), 0, {"TOKENS": 8}) == "fma"


# ---------------------------------------------------------------------------------------------------
# The tolerance
# ---------------------------------------------------------------------------------------------------
def fp8_mma_bound(xn: np.ndarray, q: Quantized, ksplit: int) -> tuple[np.ndarray, np.ndarray]:
    """(fp64 y over the dequantized weights [T, N], the bound of the module docstring [T, N])."""
    deq = dequantize_blocks(q.values, q.scales).astype(np.float64)
    x64 = bf16_to_f32(xn).astype(np.float64)
    k = deq.shape[1]
    s = np.abs(x64) @ np.abs(deq).T
    rel = 2.0**-24 + 128 * 2.0**-23 + (-(-k // 64) + ksplit) * 2.0**-24
    return x64 @ deq.T, 1.01 * (rel * s + k * 2.0**-37 * float(np.max(q.scales)))


def expect_fp8(inputs: dict[str, np.ndarray], q: Quantized, modes: dict[str, int], got: dict[str, Any],
               ksplit: int) -> None:
    """Every output written (the poison gone) and within the bound; the summed residual bitwise; the argmax that of
    the kernel's own logits, and fp64's where its top two are clear of the bound."""
    xn, summed = _prologue(inputs["x"], inputs["add"] if modes.get("ADD") else None,
                           inputs["norm"] if modes.get("NORM") else None, 1e-6)
    want, bound = fp8_mma_bound(xn, q, ksplit)
    if summed is not None:
        np.testing.assert_array_equal(_bits(got["residual_out"]), _bits(summed))
    epilogue = modes.get("EPILOGUE", 0)
    if epilogue >= 2:
        if epilogue == 3:
            assert np.isfinite(got["logits"]).all()
            assert (np.abs(got["logits"] - want) <= bound).all(), np.max(np.abs(got["logits"] - want) / bound)
            np.testing.assert_array_equal(got["argmax"], _argmax(got["logits"]))
        top = np.sort(want, axis=1)
        clear = top[:, -1] - top[:, -2] > 2 * bound.max(axis=1)
        np.testing.assert_array_equal(got["argmax"][clear], np.argmax(want, axis=1)[clear])
        assert ((got["argmax"] >= 0) & (got["argmax"] < want.shape[1])).all()
        return
    if epilogue == 1:
        want = bf16_to_f32(inputs["residual_in"]).astype(np.float64) + want
    out = bf16_to_f32(got["out"]).astype(np.float64)
    assert np.isfinite(out).all()
    slack = bound + np.abs(want) * (2.0**-8 + 2.0**-23)
    assert (np.abs(out - want) <= slack).all(), np.max(np.abs(out - want) / slack)


# ---------------------------------------------------------------------------------------------------
# CPU: the CUDA C emulated (the bf16 tensor-core harness, fp8 weights and scales)
# ---------------------------------------------------------------------------------------------------
def _fp8_inputs(rng: np.random.Generator, tokens: int, n: int, k: int) -> tuple[dict[str, np.ndarray], Quantized]:
    """Inputs whose 128-column scale blocks differ (columns from 130 x 8) and whose 128-row blocks differ (rows from
    100 x 1/4): several scales per row and per column of blocks."""
    inputs = _inputs(rng, tokens, n, k)
    w = bf16_to_f32(inputs["w"])
    w[:, 130:] *= 8.0
    w[100:] *= 0.25
    inputs["w"] = w.astype(BF16)
    return inputs, quantize_matrix(bf16_to_f32(inputs["w"]))


def _emulate(inputs: dict[str, np.ndarray], q: Quantized, modes: dict[str, int], tmp_path: Any,
             **knobs: int) -> tuple[dict[str, Any], dict[str, int]]:
    tokens, k = inputs["x"].shape
    n = q.values.shape[0]
    params = resolve_call(_call(tokens, k, n, modes), knobs)
    binary = build_emulator(FP8_SOURCE.render(**params), HARNESS, "-DFP8=1")
    for name in ("x", "add", "norm", "residual_in"):
        inputs[name].view(np.uint16).tofile(tmp_path / f"{name}.bin")
    np.ascontiguousarray(q.values).view(np.uint8).tofile(tmp_path / "w.bin")
    q.scales.astype(np.float32).tofile(tmp_path / "scales.bin")
    groups = row_groups(n, params)
    grid = min(groups, params["ARGMAX_BLOCKS"]) if modes.get("EPILOGUE", 0) >= 2 else groups
    run_emulator(binary, tokens, n, k, repr(float(np.float32(1e-6))), grid, tmp_path,
                 shared_bytes(params, params["NT"]) // 16)
    got = {
        "out": np.fromfile(tmp_path / "out.bin", np.uint16).view(BF16).reshape(tokens, n),
        "residual_out": np.fromfile(tmp_path / "residual_out.bin", np.uint16).view(BF16).reshape(tokens, k),
        "logits": np.fromfile(tmp_path / "logits.bin", np.float32).reshape(tokens, n),
        "argmax": np.fromfile(tmp_path / "argmax.bin", np.int32),
    }
    return got, params


EMULATED = [  # (tokens, n, k, mode, knobs): N not a multiple of 16 (two 128-row blocks), K of 16 but not of 128
    pytest.param(9, 150, 272, "add-norm", {"WARPS": 4, "KSPLIT": 2, "UNROLL": 1}, id="t9-add-norm-ksplit2-u1"),
    pytest.param(13, 150, 400, "argmax-logits", {"WARPS": 2, "KSPLIT": 1, "UNROLL": 2, "ARGMAX_BLOCKS": 2},
                 id="t13-argmax-logits-strided"),
    pytest.param(24, 150, 272, "residual", {"WARPS": 4, "KSPLIT": 4, "UNROLL": 1}, id="t24-residual-ksplit4",
                 marks=pytest.mark.slow),
    pytest.param(17, 150, 400, "store", {"WARPS": 4, "KSPLIT": 2, "UNROLL": 3, "PDL": 1}, id="t17-store-u3-pdl",
                 marks=pytest.mark.slow),
    pytest.param(24, 150, 272, "argmax", {"WARPS": 4, "KSPLIT": 2, "UNROLL": 1, "ARGMAX_BLOCKS": 2},
                 id="t24-argmax", marks=pytest.mark.slow),
    pytest.param(9, 150, 208, "residual", {"WARPS": 8, "KSPLIT": 8, "UNROLL": 1}, id="t9-ksplit8-empty-ranges",
                 marks=pytest.mark.slow),
    pytest.param(64, 150, 272, "norm", {}, id="t64-norm-defaults", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("tokens", "n", "k", "mode", "knobs"), EMULATED)
def test_emulated_within_the_bound(rng: np.random.Generator, tmp_path: Any, tokens: int, n: int, k: int, mode: str,
                                   knobs: dict[str, int]) -> None:
    inputs, q = _fp8_inputs(rng, tokens, n, k)
    got, params = _emulate(inputs, q, MODES[mode], tmp_path, **knobs)
    expect_fp8(inputs, q, MODES[mode], got, params["KSPLIT"])


@pytest.mark.slow
def test_emulated_tiny_activations_and_subnormal_weights(tmp_path: Any) -> None:
    """A token x 2^-8 (its products e x 2^-120, near FP32's subnormal range) and e4m3 subnormals in the weights (a
    row block whose values span 2^-6 .. 2^-9 of its largest): still within the bound, the small token's outputs
    2^-8 times the plain token's within it. Not x 2^-24, as once: its partials fall below 2^-126, and the GPU's FP32
    (-ftz=true, kernels/compile.py) flushes them -- the emulation does too."""
    rng = np.random.default_rng(11)
    inputs, _ = _fp8_inputs(rng, 10, 37, 144)
    w = bf16_to_f32(inputs["w"])
    w[:, :16] = np.sign(w[:, :16]) * 2.0 ** rng.integers(-16, -6, size=(37, 16))
    w[:, 16] = 1.0
    inputs["w"] = w.astype(BF16)
    q = quantize_matrix(w)
    inputs["x"][1] = (bf16_to_f32(inputs["x"][0]) * 2.0**-8).astype(BF16)
    got, params = _emulate(inputs, q, {}, tmp_path, WARPS=2, KSPLIT=2, UNROLL=1)
    expect_fp8(inputs, q, {}, got, params["KSPLIT"])
    tiny, plain = bf16_to_f32(got["out"][1]).astype(np.float64), bf16_to_f32(got["out"][0]).astype(np.float64)
    assert (np.abs(tiny * 2.0**8 - plain) <= np.abs(plain) * 2.0**-7 + 2.0**-100).all()


# ---------------------------------------------------------------------------------------------------
# GPU (H200)
# ---------------------------------------------------------------------------------------------------
def _gpu_weights(cupy: Any, inputs: dict[str, np.ndarray]) -> tuple[dict[str, Any], Quantized]:
    q = quantize_matrix(bf16_to_f32(inputs["w"]))
    d = _device(cupy, inputs)
    d["w"] = Quantized(cupy.asarray(q.values.view(np.uint8)), cupy.asarray(q.scales))
    return d, q


@pytest.mark.gpu
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("tokens", [9, 16, 33, 64])
@pytest.mark.parametrize("shape", ["qkv", "o"])
def test_gpu_within_the_bound_and_repeats(cupy_mod: Any, rng: np.random.Generator, shape: str,
                                          tokens: int, mode: str) -> None:
    cupy = cupy_mod
    n, k = QWEN3_30B[shape]
    inputs = _inputs(rng, tokens, n, k)
    d, q = _gpu_weights(cupy, inputs)
    first = _run(cupy, d, mode)
    ksplit = resolve_call(_call(tokens, k, n, MODES[mode]), {})["KSPLIT"]
    expect_fp8(inputs, q, MODES[mode], first, ksplit)
    again = _run(cupy, d, mode, MMA=1)
    for name, value in first.items():
        assert np.array_equal(value.view(np.uint8), again[name].view(np.uint8)), name


@pytest.mark.gpu
@pytest.mark.parametrize("knobs", [{"WARPS": 4, "KSPLIT": 1, "UNROLL": 1}, {"WARPS": 8, "KSPLIT": 8, "UNROLL": 3},
                                   {"WARPS": 16, "KSPLIT": 2, "PDL": 1}], ids=["w4-k1-u1", "w8-k8-u3", "w16-k2-pdl"])
@pytest.mark.parametrize("mode", ["add-norm", "residual", "argmax-logits"])
def test_gpu_knobs_odd_shape(cupy_mod: Any, rng: np.random.Generator, mode: str,
                             knobs: dict[str, int]) -> None:
    """N = 3000 (not of 16 or 128), K = 4112 (of 16, not of 128: a 16-wide last scale block)."""
    cupy, tokens = cupy_mod, 13
    inputs, q = _fp8_inputs(rng, tokens, 3000, 4112)
    d = _device(cupy, inputs)
    d["w"] = Quantized(cupy.asarray(q.values.view(np.uint8)), cupy.asarray(q.scales))
    got = _run(cupy, d, mode, MMA=1, **knobs)
    ksplit = resolve_call(_call(tokens, 4112, 3000, MODES[mode]), {k: v for k, v in knobs.items()})["KSPLIT"]
    expect_fp8(inputs, q, MODES[mode], got, ksplit)


@pytest.mark.gpu
def test_gpu_fma_path_kept_at_small_t(cupy_mod: Any, rng: np.random.Generator) -> None:
    """T = 8: auto is the FMA kernel (bitwise MMA=-1); T = 16: auto is this one (within its bound) and MMA=-1 the FMA
    kernel (within its own, K 2^-24 S)."""
    from kernels.decode.gemv import dense_gemv

    cupy = cupy_mod
    for tokens in (8, 16):
        inputs = _inputs(rng, tokens, 512, 1024)
        d, q = _gpu_weights(cupy, inputs)
        outs = {}
        for mma in (-1, 0):
            out = _poisoned(cupy, (tokens, 512), BF16)
            dense_gemv(d["x"], d["w"], out, MMA=mma)
            outs[mma] = cupy.asnumpy(out)
        if tokens == 8:
            np.testing.assert_array_equal(_bits(outs[-1]), _bits(outs[0]))
            continue
        expect_fp8(inputs, q, {}, {"out": outs[0]}, resolve_call(_call(tokens, 1024, 512, {}), {})["KSPLIT"])
        want, bound = _fp8_bound(inputs["x"], dequantize_blocks(q.values, q.scales))
        fma = bf16_to_f32(outs[-1]).astype(np.float64)
        assert (np.abs(fma - want) <= bound + np.abs(want) * 2.0**-8).all()


@pytest.mark.gpu
def test_gpu_graph_capture_and_pdl_chain(cupy_mod: Any, rng: np.random.Generator) -> None:
    """qwen3-30b's QKV (add + norm) then O (residual) on fp8 weights at T = 32, PDL=1, captured and replayed on new
    contents: bitwise the eager PDL=0 launches every replay."""
    from kernels.decode.gemv import gemv_launch

    cupy, tokens = cupy_mod, 32
    n1, k1 = QWEN3_30B["o"][1], QWEN3_30B["qkv"][1]
    inputs = _inputs(rng, tokens, n1, k1)
    d, q = _gpu_weights(cupy, inputs)
    w2 = quantize_matrix((rng.standard_normal((k1, n1)) * n1**-0.5).astype(np.float32))
    w2_d = Quantized(cupy.asarray(w2.values.view(np.uint8)), cupy.asarray(w2.scales))
    mid, summed = _poisoned(cupy, (tokens, n1), BF16), _poisoned(cupy, (tokens, k1), BF16)
    out = cupy.asarray(inputs["x"])

    def launches(pdl: int) -> list[Any]:
        return [gemv_launch(d["x"], d["w"], mid, norm=d["norm"], add=d["add"], residual_out=summed, PDL=pdl),
                gemv_launch(mid, w2_d, out, residual_in=out, PDL=pdl)]

    for launch in launches(0):
        launch()
    cupy.cuda.runtime.deviceSynchronize()
    want = cupy.asnumpy(out).view(np.uint16).copy()
    ksplit = resolve_call(_call(tokens, k1, n1, MODES["add-norm"]), {})["KSPLIT"]
    expect_fp8(inputs, q, MODES["add-norm"], {"out": cupy.asnumpy(mid), "residual_out": cupy.asnumpy(summed)},
               ksplit)
    replays_bitwise(cupy, launches(1), [mid, summed], out, inputs["x"], want)
