"""The fused router (kernels/decode/router.py): offline compile, the CUDA C emulated on the CPU against the NumPy
reference step's routing (``select_experts`` on fp32 logits), the input checks, and GPU tests (H200)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kernels.arrays import BF16
from kernels.compile import offline_report
from kernels.decode import fused_router, make_router_workspace
from kernels.decode.router import ROUTER, SOURCE, RouterWorkspace, check_router_inputs, row_groups
from kernels.decode_reference import linear, select_experts
from kernels.numerics import dot_chain, exp_rn, rms_norm_chain
from tests.warp_checks import (
    BLOCK_EMULATION,
    EMULATION_LOAD,
    EMULATION_PRELUDE,
    FakeCupyArray,
    build_emulator,
    run_emulator,
)

TIE_MARGIN = 1e-4  # ids compared only where the reference's k-th and (k+1)-th logits differ by more (see _check)


def _reference(h: np.ndarray, w: np.ndarray, top_k: int, renormalize: bool) -> tuple[np.ndarray, ...]:
    logits = linear(h.astype(np.float32), w)
    ids, weights = select_experts(logits, top_k, renormalize)
    return logits, ids, weights


def _inputs(rng: np.random.Generator, tokens: int, hidden: int, experts: int) -> tuple[np.ndarray, np.ndarray]:
    h = rng.standard_normal((tokens, hidden)).astype(BF16)
    w = (rng.standard_normal((experts, hidden)) * hidden**-0.5).astype(BF16)
    return h, w


def _check(h: np.ndarray, w: np.ndarray, top_k: int, renormalize: bool, ids: np.ndarray, weights: np.ndarray) -> None:
    """Ids equal where the reference's k-th and (k+1)-th logits are more than TIE_MARGIN apart (elsewhere the
    FP32 summation order may swap them: both kernels are right); weights within rel 1e-5 on those tokens."""
    logits, want_ids, want_weights = _reference(h, w, top_k, renormalize)
    assert ids.shape == want_ids.shape and weights.shape == want_weights.shape
    assert np.isfinite(weights).all() and (ids >= 0).all()  # every slot written over the poison
    ordered = -np.sort(-logits, axis=1)
    clear = (ordered[:, top_k - 1] - ordered[:, top_k] > TIE_MARGIN) if top_k < logits.shape[1] else \
        np.ones(len(ids), bool)
    gaps = -np.diff(ordered[:, : top_k + 1], axis=1)
    clear &= (gaps > TIE_MARGIN).all(axis=1)  # the slots' order too
    assert clear.sum() >= max(1, len(ids) // 2), "too few tokens without near-ties to compare"
    np.testing.assert_array_equal(ids[clear], want_ids[clear])
    np.testing.assert_allclose(weights[clear], want_weights[clear], rtol=1e-5, atol=0)


# ---------------------------------------------------------------------------------------------------
# Offline compile (NVRTC for sm_90, no GPU)
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("norm", [0, 1], ids=["plain", "norm"])
@pytest.mark.parametrize("knobs", [{}, {"WARPS": 8, "UNROLL": 2}, {"WARPS": 32, "UNROLL": 4},
                                   {"WARPS": 8, "UNROLL": 4, "ROWS": 4}, {"PDL": 1}],
                         ids=["defaults", "w8-u2", "w32-u4", "w8-u4-r4", "pdl"])
def test_compiles_without_spills(knobs: dict[str, int], norm: int) -> None:
    params = {**ROUTER.resolve(**knobs), "NORM": norm}
    (report,) = offline_report(SOURCE, **params)
    assert report.kernel == "fused_router"
    assert report.spills == 0 and report.stack_bytes == 0, report
    # the last block's logits and its flag (+ the norm's rs, padded)
    assert report.shared_bytes == 4 * 512 + 4 + (12 if norm else 0)


def test_row_groups_cover_the_experts() -> None:
    assert row_groups(128, ROUTER.resolve()) == 128 // (ROUTER.resolve()["WARPS"] * ROUTER.resolve()["ROWS"])
    assert row_groups(37, ROUTER.resolve(WARPS=4, ROWS=2)) == 5
    assert row_groups(512, ROUTER.resolve(WARPS=32, UNROLL=4, ROWS=8)) == 2


def test_rules_refuse_unroll_past_the_register_cap() -> None:
    with pytest.raises(ValueError, match="UNROLL"):
        ROUTER.resolve(WARPS=32, UNROLL=8)
    with pytest.raises(ValueError, match="WARPS"):
        ROUTER.resolve(WARPS=64)
    with pytest.raises(ValueError, match="ROWS"):
        ROUTER.resolve(ROWS=9)


def test_source_is_registered_for_the_compile_report() -> None:
    """In a fresh process (this one imported the module already): what tools.compile_report loads has it."""
    import subprocess
    import sys

    code = "from tools.compile_report import load_sources; print('decode_router' in load_sources())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "True", done.stderr[-2000:]


# ---------------------------------------------------------------------------------------------------
# CPU: the CUDA C emulated (g++; every thread of the block a lane, barriers for warps and the block)
# ---------------------------------------------------------------------------------------------------
HARNESS = EMULATION_PRELUDE + BLOCK_EMULATION + r"""
std::vector<uint4> g_smem;
#define ROUTER_DYNAMIC_SMEM uint4* router_smem = g_smem.data()
#include "kernel.cu"
""" + EMULATION_LOAD + r"""
int main(int argc, char** argv) {
    const int T = atoi(argv[1]), H = atoi(argv[2]), E = atoi(argv[3]), K = atoi(argv[4]), renorm = atoi(argv[5]);
    const std::string dir = argv[6];
    const int groups = atoi(argv[7]);
    const float eps = (float)atof(argv[8]);
    auto h = load<uint16_t>(dir + "/h.bin", (size_t)T * H);
    auto w = load<uint16_t>(dir + "/w.bin", (size_t)E * H);
    auto norm = load<uint16_t>(dir + "/norm.bin", (size_t)H);
    std::vector<uint16_t> moe_in((size_t)T * H, (uint16_t)0x7fc0);
    g_smem.assign((size_t)H / 8, make_uint4(0x7fc07fc0u, 0x7fc07fc0u, 0x7fc07fc0u, 0x7fc07fc0u));
    std::vector<float> logits((size_t)T * E, __uint_as_float(0x7fc00000u));
    std::vector<unsigned> tickets((size_t)T, 0u);
    std::vector<int> ids((size_t)T * K), first_ids;
    std::vector<float> wts((size_t)T * K), first_wts;
    const int threads = WARPS * 32;
    EmuBarrier block_bar(threads);
    g_block = &block_bar;
    std::vector<std::unique_ptr<WarpCtx>> warps;
    for (int i = 0; i < WARPS; ++i) warps.emplace_back(new WarpCtx);
    gridDim.x = T;
    gridDim.y = groups;
    // Two launches (the tickets must come back to 0 in between), each block order different: token by token,
    // then group by group (a token's blocks interleaved with the others'), the groups of odd tokens in reverse so
    // that another block takes each token's last ticket.
    for (int launch = 0; launch < 2; ++launch) {
        std::fill(ids.begin(), ids.end(), -12345);
        std::fill(wts.begin(), wts.end(), __uint_as_float(0x7fc00000u));   // poisoned
        for (int i = 0; i < T * groups; ++i) {
            const int t = launch == 0 ? i / groups : i % T, j = launch == 0 ? i % groups : i / T;
            const int g = t % 2 ? groups - 1 - j : j;
            run_lanes(threads, [&](int l) {   // fresh lanes per block: a lane that returned early is no issue
                g_warp = warps[l / 32].get();
                threadIdx.x = l;
                blockIdx.x = (unsigned)t;
                blockIdx.y = (unsigned)g;
                fused_router(reinterpret_cast<const bf16_t*>(h.data()), reinterpret_cast<const bf16_t*>(w.data()),
                             logits.data(), tickets.data(), ids.data(), wts.data(),
                             reinterpret_cast<const bf16_t*>(norm.data()), reinterpret_cast<bf16_t*>(moe_in.data()),
                             H, E, K, renorm, eps);
            });
        }
        for (int t = 0; t < T; ++t)
            if (tickets[t] != 0u) { fprintf(stderr, "token %d's ticket left at %u\\n", t, tickets[t]); return 3; }
        if (launch == 0) { first_ids = ids; first_wts = wts; }
    }
    if (ids != first_ids || memcmp(wts.data(), first_wts.data(), 4 * wts.size()) != 0) {
        fprintf(stderr, "the second launch differs from the first\\n");
        return 4;
    }
    FILE* f = fopen((dir + "/ids.bin").c_str(), "wb"); fwrite(ids.data(), 4, ids.size(), f); fclose(f);
    f = fopen((dir + "/wts.bin").c_str(), "wb"); fwrite(wts.data(), 4, wts.size(), f); fclose(f);
    f = fopen((dir + "/logits.bin").c_str(), "wb"); fwrite(logits.data(), 4, logits.size(), f); fclose(f);
    f = fopen((dir + "/moe_in.bin").c_str(), "wb"); fwrite(moe_in.data(), 2, moe_in.size(), f); fclose(f);
    return 0;
}
"""


def _emulate(h: np.ndarray, w: np.ndarray, top_k: int, renormalize: bool, tmp_path: Any, norm: np.ndarray | None = None,
             eps: float = 1e-6, **knobs: int) -> tuple[np.ndarray, np.ndarray]:
    params = {**ROUTER.resolve(**knobs), "NORM": int(norm is not None)}
    binary = build_emulator(SOURCE.render(**params), HARNESS)
    tokens, hidden = h.shape
    h.view(np.uint16).tofile(tmp_path / "h.bin")
    w.view(np.uint16).tofile(tmp_path / "w.bin")
    (norm if norm is not None else np.ones(hidden, BF16)).view(np.uint16).tofile(tmp_path / "norm.bin")
    run_emulator(binary, tokens, hidden, w.shape[0], top_k, int(renormalize), tmp_path, row_groups(w.shape[0], params),
                 repr(float(np.float32(eps))))
    ids = np.fromfile(tmp_path / "ids.bin", np.int32).reshape(tokens, top_k)
    weights = np.fromfile(tmp_path / "wts.bin", np.float32).reshape(tokens, top_k)
    return ids, weights


@pytest.mark.parametrize(("tokens", "hidden", "experts", "top_k", "renormalize", "knobs"), [
    (3, 72, 37, 5, True, {"WARPS": 4, "UNROLL": 1}),    # odd sizes: lanes past H's end, E not a multiple of WARPS
    (3, 72, 37, 5, False, {"WARPS": 4, "UNROLL": 1}),   # norm_topk_prob off
    (2, 256, 128, 8, True, {"WARPS": 8, "UNROLL": 2}),  # qwen3's E and K
    (3, 72, 37, 5, True, {"WARPS": 2, "UNROLL": 1, "ROWS": 3}),  # rows per warp: the last group part-full
    (2, 256, 128, 8, True, {}),                         # the defaults
], ids=["h72-e37-k5", "h72-e37-k5-raw", "h256-e128-k8", "h72-e37-k5-r3", "h256-e128-k8-defaults"])
def test_emulated_matches_reference(rng: np.random.Generator, tmp_path: Any, tokens: int, hidden: int, experts: int,
                                    top_k: int, renormalize: bool, knobs: dict[str, int]) -> None:
    h, w = _inputs(rng, tokens, hidden, experts)
    ids, weights = _emulate(h, w, top_k, renormalize, tmp_path, **knobs)
    _check(h, w, top_k, renormalize, ids, weights)
    if renormalize:
        np.testing.assert_allclose(weights.sum(axis=1), 1.0, rtol=1e-6)


def test_emulated_logits_and_nan_tokens(rng: np.random.Generator, tmp_path: Any) -> None:
    """The workspace holds every logit (close to the reference's: only the FP32 order differs); a token with a NaN
    in h gets NaN logits, so ids -1 and NaN weights in every slot, and the other tokens are untouched."""
    h, w = _inputs(rng, 3, 72, 37)
    h[1, 5] = np.nan
    ids, weights = _emulate(h, w, 5, True, tmp_path, WARPS=2, UNROLL=1, ROWS=2)
    logits = np.fromfile(tmp_path / "logits.bin", np.float32).reshape(3, 37)
    want = linear(h.astype(np.float32), w)
    assert np.isnan(logits[1]).all()
    np.testing.assert_allclose(logits[[0, 2]], want[[0, 2]], rtol=1e-4, atol=1e-5)
    assert (ids[1] == -1).all() and np.isnan(weights[1]).all()
    _check(h[[0, 2]], w, 5, True, ids[[0, 2]], weights[[0, 2]])


def test_emulated_exact_tie_goes_to_the_lower_id(tmp_path: Any) -> None:
    """Experts 3, 9 and 20 share one row (the same logit, bitwise) and lead: slots 0..2 are 3, 9, 20 in that order,
    as kernels.route breaks ties."""
    rng = np.random.default_rng(7)
    h, w = _inputs(rng, 1, 64, 24)
    w *= np.asarray(0.25, BF16)
    w[[3, 9, 20]] = h[0] * np.asarray(0.125, BF16)  # exact; h . h / 8 ~ 8: far above the others
    ids, weights = _emulate(h, w, 4, True, tmp_path, WARPS=4, UNROLL=1)
    assert list(ids[0, :3]) == [3, 9, 20]
    assert weights[0, 0] == weights[0, 1] == weights[0, 2]
    _, want_ids, want_weights = _reference(h, w, 4, True)
    assert np.array_equal(ids, want_ids)
    np.testing.assert_allclose(weights, want_weights, rtol=1e-5)


def _twin(h: np.ndarray, w: np.ndarray, top_k: int, renormalize: bool, norm: np.ndarray | None = None,
          eps: float = 1e-6) -> tuple[np.ndarray, ...]:
    """The kernel's order in NumPy float32 (the order contract's item 7): (xn, logits, ids, weights), bitwise."""
    xn = rms_norm_chain(h, norm, eps) if norm is not None else h
    logits = dot_chain(xn[:, None, :], w[None])
    tokens, experts = logits.shape
    ids = np.full((tokens, top_k), -1, np.int32)
    weights = np.zeros((tokens, top_k), np.float32)
    for t in range(tokens):
        top = np.fmax.reduce(logits[t])
        d = logits[t] - top
        p = np.where(d == d, exp_rn(d), d)
        lanes = np.zeros(32, np.float32)
        for e in range(experts):  # lane e % 32, in order
            lanes[e % 32] = lanes[e % 32] + p[e]
        for off in (16, 8, 4, 2, 1):
            lanes = lanes + lanes[np.arange(32) ^ off]
        p = (p / lanes[0]).astype(np.float32)
        chosen = np.float32(0.0)
        for k in range(top_k):
            valid = p >= 0
            best = int(np.argmax(np.where(valid, p, -1.0)))
            ids[t, k], weights[t, k] = best, p[best]
            chosen = np.float32(chosen + p[best])
            p[best] = -1.0
        if renormalize:
            weights[t] = weights[t] / chosen
    return xn, logits, ids, weights


@pytest.mark.parametrize(("tokens", "hidden", "experts", "top_k", "norm", "knobs"), [
    (3, 72, 37, 5, False, {"WARPS": 4, "UNROLL": 1}),
    (3, 264, 37, 5, True, {"WARPS": 2, "UNROLL": 1, "ROWS": 3}),      # H % 256 != 0: partial rounds
    (2, 256, 128, 8, True, {"PDL": 1}),                               # qwen3's E and K, the defaults + PDL
], ids=["h72-e37", "h264-e37-norm-r3", "h256-e128-norm-pdl"])
def test_emulated_bitwise_twin(rng: np.random.Generator, tmp_path: Any, tokens: int, hidden: int, experts: int,
                               top_k: int, norm: bool, knobs: dict[str, int]) -> None:
    """ids, weights and the logits bitwise the NumPy twin's (dot_chain, exp_rn); with the fused norm, h is the
    residual stream and moe_in holds rms_norm_chain's rows bitwise."""
    h, w = _inputs(rng, tokens, hidden, experts)
    g = (1.0 + 0.05 * rng.standard_normal(hidden)).astype(BF16) if norm else None
    ids, weights = _emulate(h, w, top_k, True, tmp_path, norm=g, **knobs)
    xn, logits, want_ids, want_weights = _twin(h, w, top_k, True, g)
    got_logits = np.fromfile(tmp_path / "logits.bin", np.float32).reshape(tokens, experts)
    np.testing.assert_array_equal(got_logits.view(np.uint32), logits.view(np.uint32))
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_array_equal(weights.view(np.uint32), want_weights.view(np.uint32))
    moe_in = np.fromfile(tmp_path / "moe_in.bin", np.uint16).reshape(tokens, hidden)
    if norm:
        np.testing.assert_array_equal(moe_in, xn.view(np.uint16))
    else:
        assert (moe_in == 0x7FC0).all()  # not written


