"""Checks shared by the GPU tests of the warp-decode family (strict CuPy and batched): input stand-ins,
NaN-poisoned outputs, host references from the touched experts only, and the comparison rule.

The comparison rule is ``kernels.checks``' (``EXACT_ORDER``: every output within ``ulp(|ref|) + ulp(RMS(ref) / 4)``
of ``reference.moe_decode(mode="warp_decode")``, 85 % of them bitwise equal, rel-L2 against the fp64 oracle below
5e-3; ``OWN_ORDER`` for the tensor-core kernels).
"""

from __future__ import annotations

import atexit
import hashlib
import math
import os
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from kernels.checks import EXACT_ORDER, OWN_ORDER, check_output
from kernels.contract import BF16
from kernels.problem import Problem
from kernels.reference import moe_decode
from kernels.shapes import PRESETS, MoEShape

try:
    import fcntl
except ImportError:  # no flock (Windows): workers missing the same emulator at once both build it
    fcntl = None


class _Flags:
    c_contiguous = True


class FakeCupyArray:
    """Looks like a cupy.ndarray to the checks (module name, shape, dtype, flags); has no device memory."""

    __module__ = "cupy._fake"

    def __init__(self, shape: tuple[int, ...], dtype: Any) -> None:
        self.shape = tuple(shape)
        self.ndim = len(shape)
        self.dtype = np.dtype(dtype)
        self.flags = _Flags()


def _fake_inputs(T: int = 2, H: int = 16, I: int = 8, E: int = 3, K: int = 2) -> dict[str, FakeCupyArray]:
    return {
        "x": FakeCupyArray((T, H), BF16),
        "w13": FakeCupyArray((E, 2 * I, H), BF16),
        "w2": FakeCupyArray((E, H, I), BF16),
        "topk_ids": FakeCupyArray((T, K), np.int32),
        "topk_weights": FakeCupyArray((T, K), np.float32),
    }




def _seed(rng: np.random.Generator) -> int:
    return int(rng.integers(1, 2**30))


def _poisoned_out(cupy: Any, tokens: int, hidden: int, dtype: Any = BF16) -> Any:
    out = cupy.empty((tokens, hidden), dtype=dtype)
    if np.dtype(dtype) == BF16:
        out.view(cupy.uint16).fill(0x7FC0)  # bf16 NaN
    else:
        out.fill(np.nan)
    return out


def _token_slice(problem: Problem, start: int, stop: int) -> Problem:
    return Problem(
        problem.shape, stop - start, problem.seed, problem.routing, problem.x[start:stop], problem.w13, problem.w2,
        problem.topk_ids[start:stop], problem.topk_weights[start:stop],
    )


