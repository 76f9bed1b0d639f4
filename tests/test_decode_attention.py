"""Decode attention (kernels/decode/attention.py): offline compile, the CUDA C emulated on the CPU bitwise against the
contract's NumPy order (kernels.numerics: head_norm_rope, chunked_attention, exp_rn), the input checks, and GPU tests
(H200)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from kernels.arrays import BF16
from kernels.compile import offline_report
from kernels.decode import decode_attention, qk_norm_rope_append, rope_tables
from kernels.decode.attention import (
    ATTENTION,
    ATTENTION_SOURCE,
    MAX_SHARED,
    ROPE,
    ROPE_SOURCE,
    AttentionWorkspace,
    attention_shared_bytes,
    attention_stage,
    check_attention_inputs,
    check_rope_inputs,
    make_attention_workspace,
    qk_rope_stage,
)
from kernels.decode.device import EXP_RN
from kernels.decode_reference import gqa_attention, rope
from kernels.device_helpers import WARP_HELPERS
from kernels.numerics import attention_partials, bf16_to_f32, chunked_attention, exp_rn, head_norm_rope
from tests.warp_checks import (
    BLOCK_EMULATION,
    EMULATION_LOAD,
    EMULATION_PRELUDE,
    FakeCupyArray,
    build_emulator,
    run_emulator,
)

EPS = 1e-6


def _bf16(rng: np.random.Generator, *shape: int, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(BF16)


def _attention_expect(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, lengths: np.ndarray,
                      split: int) -> np.ndarray:
    """[T, heads * D] bf16: each sequence t over its lengths[t] + 1 positions in the contract's order."""
    tokens, heads, dim = q.shape
    out = np.empty((tokens, heads * dim), BF16)
    for t in range(tokens):
        n = int(lengths[t]) + 1
        keys, values = k_cache[t, :, :n].transpose(1, 0, 2), v_cache[t, :, :n].transpose(1, 0, 2)
        out[t] = chunked_attention(q[t], keys, values, split).reshape(-1)
    return out


# ---------------------------------------------------------------------------------------------------
# NumPy twins
# ---------------------------------------------------------------------------------------------------
def test_exp_rn_is_exp() -> None:
    x = np.linspace(-86.9, 88.0, 100001, dtype=np.float32)
    np.testing.assert_allclose(exp_rn(x), np.exp(x.astype(np.float64)), rtol=3e-7)
    assert exp_rn(np.float32(0.0)) == 1.0 and exp_rn(np.float32(-87.5)) == 0.0


def test_chunked_attention_is_attention(rng: np.random.Generator) -> None:
    """The contract's order computes attention (against float64), whatever the split."""
    q, keys, values = _bf16(rng, 8, 64), _bf16(rng, 300, 2, 64), _bf16(rng, 300, 2, 64)
    want = gqa_attention(bf16_to_f32(q).astype(np.float64), bf16_to_f32(keys).astype(np.float64),
                         bf16_to_f32(values).astype(np.float64))
    for split in (32, 64, 512):
        got = bf16_to_f32(chunked_attention(q, keys, values, split))
        np.testing.assert_allclose(got, want, rtol=1e-2, atol=2e-3)


def test_head_norm_rope_and_tables_match_the_reference(rng: np.random.Generator) -> None:
    cos, sin = rope_tables(100, 64, 1e6)
    positions = np.array([0, 5, 99])
    x = _bf16(rng, 3, 4, 64)
    ones = np.ones(64, BF16)
    got = bf16_to_f32(head_norm_rope(x, ones, cos[positions][:, None], sin[positions][:, None], EPS))
    xf = bf16_to_f32(x)
    normed = xf / np.sqrt((xf.astype(np.float64) ** 2).mean(-1, keepdims=True) + EPS)
    want = rope(normed.astype(np.float32), positions, 1e6)
    np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2)
    half = 32
    inv = 1e6 ** (-np.arange(half, dtype=np.float64) * 2.0 / 64)
    assert np.array_equal(cos[99], np.cos(99.0 * inv).astype(np.float32))
    assert cos.dtype == sin.dtype == np.float32 and cos.shape == (100, 32)


# ---------------------------------------------------------------------------------------------------
# Offline compile (NVRTC for sm_90, no GPU)
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("knobs", [{}, {"SPLIT": 32}, {"SPLIT": 128, "WARPS": 8}, {"SPLIT": 256, "WARPS": 16},
                                   {"PDL": 1}, {"WARPS": 1}],
                         ids=["defaults", "s32", "s128-w8", "s256-w16", "pdl", "w1"])
def test_attention_compiles_without_spills(knobs: dict[str, int]) -> None:
    (report,) = offline_report(ATTENTION_SOURCE, **ATTENTION.resolve(**knobs))
    assert report.kernel == "decode_attention"
    assert report.spills == 0 and report.stack_bytes == 0, report
    assert report.shared_bytes <= 16  # the last-block flag; the tiles are dynamic (attention_shared_bytes)


@pytest.mark.parametrize("knobs", [{}, {"WARPS": 8}, {"WARPS": 32, "PDL": 1}], ids=["defaults", "w8", "w32-pdl"])
def test_rope_compiles_without_spills(knobs: dict[str, int]) -> None:
    (report,) = offline_report(ROPE_SOURCE, **ROPE.resolve(**knobs))
    assert report.kernel == "qk_norm_rope_append"
    assert report.spills == 0 and report.stack_bytes == 0 and report.shared_bytes == 0, report