# ---------------------------------------------------------------------------------------------------
# Input checks (CPU: they run before any device call)
# ---------------------------------------------------------------------------------------------------
def _fakes(T: int = 3, H: int = 64, E: int = 16) -> tuple[FakeCupyArray, FakeCupyArray]:
    return FakeCupyArray((T, H), BF16), FakeCupyArray((E, H), BF16)


def test_checks_accept_good_inputs() -> None:
    h, w = _fakes()
    ids, weights = FakeCupyArray((3, 4), np.int32), FakeCupyArray((3, 4), np.float32)
    workspace = RouterWorkspace(FakeCupyArray((3, 16), np.float32), FakeCupyArray((3,), np.uint32))
    assert check_router_inputs(h, w, 4, True, ids, weights) == (3, 64, 16, 4)
    assert check_router_inputs(h, w, 4, True, ids, weights, workspace) == (3, 64, 16, 4)


@pytest.mark.parametrize(("change", "error", "name"), [
    ({"h": np.zeros((3, 64), BF16)}, TypeError, "h must be a cupy"),
    ({"w_router": np.zeros((16, 64), BF16)}, TypeError, "w_router must be a cupy"),
    ({"h": FakeCupyArray((3, 64), np.float32)}, TypeError, "h must have dtype bfloat16"),
    ({"w_router": FakeCupyArray((16, 64), np.float16)}, TypeError, "w_router must have dtype"),
    ({"h": FakeCupyArray((64,), BF16)}, ValueError, "h must be"),
    ({"w_router": FakeCupyArray((16, 72), BF16)}, ValueError, "w_router must be"),
    ({"h": FakeCupyArray((3, 60), BF16), "w_router": FakeCupyArray((16, 60), BF16)}, ValueError, "multiple of 8"),
    ({"w_router": FakeCupyArray((513, 64), BF16)}, ValueError, "w_router's experts"),
    ({"top_k": 17, "w_router": FakeCupyArray((64, 64), BF16)}, ValueError, "top_k"),
    ({"top_k": 0}, ValueError, "top_k"),
    ({"top_k": 17}, ValueError, "top_k"),
    ({"top_k": 2.0}, TypeError, "top_k"),
    ({"norm_topk_prob": 1}, TypeError, "norm_topk_prob"),
    ({"topk_ids": FakeCupyArray((3, 4), np.int64)}, TypeError, "topk_ids"),
    ({"topk_ids": FakeCupyArray((3, 5), np.int32)}, ValueError, "topk_ids"),
    ({"topk_weights": FakeCupyArray((3, 4), BF16)}, TypeError, "topk_weights"),
    ({"topk_weights": np.zeros((3, 4), np.float32)}, TypeError, "topk_weights must be a cupy"),
    ({"workspace": FakeCupyArray((3, 16), np.float32)}, TypeError, "workspace must be a RouterWorkspace"),
    ({"workspace": RouterWorkspace(FakeCupyArray((3, 17), np.float32), FakeCupyArray((3,), np.uint32))},
     ValueError, "workspace.logits"),
    ({"workspace": RouterWorkspace(FakeCupyArray((3, 16), np.float32), FakeCupyArray((3,), np.int32))},
     TypeError, "workspace.tickets"),
    ({"workspace": RouterWorkspace(FakeCupyArray((3, 16), np.float32), FakeCupyArray((4,), np.uint32))},
     ValueError, "workspace.tickets"),
], ids=lambda v: None if isinstance(v, dict | type) else str(v)[:24])
def test_checks_refuse(change: dict[str, Any], error: type, name: str) -> None:
    h, w = _fakes()
    args = {"h": h, "w_router": w, "top_k": 4, "norm_topk_prob": True, "topk_ids": None, "topk_weights": None,
            "workspace": None, **change}
    with pytest.raises(error, match=name):
        fused_router(**args)