def _references(problem: Problem, out_dtype: Any = BF16) -> tuple[np.ndarray, np.ndarray]:
    """(reference warp_decode mode, fp64 oracle) on the host, from touched experts only.

    When chunks of tokens touch far fewer experts than the whole batch (the 20 GB presets at T=64), the
    tokens are split into chunks run in parallel threads (NumPy releases the GIL in its kernels), each
    copying back only its experts; otherwise one host copy and the two modes in two threads.
    """
    tokens, shape = problem.tokens, problem.shape
    chunks = max(1, min(8, os.cpu_count() or 1, tokens))
    step = math.ceil(tokens / chunks)
    if shape.experts < 4 * step * shape.top_k:  # chunks would touch (nearly) every expert anyway
        host = problem.compact()
        with ThreadPoolExecutor(2) as pool:
            faithful = pool.submit(moe_decode, *host.arrays, mode="warp_decode", out_dtype=out_dtype)
            oracle = pool.submit(moe_decode, *host.arrays, mode="fp64")
            return faithful.result(), oracle.result()
    # keep the host copies of concurrently handled chunks under ~32 GB (deepseek-v3: 88 MB per expert)
    per_chunk = min(shape.experts, step * shape.top_k) * shape.expert_bytes
    workers = max(1, min(chunks, int(32e9 // max(1, per_chunk))))

    def run(start: int) -> tuple[np.ndarray, np.ndarray]:
        host = _token_slice(problem, start, min(tokens, start + step)).compact()
        return (
            moe_decode(*host.arrays, mode="warp_decode", out_dtype=out_dtype),
            moe_decode(*host.arrays, mode="fp64"),
        )

    with ThreadPoolExecutor(workers) as pool:
        parts = list(pool.map(run, range(0, tokens, step)))
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def _assert_matches(got: np.ndarray, faithful: np.ndarray, oracle: np.ndarray, what: str,
                    own_order: bool = False) -> dict[str, float]:
    """The one output checker (``kernels.checks``) under ``EXACT_ORDER``, or ``OWN_ORDER`` for kernels that sum in
    an order of their own (the tensor-core kernels: an mma adds 16 products at once, so some intermediate elements
    round to the neighbouring bf16 value); fails with the checker's reason."""
    assert got.shape == faithful.shape, what
    record = check_output(got, faithful, OWN_ORDER if own_order else EXACT_ORDER, oracle=oracle)
    assert record["ok"], f"{what}: {record['why']}"
    return {"bitwise": record["bitwise_fraction"], "rel_l2": record["rel_l2_fp64"]}


def assert_graph_replays_bitwise(cupy: Any, launch: Any, problem: Problem, expect: np.ndarray, launches: int = 4,
                                 replays: int = 2) -> None:
    """``launches`` calls of ``launch`` (compiled outside the capture) captured as one CUDA graph and replayed
    ``replays`` times into a NaN-poisoned output: bitwise ``expect`` (the eager result) every time."""
    got = _poisoned_out(cupy, problem.tokens, problem.shape.hidden)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        launch(*problem.arrays, got)
        stream.synchronize()
        stream.begin_capture()
        for _ in range(launches):
            launch(*problem.arrays, got)
        graph = stream.end_capture()
    for _ in range(replays):
        with stream:  # the poison on the replay's stream: a non-blocking stream does not wait for the legacy one
            got.view(cupy.uint16).fill(0x7FC0)
            graph.launch(stream)
        stream.synchronize()
        assert np.array_equal(cupy.asnumpy(got).view(np.uint16), expect.view(np.uint16))


def assert_pdl_chain_bitwise(cupy: Any, problem: Problem, build: Any, dims: Any, poison_workspace: Any,
                             routings: list[tuple[Any, Any]] | None = None, layers: int = 6, replays: int = 20,
                             **params: Any) -> None:
    """A decode step's true dependency chain under PDL: layer l + 1's x is layer l's output and every layer shares
    one workspace, poisoned before every replay by ``poison_workspace(launch)``. A load hoisted above
    griddepcontrol.wait (the H200 caught the compiler doing this to __ldg loads of the intermediate), or a kernel
    overwriting what the previous layer still reads, gives other bits: the PDL=1 graph, replayed ``replays`` times,
    must equal the PDL=0 chain bitwise every time. ``routings``: one (ids, weights) per layer, else the problem's;
    ``build(dims, PDL=..., **params)`` returns a launch with ``.params`` and ``.workspace``."""
    if routings is None:
        routings = [(problem.topk_ids, problem.topk_weights)] * layers
    buffers = [_poisoned_out(cupy, dims.tokens, dims.hidden) for _ in range(2)]
    sequence = [(problem.x if layer == 0 else buffers[(layer - 1) % 2], buffers[layer % 2], *routings[layer])
                for layer in range(layers)]
    plain = build(dims, PDL=0, **params)
    for x, out, ids, weights in sequence:
        plain(x, problem.w13, problem.w2, ids, weights, out)
    cupy.cuda.runtime.deviceSynchronize()
    expect = sequence[-1][1].view(cupy.uint16).copy()
    assert bool(cupy.isfinite(sequence[-1][1].astype(cupy.float32)).all())
    pdl = build(dims, PDL=1, **params)
    assert pdl.params["PDL"] == 1
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        for x, out, ids, weights in sequence:
            pdl(x, problem.w13, problem.w2, ids, weights, out)
        graph = stream.end_capture()
        for _ in range(replays):
            for buffer in buffers:
                buffer.view(cupy.uint16).fill(0x7FC0)
            poison_workspace(pdl)
            graph.launch(stream)
            stream.synchronize()
            assert bool((sequence[-1][1].view(cupy.uint16) == expect).all())


ROUTINGS = {  # name -> (routing for tiny [K=2], routing for qwen3-30b [K=8]); lists repeat ids on purpose
    "uniform": ("uniform", "uniform"),
    "zipf": ("zipf", "zipf"),
    "same": ("same", "same"),
    "fixed-dup": ([0, 0], [7, 7, 7, 1, 2, 3, 4, 7]),
    "fixed-per-token": ([[5, 5], [0, 1], [2, 2], [3, 0], [1, 1], [4, 4]], [[127] * 8] + [list(range(8))] * 5),
}


ODD_SHAPES = {
    "h8-i8-e1-k1": MoEShape("h8-i8-e1-k1", 8, 8, 1, 1),
    "h136-tiny": PRESETS["tiny"],
    "h264-i40": MoEShape("h264-i40", 264, 40, 3, 2),  # H, I not multiples of 256; lanes partly idle
    "h2880-i264": MoEShape("h2880-i264", 2880, 264, 5, 3),
    "h64-k40": MoEShape("h64-k40", 64, 32, 48, 40),  # K > 32: several slot batches, ids beyond lane 31
    "h1032-i520-k1": MoEShape("h1032-i520-k1", 1032, 520, 4, 1),
}


# ------------------------------------------------------------------------------------------------
# The g++ emulation of the CUDA C (the real kernel text run on a CPU): what every harness shares.
# Every CUDA thread of a block is a lane (run_lanes), shuffles go through a per-warp barrier (EmuBarrier); each test
# file adds its kernels' extras (block barrier, shared memory, ...) after EMULATION_PRELUDE, then
# '#include "kernel.cu"', then its launch and main. WD_HOST_EMULATION swaps the sources' inline PTX for plain C++
# (kernels/device_helpers.py).
# Lanes are fibers of one OS thread (their own stack switch on x86-64, else ucontext): a lane that waits at a barrier
# switches straight to the next lane that can run. With one std::thread per lane (the form under AddressSanitizer,
# WD_EMU_OS_THREADS) each barrier was a round of kernel context switches: 70 % of an emulation's time went to the
# system (4 million switches in 9 s for one tensor-core case).
# ------------------------------------------------------------------------------------------------
EMULATION_HEADERS = r"""
#include <barrier>
#include <math.h>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>
#include <algorithm>
#include <ucontext.h>
#if defined(__x86_64__)
#include <xmmintrin.h>
#endif
"""
EMULATION_PRELUDE = EMULATION_HEADERS + r"""#define WD_HOST_EMULATION 1
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__ __restrict
struct uint4 { unsigned x, y, z, w; };
struct uint2 { unsigned x, y; };
struct int2 { int x, y; };
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
inline uint2 make_uint2(unsigned a, unsigned b) { return {a, b}; }
inline int2 make_int2(int a, int b) { return {a, b}; }
struct Dim3 { unsigned x = 0, y = 0, z = 0; };
thread_local Dim3 threadIdx, blockIdx;
Dim3 gridDim;  // set by launch() before its threads start
struct WarpCtx;
thread_local WarpCtx* g_warp = nullptr;
// The GPU's FP32 arithmetic flushes subnormals to zero, inputs and results (CuPy compiles every kernel with -ftz=true:
// kernels/compile.py), so the lanes run with the x86 MXCSR's FTZ and DAZ bits set (EmuFtz(true)), as the GPU's float
// operations do (double ones flush here too; the kernels' are not in that range). The shims of instructions that keep
// subnormals on the GPU (the mma, bf16x2 multiplies) run their arithmetic under EmuFtz(false). WD_EMU_NO_FTZ: off.
struct EmuFtz {
#if defined(__x86_64__) && !defined(WD_EMU_NO_FTZ)
    unsigned saved;
    explicit EmuFtz(bool on) : saved(_mm_getcsr()) { _mm_setcsr(on ? (saved | 0x8040u) : (saved & ~0x8040u)); }
    ~EmuFtz() { _mm_setcsr(saved); }
#else
    explicit EmuFtz(bool) {}
#endif
    EmuFtz(const EmuFtz&) = delete;
    EmuFtz& operator=(const EmuFtz&) = delete;
};
#ifdef WD_EMU_OS_THREADS
using EmuBarrier = std::barrier<>;
template <class F> void run_lanes(int n, F body) {  // body(l) for l in 0 .. n-1, one std::thread each
    std::vector<std::thread> pool;
    for (int l = 0; l < n; ++l) pool.emplace_back([&body, l] { EmuFtz ftz(true); body(l); });
    for (auto& t : pool) t.join();
}
#else
// Lanes as fibers: each has its own stack and its own threadIdx / blockIdx / g_warp, swapped in when it resumes.
// On x86-64 a switch pushes the callee-saved registers on the stack it leaves and pops the other's (glibc's
// swapcontext also saves the signal mask: a system call per switch, half of an emulation's time); elsewhere ucontext.
#if defined(__x86_64__)
struct EmuContext { void* sp = nullptr; };
extern "C" __attribute__((visibility("hidden"))) void emu_switch(void** save_sp, void* load_sp);
asm(".text\n.p2align 4\n.type emu_switch, @function\nemu_switch:\n"
    "  pushq %rbp\n  pushq %rbx\n  pushq %r12\n  pushq %r13\n  pushq %r14\n  pushq %r15\n"
    "  movq %rsp, (%rdi)\n  movq %rsi, %rsp\n"
    "  popq %r15\n  popq %r14\n  popq %r13\n  popq %r12\n  popq %rbx\n  popq %rbp\n  ret\n"
    ".size emu_switch, .-emu_switch\n");
inline void emu_swap(EmuContext* from, EmuContext* to) { emu_switch(&from->sp, to->sp); }
inline void emu_make(EmuContext* c, char* stack, size_t size, void (*fn)()) {  // fn runs from the first switch in
    void** sp = reinterpret_cast<void**>(reinterpret_cast<uintptr_t>(stack + size) & ~uintptr_t(15));
    *--sp = nullptr;                               // fn's return address (it never returns): entered as if called
    *--sp = reinterpret_cast<void*>(fn);           // where emu_switch's ret goes
    for (int i = 0; i < 6; ++i) *--sp = nullptr;   // rbp, rbx, r12 .. r15
    c->sp = sp;
}
#else
struct EmuContext { ucontext_t uc; };
inline void emu_swap(EmuContext* from, EmuContext* to) { swapcontext(&from->uc, &to->uc); }
inline void emu_make(EmuContext* c, char* stack, size_t size, void (*fn)()) {
    getcontext(&c->uc);
    c->uc.uc_stack.ss_sp = stack;
    c->uc.uc_stack.ss_size = size;
    c->uc.uc_link = nullptr;
    makecontext(&c->uc, fn, 0);
}
#endif
struct EmuBarrier;
struct Lane {
    EmuContext ctx;
    std::unique_ptr<char[]> stack;
    Dim3 tid, bid;
    WarpCtx* warp = nullptr;
    const EmuBarrier* waiting = nullptr;  // the barrier it waits at, and that barrier's phase when it arrived
    unsigned long long phase = 0;
    bool done = false;
};
struct Lanes {
    std::vector<Lane> lanes;
    int current = -1;
    EmuContext main_ctx;
    void (*entry)(void*, int) = nullptr;
    void* body = nullptr;
};
inline Lanes g_lanes;
struct EmuBarrier {
    explicit EmuBarrier(std::ptrdiff_t n) : expected(n) {}
    void arrive_and_wait();
    std::ptrdiff_t expected, count = 0;
    unsigned long long phase = 0;
};
inline bool lane_runnable(const Lane& f) { return !f.done && (!f.waiting || f.waiting->phase != f.phase); }
inline void resume_lane(int j, EmuContext* from) {  // switch to lane j, its CUDA registers restored
    Lane& f = g_lanes.lanes[j];
    g_lanes.current = j;
    threadIdx = f.tid;
    blockIdx = f.bid;
    g_warp = f.warp;
    emu_swap(from, &f.ctx);
}
inline int next_runnable(int after) {
    const int n = (int)g_lanes.lanes.size();
    for (int s = 1; s <= n; ++s)
        if (lane_runnable(g_lanes.lanes[(after + s) % n])) return (after + s) % n;
    return -1;
}
inline void EmuBarrier::arrive_and_wait() {
    if (++count == expected) {  // the last to arrive opens the barrier and runs on
        count = 0;
        ++phase;
        return;
    }
    const int me = g_lanes.current;
    Lane& self = g_lanes.lanes[me];
    self.waiting = this;
    self.phase = phase;
    self.tid = threadIdx;
    self.bid = blockIdx;
    self.warp = g_warp;
    while (phase == self.phase) {
        const int j = next_runnable(me);
        if (j < 0) { fprintf(stderr, "emulation deadlock: every lane waits at a barrier\n"); abort(); }
        resume_lane(j, &self.ctx);
    }
    self.waiting = nullptr;
}
inline void lane_entry() {  // a fiber's first frame: its lane's body, then back to run_lanes for good
    const int l = g_lanes.current;
    g_lanes.entry(g_lanes.body, l);
    g_lanes.lanes[l].done = true;
    EmuContext finished;
    emu_swap(&finished, &g_lanes.main_ctx);
}
template <class F> void run_lanes(int n, F body) {  // body(l) for l in 0 .. n-1, cooperatively
    constexpr size_t kStack = 256 * 1024;
    EmuFtz ftz(true);  // the lanes' FP32 as the GPU's (one OS thread: the switches leave the MXCSR alone)
    g_lanes.lanes.resize(n);  // the last call's lanes kept with their stacks: a block allocates none
    g_lanes.body = &body;
    g_lanes.entry = [](void* b, int l) { (*static_cast<F*>(b))(l); };
    for (int l = 0; l < n; ++l) {
        Lane& f = g_lanes.lanes[l];
        if (!f.stack) f.stack.reset(new char[kStack]);
        f.tid = Dim3{};
        f.bid = Dim3{};
        f.warp = nullptr;
        f.waiting = nullptr;
        f.phase = 0;
        f.done = false;
        emu_make(&f.ctx, f.stack.get(), kStack, lane_entry);
    }
    for (int j = n - 1; (j = next_runnable(j)) >= 0;) resume_lane(j, &g_lanes.main_ctx);  // till every lane ends
    for (const Lane& f : g_lanes.lanes)
        if (!f.done) { fprintf(stderr, "emulation deadlock: a lane never finished\n"); abort(); }
}
#endif
struct WarpCtx { EmuBarrier bar{32}; uint32_t slots[32]; uint32_t frags[32][6]; };  // frags: emulated mma
template <class T> inline T __ldg(const T* p) { return *p; }
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline float __int_as_float(int u) { float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
template <class T> inline T exchange(T v, int src) {
    const int lane = threadIdx.x & 31;
    std::memcpy(&g_warp->slots[lane], &v, 4);
    g_warp->bar.arrive_and_wait();
    T r; std::memcpy(&r, &g_warp->slots[src & 31], 4);
    g_warp->bar.arrive_and_wait();
    return r;
}
template <class T> inline T __shfl_sync(unsigned, T v, int src) { return exchange(v, src); }
template <class T> inline T __shfl_xor_sync(unsigned, T v, int m) { return exchange(v, (int)(threadIdx.x & 31) ^ m); }
template <class T> inline void exchange_all(T v, T (&all)[32]) {  // every lane's v, in one round of the warp
    std::memcpy(&g_warp->slots[threadIdx.x & 31], &v, 4);
    g_warp->bar.arrive_and_wait();
    for (int l = 0; l < 32; ++l) std::memcpy(&all[l], &g_warp->slots[l], 4);
    g_warp->bar.arrive_and_wait();
}
inline bool __any_sync(unsigned, bool p) {
    int all[32];
    exchange_all((int)p, all);
    int any = 0;
    for (int l = 0; l < 32; ++l) any |= all[l];
    return any != 0;
}
using std::min;
"""

# mma.sync for the tensor-core kernels' harnesses (after EMULATION_PRELUDE, before '#include "kernel.cu"')
EMULATED_MMA = r"""
// mma.sync.m16n8k16 (bf16 in, fp32 accumulate) for the tensor-core kernels: every lane publishes its six fragment
// registers (a0..a3, b0, b1) in the warp's frags, then lane (g, q) computes D rows g, g+8 x columns 2q, 2q+1 from
// the PTX ISA layout: A[m][k] in lane (m%8)*4 + (k%8)/2, register (m >= 8) + 2 (k >= 8); B[k][n] in lane
// n*4 + (k%8)/2, register (k >= 8); the low half of a register is the even k
inline void emulated_mma_16816(float (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0,
                               unsigned b1) {
    const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    uint32_t* mine = g_warp->frags[lane];
    mine[0] = a0; mine[1] = a1; mine[2] = a2; mine[3] = a3; mine[4] = b0; mine[5] = b1;
    g_warp->bar.arrive_and_wait();
    auto half = [](unsigned w, int k) { return __uint_as_float(k % 2 ? (w & 0xffff0000u) : (w << 16)); };
    auto a_el = [&](int m, int k) {
        return half(g_warp->frags[(m % 8) * 4 + (k % 8) / 2][(m < 8 ? 0 : 1) + (k < 8 ? 0 : 2)], k);
    };
    auto b_el = [&](int k, int n) { return half(g_warp->frags[n * 4 + (k % 8) / 2][4 + (k < 8 ? 0 : 1)], k); };
    float sums[4];
    {
        EmuFtz keep(false);  // the tensor cores keep subnormal inputs (notes/diag_mma_subnormals.py)
        for (int r = 0; r < 4; ++r) {
            const int m = g + (r >= 2 ? 8 : 0), n = 2 * q + (r & 1);
            float sum = 0.0f;
            for (int k = 0; k < 16; ++k) sum = fmaf(a_el(m, k), b_el(k, n), sum);
            sums[r] = sum;
        }
        for (int r = 0; r < 4; ++r) sums[r] = d[r] + sums[r];
    }
    g_warp->bar.arrive_and_wait();  // every lane has read the fragments before any lane's next mma writes
    for (int r = 0; r < 4; ++r) d[r] = sums[r];
}
"""

# After EMULATION_PRELUDE, for a whole-block emulation of any kernel (tests/emulated_device.py): the block barrier,
# static and dynamic shared memory (blocks run one at a time, so a static __shared__ is one array, and every block's
# dynamic shared memory is g_dynamic_smem, 256 KiB: more than a block may have), atomics (lanes are fibers of one CPU
# thread: plain read-modify-write), the rounding intrinsics (-ffp-contract=off: each operation rounded once), the
# warp votes and the tensor-core mma. The sources that hide their dynamic shared array from the host emulation read
# wdb_dynamic_shared instead.
BLOCK_EMULATION = r"""
#define __shared__ static
#define __maxnreg__(...)
struct float4 { float x, y, z, w; };
struct float2 { float x, y; };
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
inline float2 make_float2(float a, float b) { return {a, b}; }
Dim3 blockDim;  // set by the launch, as gridDim
EmuBarrier* g_block = nullptr;
inline void __syncthreads() { g_block->arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) { g_warp->bar.arrive_and_wait(); }
inline void __threadfence() {}
inline void __threadfence_block() {}
inline unsigned atomicAdd(unsigned* p, unsigned v) { const unsigned old = *p; *p = old + v; return old; }
inline int atomicAdd(int* p, int v) { const int old = *p; *p = old + v; return old; }
inline float atomicAdd(float* p, float v) { const float old = *p; *p = old + v; return old; }
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
    const unsigned long long old = *p; *p = old + v; return old;
}
inline unsigned atomicSub(unsigned* p, unsigned v) { const unsigned old = *p; *p = old - v; return old; }
inline int atomicSub(int* p, int v) { const int old = *p; *p = old - v; return old; }
template <class T> inline T atomicExch(T* p, T v) { const T old = *p; *p = v; return old; }
template <class T> inline T atomicCAS(T* p, T cmp, T v) { const T old = *p; if (old == cmp) *p = v; return old; }
template <class T> inline T atomicMax(T* p, T v) { const T old = *p; if (v > old) *p = v; return old; }
template <class T> inline T atomicMin(T* p, T v) { const T old = *p; if (v < old) *p = v; return old; }
template <class T> inline T __ldcg(const T* p) { return *p; }
template <class T> inline T __ldcs(const T* p) { return *p; }
template <class T> inline T __ldlu(const T* p) { return *p; }
template <class T> inline void __stcg(T* p, T v) { *p = v; }
template <class T> inline void __stcs(T* p, T v) { *p = v; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return sqrtf(a); }
inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline int __clz(int v) { return v == 0 ? 32 : __builtin_clz((unsigned)v); }
inline int __ffs(int v) { return __builtin_ffs(v); }
inline unsigned __ballot_sync(unsigned, int p) {
    int all[32];
    exchange_all((int)(p != 0), all);
    unsigned mask = 0;
    for (int l = 0; l < 32; ++l) mask |= (unsigned)all[l] << l;
    return mask;
}
inline bool __all_sync(unsigned, int p) { return __ballot_sync(0xffffffffu, p) == 0xffffffffu; }
inline unsigned __match_any_sync(unsigned, int v) {
    int all[32];
    exchange_all(v, all);
    unsigned mask = 0;
    for (int l = 0; l < 32; ++l) mask |= (unsigned)(all[l] == v) << l;
    return mask;
}
alignas(256) inline unsigned char g_dynamic_smem[256 * 1024];
float* const wdb_dynamic_shared = reinterpret_cast<float*>(g_dynamic_smem);
""" + EMULATED_MMA

# after '#include "kernel.cu"': reading the inputs the Python side wrote
EMULATION_LOAD = r"""
template <class T> std::vector<T> load(const std::string& path, size_t n) {
    std::vector<T> v(n);
    FILE* f = fopen(path.c_str(), "rb");
    if (!f || fread(v.data(), sizeof(T), n, f) != n) { perror(path.c_str()); exit(2); }
    fclose(f);
    return v;
}
"""

# a launch for kernels without block-level cooperation: 32 lane threads walk the warps in lockstep
WARP_LOCKSTEP_LAUNCH = r"""
template <class F> void launch(long long blocks, int threads, F body) {
    WarpCtx ctx;  // a barrier after each warp
    gridDim.x = (unsigned)blocks;
    run_lanes(32, [&](int l) {
        g_warp = &ctx;
        for (long long b = 0; b < blocks; ++b)
            for (int w = 0; w < threads / 32; ++w) {
                threadIdx.x = w * 32 + l;
                blockIdx.x = (unsigned)b;
                body();
                ctx.bar.arrive_and_wait();
            }
    });
}
"""


# ------------------------------------------------------------------------------------------------
# Building an emulator: g++ once per (kernel text, harness, defines) per test run
# ------------------------------------------------------------------------------------------------
# WD_EMULATION_SANITIZE=address builds the emulators under AddressSanitizer (the CPU's stand-in for compute-sanitizer
# memcheck: every device array is a vector of its exact size, so a kernel's out-of-bounds read aborts the test)
EMULATION_FLAGS = ("-std=c++20", "-Og", "-ffp-contract=off", "-pthread",
                   *(("-fsanitize=address", "-fno-omit-frame-pointer", "-DWD_EMU_OS_THREADS")
                     if os.environ.get("WD_EMULATION_SANITIZE") == "address" else ()))
# The folder the builds go to: the one tests/conftest.py makes for the run, which every pytest-xdist worker shares, or
# (outside pytest) a folder of this process's own, removed at exit.
EMULATOR_CACHE_ENV = "WD_EMULATOR_CACHE"
_EMULATORS: dict[tuple[str, ...], str] = {}
_PRECOMPILED: dict[tuple[str, ...], tuple[str, ...]] = {}  # build flags -> the g++ flags that use the precompiled
# EMULATION_HEADERS, once built
_OWN_FOLDER: list[str] = []


def _build_root() -> str:
    folder = os.environ.get(EMULATOR_CACHE_ENV)
    if folder:
        os.makedirs(folder, exist_ok=True)
        return folder
    if not _OWN_FOLDER:
        _OWN_FOLDER.append(tempfile.mkdtemp(prefix="emu_"))
        atexit.register(shutil.rmtree, _OWN_FOLDER[0], True)
    return _OWN_FOLDER[0]


def _built_once(key: tuple[str, ...], build: Any) -> str:
    """The folder in which ``build(folder)`` ran for ``key``: built once per build root (the run's, shared by every
    worker) -- a worker asking for a key another is building waits for it under a lock, and a build is moved into
    place whole, so no one runs a half-written binary. ``build`` raising leaves nothing behind."""
    root = _build_root()
    digest = hashlib.sha256("\0".join(key).encode()).hexdigest()[:32]
    final = os.path.join(root, digest)
    if os.path.isdir(final):
        return final
    with open(f"{final}.lock", "a") as lock:
        if fcntl is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.isdir(final):
            return final
        partial = tempfile.mkdtemp(prefix=f"{digest}.partial.", dir=root)
        try:
            build(partial)
            os.rename(partial, final)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            if not os.path.isdir(final):
                raise
    return final


def _precompiled_headers(flags: tuple[str, ...] = EMULATION_FLAGS) -> tuple[str, ...]:
    """EMULATION_HEADERS precompiled once per test run and set of g++ ``flags`` (g++ then skips parsing ~80k lines
    of the standard library per build, ~0.5 s of 1.2); ``()`` if that fails (every build then parses the headers
    itself, same binary)."""
    if flags not in _PRECOMPILED:
        def build(folder: str) -> None:
            with open(f"{folder}/emu_headers.h", "w") as f:
                f.write(EMULATION_HEADERS)
            command = ["g++", *flags, "-x", "c++-header", "emu_headers.h", "-o", "emu_headers.h.gch"]
            subprocess.run(command, cwd=folder, capture_output=True, text=True, timeout=300)

        folder = _built_once(("pch", EMULATION_HEADERS, *flags), build)
        usable = os.path.exists(f"{folder}/emu_headers.h.gch")
        _PRECOMPILED[flags] = ("-include", f"{folder}/emu_headers.h") if usable else ()
    return _PRECOMPILED[flags]


def build_emulator(kernel_text: str, harness: str, *defines: str) -> str:
    """The path of the g++-built emulator: ``harness`` (which ``#include "kernel.cu"``) with ``kernel_text`` as
    kernel.cu and ``defines`` (``-DNAME=value``) on the command line. Built once per distinct input per test run
    (however many workers ask), removed at its end; the test is skipped where g++ is missing."""
    return _build(kernel_text, harness, defines, EMULATION_FLAGS, "emu")


# a shared library loaded into the test's process (tests/emulated_device.py): position-independent, its symbols
# hidden but the entry points (each library keeps its own emulation state), no process-wide unique symbols
LIBRARY_FLAGS = (*EMULATION_FLAGS, "-fPIC", "-fvisibility=hidden", "-fno-gnu-unique")


def build_library(kernel_text: str, harness: str, *defines: str) -> str:
    """:func:`build_emulator`, but a shared library (``-shared``) for ctypes: the path of ``libemu.so``."""
    return _build(kernel_text, harness, defines, LIBRARY_FLAGS, "libemu.so", ("-shared",))


def _build(kernel_text: str, harness: str, defines: tuple[str, ...], flags: tuple[str, ...], output: str,
           link: tuple[str, ...] = ()) -> str:
    key = (kernel_text, harness, *defines, *flags, *link, output)
    binary = _EMULATORS.get(key)
    if binary is None:
        if shutil.which("g++") is None:
            pytest.skip("needs g++ (to run the CUDA C on the CPU)")
        headers = _precompiled_headers(flags)

        def build(folder: str) -> None:
            with open(f"{folder}/kernel.cu", "w") as f:
                f.write(kernel_text)
            with open(f"{folder}/harness.cpp", "w") as f:
                f.write(harness)
            done = subprocess.run(  # timeouts here and in run_emulator guard against hangs only (~1 s idle)
                ["g++", *flags, *headers, *defines, *link, "harness.cpp", "-o", output],
                cwd=folder, capture_output=True, text=True, timeout=300,
            )
            assert done.returncode == 0, done.stderr[-3000:]

        binary = _EMULATORS[key] = f"{_built_once(('emulator', *key), build)}/{output}"
    return binary


def _one_cpu() -> None:
    """In the emulator's process, before it starts: keep it on one CPU. Under AddressSanitizer its lanes are
    std::threads that meet at a barrier every step; across cores each wake-up crosses to the other core, which on a
    busy 2-core machine made the same emulation several times slower than on one core."""
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})


def run_emulator(binary: str, *args: Any) -> None:
    """Run a built emulator with ``args`` (its main's argv) on one CPU; fails the test with its stderr if it fails.
    The timeout only guards against a hang."""
    run = subprocess.run([binary, *(str(a) for a in args)], capture_output=True, text=True, timeout=600,
                         preexec_fn=_one_cpu)
    assert run.returncode == 0, run.stderr[-3000:]


def slow_except(cases: list[Any], ids: list[str], quick: set[int]) -> list[Any]:
    """``pytest.param``s of ``cases`` (ids unchanged, so the rng fixture's seeds are too): those at the indices in
    ``quick`` stay in the quick subset, the others are marked slow."""
    return [pytest.param(*case, id=name, marks=() if index in quick else pytest.mark.slow)
            for index, (case, name) in enumerate(zip(cases, ids, strict=True))]