def test_rules_refuse_what_cannot_run() -> None:
    with pytest.raises(ValueError, match="SPLIT"):
        ATTENTION.resolve(SPLIT=48)
    with pytest.raises(ValueError, match="SPLIT"):
        ATTENTION.resolve(SPLIT=16)
    with pytest.raises(ValueError, match="WARPS"):
        ATTENTION.resolve(WARPS=32)
    with pytest.raises(ValueError, match="PDL"):
        ROPE.resolve(PDL=2)
    with pytest.raises(ValueError, match="WARPS"):
        ROPE.resolve(WARPS=33)


def test_shared_memory_at_qwen3_and_the_limit() -> None:
    assert attention_shared_bytes(64, 128, 8) == 39936  # qwen3-30b: heads 32, kv_heads 4, D 128
    with pytest.raises(ValueError, match="SPLIT"):
        check = FakeCupyArray
        attention_stage(check((1, 32, 256), BF16), check((1, 2, 4096, 256), BF16), check((1, 2, 4096, 256), BF16),
                        check((1,), np.int32), check((1, 32 * 256), BF16), None, SPLIT=1024)


def test_sources_are_registered_for_the_compile_report() -> None:
    import subprocess
    import sys

    code = ("from tools.compile_report import load_sources; s = load_sources(); "
            "print('decode_attention' in s and 'decode_qk_rope' in s)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "True", done.stderr[-2000:]


# ---------------------------------------------------------------------------------------------------
# CPU: the CUDA C emulated (g++; every thread of a block a lane, blocks one after another)
# ---------------------------------------------------------------------------------------------------
EMULATION_EXTRAS = BLOCK_EMULATION + r"""
static uint4 attn_smem[256 * 1024 / 16];
"""

EXP_HARNESS = EMULATION_PRELUDE + EMULATION_EXTRAS + r"""
#include "kernel.cu"
""" + EMULATION_LOAD + r"""
int main(int argc, char** argv) {
    const size_t n = atoll(argv[1]);
    const std::string dir = argv[2];
    auto x = load<float>(dir + "/x.bin", n);
    for (auto& v : x) v = exp_rn(v);
    FILE* f = fopen((dir + "/y.bin").c_str(), "wb"); fwrite(x.data(), 4, n, f); fclose(f);
    return 0;
}
"""


def test_emulated_exp_rn_is_bitwise_numpy(rng: np.random.Generator, tmp_path: Any) -> None:
    x = np.concatenate([rng.uniform(-90, 90, 20000), rng.uniform(-1, 1, 20000), [0.0, -87.0, 88.0, 89.0, -86.99],
                        -np.abs(rng.standard_exponential(20000) * 5)]).astype(np.float32)
    binary = build_emulator(WARP_HELPERS + EXP_RN, EXP_HARNESS)
    x.tofile(tmp_path / "x.bin")
    run_emulator(binary, len(x), tmp_path)
    got = np.fromfile(tmp_path / "y.bin", np.float32)
    assert np.array_equal(got.view(np.uint32), exp_rn(x).view(np.uint32))


ROPE_HARNESS = EMULATION_PRELUDE + EMULATION_EXTRAS + r"""
#include "kernel.cu"
""" + EMULATION_LOAD + r"""
int main(int argc, char** argv) {
    const int T = atoi(argv[1]), H = atoi(argv[2]), KV = atoi(argv[3]), D = atoi(argv[4]), CAP = atoi(argv[5]);
    const unsigned eps_bits = (unsigned)strtoul(argv[6], nullptr, 10);
    const std::string dir = argv[7];
    const int P = atoi(argv[8]);
    const float eps = __uint_as_float(eps_bits);
    auto qkv = load<uint16_t>(dir + "/qkv.bin", (size_t)T * (H + 2 * KV) * D);
    auto qn = load<uint16_t>(dir + "/qn.bin", D), kn = load<uint16_t>(dir + "/kn.bin", D);
    auto cs = load<float>(dir + "/cos.bin", (size_t)P * D / 2), sn = load<float>(dir + "/sin.bin", (size_t)P * D / 2);
    auto lengths = load<int>(dir + "/lengths.bin", T);
    auto kc = load<uint16_t>(dir + "/kc.bin", (size_t)T * KV * CAP * D);
    auto vc = load<uint16_t>(dir + "/vc.bin", (size_t)T * KV * CAP * D);
    std::vector<uint16_t> qo((size_t)T * H * D, 0xFFFFu);
    const int rows = T * (H + 2 * KV), blocks = (rows + WARPS - 1) / WARPS;
    std::vector<std::unique_ptr<WarpCtx>> warps;
    for (int i = 0; i < WARPS; ++i) warps.emplace_back(new WarpCtx);
    EmuBarrier block_bar(WARPS * 32);
    g_block = &block_bar;
    gridDim.x = blocks;
    for (int b = blocks - 1; b >= 0; --b)
        run_lanes(WARPS * 32, [&](int l) {
            g_warp = warps[l / 32].get();
            threadIdx.x = l;
            blockIdx.x = (unsigned)b;
            qk_norm_rope_append((const bf16_t*)qkv.data(), (const bf16_t*)qn.data(), (const bf16_t*)kn.data(),
                                cs.data(), sn.data(), lengths.data(), (bf16_t*)qo.data(), (bf16_t*)kc.data(),
                                (bf16_t*)vc.data(), T, H, KV, D, CAP, eps);
        });
    FILE* f = fopen((dir + "/qo.bin").c_str(), "wb"); fwrite(qo.data(), 2, qo.size(), f); fclose(f);
    f = fopen((dir + "/kc_out.bin").c_str(), "wb"); fwrite(kc.data(), 2, kc.size(), f); fclose(f);
    f = fopen((dir + "/vc_out.bin").c_str(), "wb"); fwrite(vc.data(), 2, vc.size(), f); fclose(f);
    return 0;
}
"""


@pytest.mark.parametrize(("heads", "kv_heads", "dim", "knobs"), [
    (4, 2, 32, {"WARPS": 3}),     # D = 32: the partner element in lane i + 16 (a shuffle); rows across blocks
    (4, 1, 128, {}),              # qwen3's head_dim
    (2, 2, 256, {"WARPS": 1}),
    (3, 1, 64, {"WARPS": 2}),
], ids=["d32", "d128", "d256", "d64"])
def test_emulated_rope_matches_numpy(rng: np.random.Generator, tmp_path: Any, heads: int, kv_heads: int, dim: int,
                                     knobs: dict[str, int]) -> None:
    """q, k bitwise head_norm_rope at each token's position; v copied; nothing else in the caches touched; a token
    whose position lies past the cache gets NaN q rows and writes nothing."""
    tokens, capacity = 3, 40
    qkv = _bf16(rng, tokens, (heads + 2 * kv_heads) * dim, scale=3.0)
    q_norm, k_norm = _bf16(rng, dim), _bf16(rng, dim)
    cos, sin = rope_tables(capacity, dim, 1e6)
    lengths = np.array([0, 37, capacity], np.int32)[:tokens]
    k_cache, v_cache = _bf16(rng, tokens, kv_heads, capacity, dim), _bf16(rng, tokens, kv_heads, capacity, dim)
    params = ROPE.resolve(**knobs)
    binary = build_emulator(ROPE_SOURCE.render(**params), ROPE_HARNESS)
    for name, arr in {"qkv": qkv, "qn": q_norm, "kn": k_norm, "kc": k_cache, "vc": v_cache}.items():
        arr.view(np.uint16).tofile(tmp_path / f"{name}.bin")
    cos.tofile(tmp_path / "cos.bin")
    sin.tofile(tmp_path / "sin.bin")
    lengths.tofile(tmp_path / "lengths.bin")
    eps_bits = int(np.float32(EPS).view(np.uint32))
    run_emulator(binary, tokens, heads, kv_heads, dim, capacity, eps_bits, tmp_path, capacity)
    q_out = np.fromfile(tmp_path / "qo.bin", np.uint16).view(BF16).reshape(tokens, heads, dim)
    k_got = np.fromfile(tmp_path / "kc_out.bin", np.uint16).view(BF16).reshape(k_cache.shape)
    v_got = np.fromfile(tmp_path / "vc_out.bin", np.uint16).view(BF16).reshape(v_cache.shape)
    rows = qkv.reshape(tokens, heads + 2 * kv_heads, dim)
    k_want, v_want = k_cache.copy(), v_cache.copy()
    for t in range(tokens):
        pos = int(lengths[t])
        if pos >= capacity:
            assert np.isnan(bf16_to_f32(q_out[t])).all()
            continue
        c, s = cos[pos][None], sin[pos][None]
        want_q = head_norm_rope(rows[t, :heads], q_norm, c, s, EPS)
        assert np.array_equal(q_out[t].view(np.uint16), want_q.view(np.uint16))
        k_want[t, :, pos] = head_norm_rope(rows[t, heads : heads + kv_heads], k_norm, c, s, EPS)
        v_want[t, :, pos] = rows[t, heads + kv_heads :]
    assert np.array_equal(k_got.view(np.uint16), k_want.view(np.uint16))
    assert np.array_equal(v_got.view(np.uint16), v_want.view(np.uint16))


ATTENTION_HARNESS = EMULATION_PRELUDE + EMULATION_EXTRAS + r"""
#include "kernel.cu"
""" + EMULATION_LOAD + r"""
int main(int argc, char** argv) {
    const int T = atoi(argv[1]), H = atoi(argv[2]), KV = atoi(argv[3]), D = atoi(argv[4]), CAP = atoi(argv[5]);
    const int CH = atoi(argv[6]);
    const std::string dir = argv[7];
    const float scale = (float)(1.0 / sqrt((double)D));
    auto q = load<uint16_t>(dir + "/q.bin", (size_t)T * H * D);
    auto kc = load<uint16_t>(dir + "/kc.bin", (size_t)T * KV * CAP * D);
    auto vc = load<uint16_t>(dir + "/vc.bin", (size_t)T * KV * CAP * D);
    auto lengths = load<int>(dir + "/lengths.bin", T);
    std::vector<float> po((size_t)T * H * CH * D, __uint_as_float(0x7fc00000u));
    std::vector<float> pml((size_t)T * H * CH * 2, __uint_as_float(0x7fc00000u));
    std::vector<unsigned> tickets((size_t)T * KV, 0u);
    std::vector<uint16_t> out((size_t)T * H * D), first;
    const int threads = WARPS * 32;
    EmuBarrier block_bar(threads);
    g_block = &block_bar;
    std::vector<std::unique_ptr<WarpCtx>> warps;
    for (int i = 0; i < WARPS; ++i) warps.emplace_back(new WarpCtx);
    gridDim.x = CH; gridDim.y = KV; gridDim.z = T;
    // Two launches in different block orders (chunks ascending, then descending with the sequences interleaved):
    // another block takes each (sequence, kv head)'s last ticket; the tickets must come back to 0 in between.
    for (int launch = 0; launch < 2; ++launch) {
        std::fill(out.begin(), out.end(), (uint16_t)0xFFFFu);
        for (int i = 0; i < CH * KV * T; ++i) {
            int c, kvh, s;
            if (launch == 0) { s = i / (CH * KV); kvh = (i / CH) % KV; c = i % CH; }
            else { c = CH - 1 - i / (KV * T); s = (i / KV) % T; kvh = i % KV; }
            memset(attn_smem, 0xFF, sizeof(attn_smem));              // stale shared memory from the last block
            run_lanes(threads, [&](int l) {
                g_warp = warps[l / 32].get();
                threadIdx.x = l;
                blockIdx.x = (unsigned)c; blockIdx.y = (unsigned)kvh; blockIdx.z = (unsigned)s;
                decode_attention((const bf16_t*)q.data(), (const bf16_t*)kc.data(), (const bf16_t*)vc.data(),
                                 lengths.data(), (bf16_t*)out.data(), po.data(), pml.data(), tickets.data(),
                                 H, KV, D, CAP, CH, scale);
            });
        }
        for (size_t j = 0; j < tickets.size(); ++j)
            if (tickets[j] != 0u) { fprintf(stderr, "ticket %zu left at %u\n", j, tickets[j]); return 3; }
        if (launch == 0) first = out;
    }
    if (out != first) { fprintf(stderr, "the second launch differs from the first\n"); return 4; }
    FILE* f = fopen((dir + "/out.bin").c_str(), "wb"); fwrite(out.data(), 2, out.size(), f); fclose(f);
    f = fopen((dir + "/po.bin").c_str(), "wb"); fwrite(po.data(), 4, po.size(), f); fclose(f);
    f = fopen((dir + "/pml.bin").c_str(), "wb"); fwrite(pml.data(), 4, pml.size(), f); fclose(f);
    return 0;
}
"""


def _emulate_attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, lengths: np.ndarray,
                       max_length: int, tmp_path: Any, **knobs: int) -> np.ndarray:
    params = ATTENTION.resolve(**knobs)
    binary = build_emulator(ATTENTION_SOURCE.render(**params), ATTENTION_HARNESS)
    tokens, heads, dim = q.shape
    kv_heads, capacity = k_cache.shape[1], k_cache.shape[2]
    assert attention_shared_bytes(params["SPLIT"], dim, heads // kv_heads) <= 256 * 1024
    for name, arr in {"q": q, "kc": k_cache, "vc": v_cache}.items():
        arr.view(np.uint16).tofile(tmp_path / f"{name}.bin")
    lengths.astype(np.int32).tofile(tmp_path / "lengths.bin")
    chunks = -(-max_length // params["SPLIT"])
    run_emulator(binary, tokens, heads, kv_heads, dim, capacity, chunks, tmp_path)
    return np.fromfile(tmp_path / "out.bin", np.uint16).view(BF16).reshape(tokens, heads * dim)


@pytest.mark.parametrize(("heads", "kv_heads", "dim", "knobs"), [
    (16, 2, 32, {"SPLIT": 64, "WARPS": 2}),    # G = 8, the tiny preset's head_dim
    (2, 2, 64, {"SPLIT": 32, "WARPS": 3}),     # G = 1
    (8, 1, 128, {}),                           # G = 8, qwen3's head_dim, the defaults
], ids=["g8-d32-s64", "g1-d64-s32", "g8-d128-defaults"])
def test_emulated_attention_matches_numpy(rng: np.random.Generator, tmp_path: Any, heads: int, kv_heads: int,
                                          dim: int, knobs: dict[str, int]) -> None:
    """Sequences attending to 1, 31, 33 and 257 positions in one launch, and one whose length lies past the cache
    (NaN): bitwise chunked_attention; the outputs fully written, the same in two block orders, tickets back to 0."""
    attended = np.array([1, 31, 33, 257, 40])
    capacity = 264
    lengths = (attended - 1).astype(np.int32)
    lengths[-1] = capacity                                     # n = capacity + 1: refused in the kernel
    tokens = len(lengths)
    q = _bf16(rng, tokens, heads, dim)
    k_cache = _bf16(rng, tokens, kv_heads, capacity, dim, scale=2.0)   # scores of a few units: real softmax weights
    v_cache = _bf16(rng, tokens, kv_heads, capacity, dim)
    split = ATTENTION.resolve(**knobs)["SPLIT"]
    got = _emulate_attention(q, k_cache, v_cache, lengths, capacity, tmp_path, **knobs)
    want = _attention_expect(q[:-1], k_cache[:-1], v_cache[:-1], lengths[:-1], split)
    assert np.array_equal(got[:-1].view(np.uint16), want.view(np.uint16))
    assert np.isnan(bf16_to_f32(got[-1])).all()
    _check_partials(q, k_cache, v_cache, lengths[:-1], split, capacity, tmp_path)


def _check_partials(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, lengths: np.ndarray, split: int,
                    max_length: int, tmp_path: Any) -> None:
    """The workspace, FP32 bitwise (the bf16 output alone hides most order changes): each chunk's o_c and l_c, and
    a_c = exp_rn(m_c - M) where m_c was (the combine writes it over m_c)."""
    _, heads, dim = q.shape
    chunks = -(-max_length // split)
    partial_o = np.fromfile(tmp_path / "po.bin", np.float32).reshape(-1, heads, chunks, dim)
    partial_ml = np.fromfile(tmp_path / "pml.bin", np.float32).reshape(-1, heads, chunks, 2)
    for t, old in enumerate(lengths):
        n = int(old) + 1
        m, l_c, o = attention_partials(q[t], k_cache[t, :, :n].transpose(1, 0, 2), v_cache[t, :, :n].transpose(1, 0, 2),
                                       split)
        used = len(m)
        assert np.array_equal(partial_o[t, :, :used].view(np.uint32), o.transpose(1, 0, 2).view(np.uint32))
        assert np.array_equal(partial_ml[t, :, :used, 1].view(np.uint32), l_c.T.view(np.uint32))
        a = exp_rn(m - m.max(axis=0))
        assert np.array_equal(partial_ml[t, :, :used, 0].view(np.uint32), a.T.view(np.uint32))


@pytest.mark.slow
def test_emulated_attention_qwen3_group_many_chunks(rng: np.random.Generator, tmp_path: Any) -> None:
    """qwen3-30b's G = 8, D = 128 over 1000 positions (16 chunks, the last part-full) and a 2-position sequence;
    a workspace shorter than the cache (max_length 1024): a sequence past it is NaN."""
    heads, kv_heads, dim, capacity = 16, 2, 128, 1100
    lengths = np.array([999, 1, 1050], np.int32)
    q = _bf16(rng, 3, heads, dim)
    k_cache = _bf16(rng, 3, kv_heads, capacity, dim, scale=2.0)
    v_cache = _bf16(rng, 3, kv_heads, capacity, dim)
    got = _emulate_attention(q, k_cache, v_cache, lengths, 1024, tmp_path)
    want = _attention_expect(q[:2], k_cache[:2], v_cache[:2], lengths[:2], 64)
    assert np.array_equal(got[:2].view(np.uint16), want.view(np.uint16))
    assert np.isnan(bf16_to_f32(got[2])).all()
    _check_partials(q[:2], k_cache[:2], v_cache[:2], lengths[:2], 64, 1024, tmp_path)


# ---------------------------------------------------------------------------------------------------
# Input checks (CPU: they run before any device call)
# ---------------------------------------------------------------------------------------------------
def _attention_fakes(T: int = 3, H: int = 8, KV: int = 2, D: int = 64, cap: int = 100) -> dict[str, Any]:
    return {"q": FakeCupyArray((T, H, D), BF16), "k_cache": FakeCupyArray((T, KV, cap, D), BF16),
            "v_cache": FakeCupyArray((T, KV, cap, D), BF16), "lengths": FakeCupyArray((T,), np.int32),
            "out": FakeCupyArray((T, H * D), BF16), "workspace": None}


def _workspace(T: int = 3, H: int = 8, KV: int = 2, D: int = 64, chunks: int = 2,
               **changes: Any) -> AttentionWorkspace:
    parts = {"partial_o": FakeCupyArray((T, H, chunks, D), np.float32),
             "partial_ml": FakeCupyArray((T, H, chunks, 2), np.float32),
             "tickets": FakeCupyArray((T, KV), np.uint32), **changes}
    return AttentionWorkspace(**parts, params=ATTENTION.resolve())


def test_attention_checks_accept_good_inputs() -> None:
    assert check_attention_inputs(**_attention_fakes()) == (3, 8, 2, 64, 100)
    assert check_attention_inputs(**{**_attention_fakes(), "workspace": _workspace()}) == (3, 8, 2, 64, 100)


@pytest.mark.parametrize(("change", "error", "name"), [
    ({"q": np.zeros((3, 8, 64), BF16)}, TypeError, "q must be a cupy"),
    ({"q": FakeCupyArray((3, 8, 64), np.float16)}, TypeError, "q must have dtype"),
    ({"q": FakeCupyArray((3, 512), BF16)}, ValueError, "q must be"),
    ({"q": FakeCupyArray((3, 8, 48), BF16)}, ValueError, "head_dim"),
    ({"k_cache": FakeCupyArray((3, 3, 100, 64), BF16), "v_cache": FakeCupyArray((3, 3, 100, 64), BF16)},
     ValueError, "kv_heads"),
    ({"k_cache": FakeCupyArray((2, 2, 100, 64), BF16)}, ValueError, "k_cache must be"),
    ({"k_cache": FakeCupyArray((3, 2, 100, 32), BF16)}, ValueError, "k_cache must be"),
    ({"v_cache": FakeCupyArray((3, 2, 99, 64), BF16)}, ValueError, "v_cache must be"),
    ({"v_cache": FakeCupyArray((3, 2, 100, 64), np.float32)}, TypeError, "v_cache must have dtype"),
    ({"lengths": FakeCupyArray((3,), np.int64)}, TypeError, "lengths"),
    ({"lengths": FakeCupyArray((4,), np.int32)}, ValueError, "lengths"),
    ({"out": FakeCupyArray((3, 8, 64), BF16)}, ValueError, "out must be"),
    ({"out": FakeCupyArray((3, 512), np.float32)}, TypeError, "out must have dtype"),
    ({"workspace": object()}, TypeError, "workspace must be an AttentionWorkspace"),
    ({"workspace": _workspace(H=4)}, ValueError, "workspace.partial_o"),
    ({"workspace": _workspace(partial_ml=FakeCupyArray((3, 8, 3, 2), np.float32))}, ValueError,
     "workspace.partial_ml"),
    ({"workspace": _workspace(tickets=FakeCupyArray((3, 2), np.int32))}, TypeError, "workspace.tickets"),
    ({"workspace": _workspace(tickets=FakeCupyArray((3, 4), np.uint32))}, ValueError, "workspace.tickets"),
], ids=lambda v: None if isinstance(v, dict | type) else str(v)[:24])
def test_attention_checks_refuse(change: dict[str, Any], error: type, name: str) -> None:
    with pytest.raises(error, match=name):
        decode_attention(**{**_attention_fakes(), **change})


def test_attention_refuses_knobs_other_than_the_workspace() -> None:
    with pytest.raises(ValueError, match="SPLIT"):
        attention_stage(**{**_attention_fakes(), "workspace": _workspace()}, SPLIT=128)


def _rope_fakes(T: int = 3, H: int = 8, KV: int = 2, D: int = 64, cap: int = 100) -> dict[str, Any]:
    return {"qkv": FakeCupyArray((T, (H + 2 * KV) * D), BF16), "q_norm": FakeCupyArray((D,), BF16),
            "k_norm": FakeCupyArray((D,), BF16), "cos": FakeCupyArray((cap, D // 2), np.float32),
            "sin": FakeCupyArray((cap, D // 2), np.float32), "lengths": FakeCupyArray((T,), np.int32),
            "q_out": FakeCupyArray((T, H, D), BF16), "k_cache": FakeCupyArray((T, KV, cap, D), BF16),
            "v_cache": FakeCupyArray((T, KV, cap, D), BF16), "heads": H, "kv_heads": KV, "eps": 1e-6}


def test_rope_checks_accept_good_inputs() -> None:
    assert check_rope_inputs(**_rope_fakes()) == (3, 8, 2, 64, 100)


@pytest.mark.parametrize(("change", "error", "name"), [
    ({"heads": 7}, ValueError, "heads"),
    ({"kv_heads": 0}, ValueError, "kv_heads"),
    ({"heads": 8.0}, TypeError, "heads"),
    ({"eps": "x"}, TypeError, "eps"),
    ({"qkv": FakeCupyArray((3, 760), BF16)}, ValueError, "qkv"),
    ({"qkv": np.zeros((3, 768), BF16)}, TypeError, "qkv must be a cupy"),
    ({"q_norm": FakeCupyArray((32,), BF16)}, ValueError, "q_norm"),
    ({"k_norm": FakeCupyArray((64,), np.float32)}, TypeError, "k_norm"),
    ({"cos": FakeCupyArray((99, 32), np.float32)}, ValueError, "cos"),
    ({"sin": FakeCupyArray((100, 32), np.float64)}, TypeError, "sin"),
    ({"q_out": FakeCupyArray((3, 8, 48), BF16)}, ValueError, "head_dim"),
    ({"lengths": FakeCupyArray((2,), np.int32)}, ValueError, "lengths"),
    ({"k_cache": FakeCupyArray((3, 1, 100, 64), BF16)}, ValueError, "k_cache"),
    ({"v_cache": FakeCupyArray((3, 2, 101, 64), BF16)}, ValueError, "v_cache"),
], ids=lambda v: None if isinstance(v, dict | type) else str(v)[:24])
def test_rope_checks_refuse(change: dict[str, Any], error: type, name: str) -> None:
    with pytest.raises(error, match=name):
        qk_norm_rope_append(**{**_rope_fakes(), **change})


# ---------------------------------------------------------------------------------------------------
# GPU (H200)
# ---------------------------------------------------------------------------------------------------


def _poisoned(cupy: Any, *shape: int) -> Any:
    arr = cupy.empty(shape, dtype=BF16)
    arr.view(cupy.uint16).fill(0x7FC0)
    return arr


def _device_case(cupy: Any, rng: np.random.Generator, lengths: list[int], heads: int, kv_heads: int, dim: int,
                 capacity: int) -> dict[str, Any]:
    """Host and device arrays of one attention case (caches random where attended, q random)."""
    tokens = len(lengths)
    q = _bf16(rng, tokens, heads, dim)
    k_cache = cupy.empty((tokens, kv_heads, capacity, dim), dtype=BF16)
    v_cache = cupy.empty((tokens, kv_heads, capacity, dim), dtype=BF16)
    host_k = np.zeros((tokens, kv_heads, max(lengths) + 1, dim), BF16)
    host_v = np.zeros_like(host_k)
    for t, n in enumerate(lengths):  # only the attended rows: the rest stays uninitialized (never read)
        host_k[t, :, : n + 1] = _bf16(rng, kv_heads, n + 1, dim, scale=2.0)
        host_v[t, :, : n + 1] = _bf16(rng, kv_heads, n + 1, dim)
        k_cache[t, :, : n + 1] = cupy.asarray(host_k[t, :, : n + 1])
        v_cache[t, :, : n + 1] = cupy.asarray(host_v[t, :, : n + 1])
    return {"q": q, "k": host_k, "v": host_v, "lengths": np.asarray(lengths, np.int32), "q_d": cupy.asarray(q),
            "k_d": k_cache, "v_d": v_cache, "lengths_d": cupy.asarray(np.asarray(lengths, np.int32))}


@pytest.mark.gpu
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(32, 4, 128), (16, 16, 64), (64, 4, 256), (8, 4, 32),
                                                         (32, 16, 128)],
                         ids=["qwen3-30b", "g1-d64", "g16-d256", "tiny-g2-d32", "g2-d128"])
@pytest.mark.parametrize("knobs", [{}, {"SPLIT": 32, "WARPS": 2}, {"SPLIT": 256, "WARPS": 8}],
                         ids=["defaults", "s32-w2", "s256-w8"])
def test_gpu_matches_numpy_and_repeats(cupy_mod: Any, rng: np.random.Generator, heads: int, kv_heads: int, dim: int,
                                       knobs: dict[str, int]) -> None:
    cupy = cupy_mod
    case = _device_case(cupy, rng, [0, 30, 32, 256, 2047, 700, 63], heads, kv_heads, dim, 2100)
    tokens = len(case["lengths"])
    out = _poisoned(cupy, tokens, heads * dim)
    if attention_shared_bytes(ATTENTION.resolve(**knobs)["SPLIT"], dim, heads // kv_heads) > MAX_SHARED:
        with pytest.raises(ValueError, match="lower SPLIT"):  # SPLIT 256 at D 256, G 16: 292 KB of tiles
            decode_attention(case["q_d"], case["k_d"], case["v_d"], case["lengths_d"], out, **knobs)
        return
    assert decode_attention(case["q_d"], case["k_d"], case["v_d"], case["lengths_d"], out, **knobs) is out
    cupy.cuda.runtime.deviceSynchronize()
    split = ATTENTION.resolve(**knobs)["SPLIT"]
    want = _attention_expect(case["q"], case["k"], case["v"], case["lengths"], split)
    first = cupy.asnumpy(out)
    assert np.array_equal(first.view(np.uint16), want.view(np.uint16))
    workspace = make_attention_workspace(tokens, heads, kv_heads, dim, 2048, **knobs)
    for _ in range(3):  # a workspace of its own, reused: its tickets come back to 0 each time
        out.view(cupy.uint16).fill(0x7FC0)
        decode_attention(case["q_d"], case["k_d"], case["v_d"], case["lengths_d"], out, workspace)
        assert np.array_equal(cupy.asnumpy(out).view(np.uint16), first.view(np.uint16))
        assert not cupy.asnumpy(workspace.tickets).any()


@pytest.mark.gpu
@pytest.mark.parametrize("lengths", [[32767], [32767, 1, 4095, 20000, 32766, 100, 5000, 31] * 8],
                         ids=["t1-32768", "t64-mixed"])
def test_gpu_long_context(cupy_mod: Any, rng: np.random.Generator, lengths: list[int]) -> None:
    cupy, heads, kv_heads, dim = cupy_mod, 32, 4, 128
    case = _device_case(cupy, rng, lengths, heads, kv_heads, dim, 32768)
    tokens = len(lengths)
    out = _poisoned(cupy, tokens, heads * dim)
    workspace = make_attention_workspace(tokens, heads, kv_heads, dim, 32768)
    decode_attention(case["q_d"], case["k_d"], case["v_d"], case["lengths_d"], out, workspace)
    got = cupy.asnumpy(out)
    checked = range(tokens) if tokens == 1 else [0, 1, 2, 3, 5, 7, 12, 63]  # the NumPy order takes ~1 s a 32k row
    for t in checked:
        want = _attention_expect(case["q"][t : t + 1], case["k"][t : t + 1], case["v"][t : t + 1],
                                 case["lengths"][t : t + 1], 64)
        assert np.array_equal(got[t : t + 1].view(np.uint16), want.view(np.uint16)), t
    assert np.isfinite(bf16_to_f32(got)).all()


@pytest.mark.gpu
def test_gpu_graph_replays_with_new_inputs(cupy_mod: Any, rng: np.random.Generator) -> None:
    """One capture, replayed with new q, caches and lengths (longer sequences: more chunks) into a poisoned out."""
    cupy, heads, kv_heads, dim, capacity = cupy_mod, 32, 4, 128, 3000
    case = _device_case(cupy, rng, [10, 500, 2], heads, kv_heads, dim, capacity)
    out = _poisoned(cupy, 3, heads * dim)
    workspace = make_attention_workspace(3, heads, kv_heads, dim, capacity)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        launch = attention_stage(case["q_d"], case["k_d"], case["v_d"], case["lengths_d"], out, workspace)
        launch()
        stream.synchronize()
        stream.begin_capture()
        launch()
        graph = stream.end_capture()
        for lengths in ([2999, 0, 64], [1, 2047, 1500]):
            new = _device_case(cupy, rng, lengths, heads, kv_heads, dim, capacity)
            case["q_d"].set(new["q"])
            case["lengths_d"].set(new["lengths"])
            for t, n in enumerate(lengths):
                case["k_d"][t, :, : n + 1] = new["k_d"][t, :, : n + 1]
                case["v_d"][t, :, : n + 1] = new["v_d"][t, :, : n + 1]
            out.view(cupy.uint16).fill(0x7FC0)
            graph.launch(stream)
            stream.synchronize()
            want = _attention_expect(new["q"], new["k"], new["v"], new["lengths"], 64)
            assert np.array_equal(cupy.asnumpy(out).view(np.uint16), want.view(np.uint16))
            assert not cupy.asnumpy(workspace.tickets).any()


def _rope_case(cupy: Any, rng: np.random.Generator, tokens: int, heads: int, kv_heads: int, dim: int,
               capacity: int) -> dict[str, Any]:
    qkv = _bf16(rng, tokens, (heads + 2 * kv_heads) * dim, scale=3.0)
    q_norm, k_norm = _bf16(rng, dim), _bf16(rng, dim)
    cos, sin = rope_tables(capacity, dim, 1e6)
    return {"qkv": qkv, "q_norm": q_norm, "k_norm": k_norm, "cos": cos, "sin": sin, "qkv_d": cupy.asarray(qkv),
            "q_norm_d": cupy.asarray(q_norm), "k_norm_d": cupy.asarray(k_norm), "cos_d": cupy.asarray(cos),
            "sin_d": cupy.asarray(sin)}


@pytest.mark.gpu
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(32, 4, 128), (8, 4, 32), (16, 2, 256), (4, 4, 64)])
def test_gpu_rope_matches_numpy(cupy_mod: Any, rng: np.random.Generator, heads: int, kv_heads: int,
                                dim: int) -> None:
    cupy, tokens, capacity = cupy_mod, 64, 600
    case = _rope_case(cupy, rng, tokens, heads, kv_heads, dim, capacity)
    lengths = rng.integers(0, capacity, tokens).astype(np.int32)
    k_host, v_host = _bf16(rng, tokens, kv_heads, capacity, dim), _bf16(rng, tokens, kv_heads, capacity, dim)
    k_cache, v_cache = cupy.asarray(k_host), cupy.asarray(v_host)
    q_out = _poisoned(cupy, tokens, heads, dim)
    qk_norm_rope_append(case["qkv_d"], case["q_norm_d"], case["k_norm_d"], case["cos_d"], case["sin_d"],
                        cupy.asarray(lengths), q_out, k_cache, v_cache, heads=heads, kv_heads=kv_heads, eps=EPS)
    rows = case["qkv"].reshape(tokens, heads + 2 * kv_heads, dim)
    c, s = case["cos"][lengths][:, None], case["sin"][lengths][:, None]
    want_q = head_norm_rope(rows[:, :heads], case["q_norm"], c, s, EPS)
    assert np.array_equal(cupy.asnumpy(q_out).view(np.uint16), want_q.view(np.uint16))
    want_k = head_norm_rope(rows[:, heads : heads + kv_heads], case["k_norm"], c, s, EPS)
    k_host[np.arange(tokens), :, lengths] = want_k
    v_host[np.arange(tokens), :, lengths] = rows[:, heads + kv_heads :]
    assert np.array_equal(cupy.asnumpy(k_cache).view(np.uint16), k_host.view(np.uint16))
    assert np.array_equal(cupy.asnumpy(v_cache).view(np.uint16), v_host.view(np.uint16))


@pytest.mark.gpu
def test_gpu_pdl_chain_rope_then_attention(cupy_mod: Any, rng: np.random.Generator) -> None:
    """Layers of rope -> attention, each layer's qkv made from the previous attention's output (a copy kernel in
    between, so attention's q and new KV position are always the kernel right before's output): the PDL=1 graph,
    replayed with the outputs poisoned, equals the PDL=0 chain bitwise every time."""
    cupy, heads, kv_heads, dim, capacity, layers = cupy_mod, 32, 4, 128, 2100, 4
    tokens = 8
    lengths_h = np.array([0, 31, 32, 257, 2047, 1000, 64, 5], np.int32)
    lengths = cupy.asarray(lengths_h)
    case = _rope_case(cupy, rng, tokens, heads, kv_heads, dim, capacity)
    width = (heads + 2 * kv_heads) * dim
    history = [cupy.asarray(_bf16(rng, tokens, kv_heads, capacity, dim, scale=2.0)) for _ in range(2 * layers)]

    def run(pdl: int) -> tuple[Any, list[Any]]:
        caches = [h.copy() for h in history]
        qkv = case["qkv_d"].copy()
        q = _poisoned(cupy, tokens, heads, dim)
        out = _poisoned(cupy, tokens, heads * dim)
        workspace = make_attention_workspace(tokens, heads, kv_heads, dim, capacity, PDL=pdl)
        stages = []

        def feed() -> None:  # the next layer's qkv from this one's output, no allocation (capturable)
            qkv[:, : heads * dim] = out
            qkv[:, heads * dim :] = out[:, : width - heads * dim]

        for layer in range(layers):
            k_cache, v_cache = caches[2 * layer], caches[2 * layer + 1]
            stages.append(qk_rope_stage(qkv, case["q_norm_d"], case["k_norm_d"], case["cos_d"], case["sin_d"],
                                        lengths, q, k_cache, v_cache, heads=heads, kv_heads=kv_heads, eps=EPS,
                                        PDL=pdl))
            stages.append(attention_stage(q, k_cache, v_cache, lengths, out, workspace))
            stages.append(feed)

        return (out, caches, qkv, q), stages

    (out0, caches0, _, _), plain = run(0)
    for stage in plain:
        stage()
    cupy.cuda.runtime.deviceSynchronize()
    expect = cupy.asnumpy(out0).view(np.uint16).copy()
    expect_caches = [cupy.asnumpy(c).view(np.uint16) for c in caches0]
    assert np.isfinite(bf16_to_f32(cupy.asnumpy(out0))).all()
    (out1, caches1, qkv1, q1), pdl = run(1)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        for stage in pdl:  # compiled and allocated: the first run outside the capture
            stage()
        stream.synchronize()
        stream.begin_capture()
        for stage in pdl:
            stage()
        graph = stream.end_capture()
        for _ in range(10):
            for cache, original in zip(caches1, history, strict=True):
                cache[...] = original
            qkv1[...] = case["qkv_d"]
            out1.view(cupy.uint16).fill(0x7FC0)
            q1.view(cupy.uint16).fill(0x7FC0)
            graph.launch(stream)
            stream.synchronize()
            assert np.array_equal(cupy.asnumpy(out1).view(np.uint16), expect)
            for cache, want in zip(caches1, expect_caches, strict=True):
                assert np.array_equal(cupy.asnumpy(cache).view(np.uint16), want)


def test_scale_is_the_float64_one() -> None:
    assert np.float32(1.0 / math.sqrt(128)) == np.float32(1.0 / np.sqrt(np.float64(128)))


def test_a_nan_query_gives_a_nan_head_not_a_finite_one() -> None:
    """exp_rn keeps a NaN (a compare, not fminf): a NaN score makes its head's output NaN rather than weights of
    e^88; the other heads are untouched."""
    rng = np.random.default_rng(3)
    q = rng.standard_normal((4, 32)).astype(BF16)
    q[1, 5] = np.nan
    keys, values = (rng.standard_normal((40, 2, 32)).astype(BF16) for _ in range(2))
    out = bf16_to_f32(chunked_attention(q, keys, values, 32))
    assert np.isnan(out[1]).all() and np.isfinite(out[[0, 2, 3]]).all()