@pytest.mark.parametrize(("change", "error", "name"), [
    ({"norm": FakeCupyArray((63,), BF16)}, ValueError, "norm"),
    ({"norm": FakeCupyArray((64,), np.float32)}, TypeError, "norm"),
    ({"moe_in": FakeCupyArray((3, 64), BF16)}, ValueError, "moe_in"),
    ({"norm": FakeCupyArray((64,), BF16), "moe_in": FakeCupyArray((3, 72), BF16)}, ValueError, "moe_in"),
    ({"norm": FakeCupyArray((64,), BF16), "moe_in": FakeCupyArray((3, 64), np.float32)}, TypeError, "moe_in"),
    ({"eps": "x"}, TypeError, "eps"),
    ({"eps": 2.0}, ValueError, "eps"),
    ({"PDL": 2}, ValueError, "PDL"),
    ({"NORM": 1}, ValueError, "NORM"),
    ({"UNROLL": 2.5}, TypeError, "UNROLL"),
], ids=lambda v: None if isinstance(v, dict | type) else str(v)[:24])
def test_checks_refuse_norm_arguments(change: dict[str, Any], error: type, name: str) -> None:
    h, w = _fakes()
    with pytest.raises(error, match=name):
        fused_router(h, w, 4, **change)


def test_checks_refuse_non_contiguous() -> None:
    h, w = _fakes()
    h.flags = type("Flags", (), {"c_contiguous": False})()
    with pytest.raises(ValueError, match="h must be C-contiguous"):
        fused_router(h, w, 4)


# ---------------------------------------------------------------------------------------------------
# GPU (H200)
# ---------------------------------------------------------------------------------------------------


def _poisoned(cupy: Any, tokens: int, top_k: int) -> tuple[Any, Any]:
    ids = cupy.full((tokens, top_k), -12345, dtype=np.int32)
    weights = cupy.full((tokens, top_k), np.nan, dtype=np.float32)
    return ids, weights


@pytest.mark.gpu
@pytest.mark.parametrize("hidden", [2048, 4096], ids=["qwen3-30b", "qwen3-235b"])
@pytest.mark.parametrize("tokens", [1, 7, 64])
def test_gpu_matches_reference_and_repeats(cupy_mod: Any, rng: np.random.Generator, hidden: int,
                                           tokens: int) -> None:
    cupy, experts, top_k = cupy_mod, 128, 8
    h, w = _inputs(rng, tokens, hidden, experts)
    h_d, w_d = cupy.asarray(h), cupy.asarray(w)
    ids, weights = _poisoned(cupy, tokens, top_k)
    got = fused_router(h_d, w_d, top_k, True, ids, weights)
    assert got[0] is ids and got[1] is weights
    first = (cupy.asnumpy(ids), cupy.asnumpy(weights))
    _check(h, w, top_k, True, *first)
    workspace = make_router_workspace(tokens, experts)
    for _ in range(3):  # a workspace of its own, reused: its tickets come back to 0 each time
        ids.fill(-12345)
        weights.fill(np.nan)
        fused_router(h_d, w_d, top_k, True, ids, weights, workspace)
        assert np.array_equal(cupy.asnumpy(ids), first[0])
        assert np.array_equal(cupy.asnumpy(weights).view(np.uint32), first[1].view(np.uint32))  # bitwise
        assert not cupy.asnumpy(workspace.tickets).any()
    new_ids, new_weights = fused_router(h_d, w_d, top_k, norm_topk_prob=False)
    _check(h, w, top_k, False, cupy.asnumpy(new_ids), cupy.asnumpy(new_weights))


@pytest.mark.gpu
def test_gpu_graph_capture_replays_on_new_inputs(cupy_mod: Any, rng: np.random.Generator) -> None:
    cupy, tokens, hidden, experts, top_k = cupy_mod, 7, 2048, 128, 8
    h, w = _inputs(rng, tokens, hidden, experts)
    h_d, w_d = cupy.asarray(h), cupy.asarray(w)
    ids, weights = _poisoned(cupy, tokens, top_k)
    workspace = make_router_workspace(tokens, experts)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        fused_router(h_d, w_d, top_k, True, ids, weights, workspace)  # compiles outside the capture
        stream.synchronize()
        stream.begin_capture()
        fused_router(h_d, w_d, top_k, True, ids, weights, workspace)
        graph = stream.end_capture()
        for _ in range(2):
            h, w = _inputs(rng, tokens, hidden, experts)
            h_d.set(h)
            w_d.set(w)
            ids.fill(-12345)
            weights.fill(np.nan)
            graph.launch(stream)
            stream.synchronize()
            _check(h, w, top_k, True, cupy.asnumpy(ids), cupy.asnumpy(weights))
            assert not cupy.asnumpy(workspace.tickets).any()


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", [0, 1], ids=["plain", "pdl"])
@pytest.mark.parametrize("tokens", [1, 4, 64])
def test_gpu_norm_prologue_bitwise_twin(cupy_mod: Any, rng: np.random.Generator, tokens: int, pdl: int) -> None:
    """The fused post-attention norm at qwen3-30b (H 2048, E 128, K 8): ids, weights and moe_in bitwise the NumPy
    twin's, over poisoned outputs, three times; with PDL after a plain launch that writes h (the wait holds)."""
    cupy, hidden, experts, top_k = cupy_mod, 2048, 128, 8
    h, w = _inputs(rng, tokens, hidden, experts)
    g = (1.0 + 0.05 * rng.standard_normal(hidden)).astype(BF16)
    xn, _, want_ids, want_weights = _twin(h, w, top_k, True, g)
    h_d, w_d, g_d = cupy.zeros(h.shape, BF16), cupy.asarray(w), cupy.asarray(g)
    src = cupy.asarray(h)
    moe_in = cupy.empty((tokens, hidden), BF16)
    workspace = make_router_workspace(tokens, experts)
    for _ in range(3):
        ids, weights = _poisoned(cupy, tokens, top_k)
        moe_in.view(cupy.uint16).fill(0x7FC0)
        h_d.view(cupy.uint16).fill(0x7FC0)
        h_d[...] = src  # the kernel right before the router writes h
        fused_router(h_d, w_d, top_k, True, ids, weights, workspace, norm=g_d, moe_in=moe_in,
                     PDL=pdl)
        cupy.cuda.runtime.deviceSynchronize()
        np.testing.assert_array_equal(cupy.asnumpy(ids), want_ids)
        np.testing.assert_array_equal(cupy.asnumpy(weights).view(np.uint32), want_weights.view(np.uint32))
        np.testing.assert_array_equal(cupy.asnumpy(moe_in).view(np.uint16), xn.view(np.uint16))
        assert not cupy.asnumpy(workspace.tickets).any()
