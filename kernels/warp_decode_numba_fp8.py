"""Strict warp decode on fp8-block128 weights in Numba CUDA: the CuPy FP8 family's ownership and numerics.

    gate_up  warp (t, k, i): e = topk_ids[t, k]; lane l streams chunks c = l, l + 32, ... of the gate and up rows
             (8 e4m3fn values = one uint64 word each) beside x[t]'s matching 16 bytes (8 bf16), widens each value
             to FP32 (exact), multiplies it by its 128 x 128 block's float32 scale (w13's scales: gate's block rows,
             then up's) and accumulates value x scale x activation in FP32; butterfly; bf16(SiLU(g) * u).
    down     warp (t, h): for each routed slot k in order (``slots`` slots' loads in flight together), the
             lane's partial dot of w2[e, h, :] (dequantized the same way) with intermediate[t, k, :], then ONE FP32
             accumulator += topk_weights[t, k] x partial; butterfly; out[t, h] (bf16, or float32).

A value's widening is integer work Numba can express (no PTX ``cvt`` needed, so the simulator runs the same
code): the byte's exponent and mantissa bits are moved into a float32's (``(b & 0x7F) << 20``, sign to bit 31),
which reads as the e4m3fn value times 2**-120 -- a float32 denormal for e4m3fn's subnormals -- and one multiply by
2**120 (exact) restores it; 0x7F / 0xFF (e4m3fn's NaN) stay NaN. No value is rounded on the way.

Bad expert ids, the bf16 bit handling, the 16-byte activation loads, ``loads_arrived`` and the host side (CuPy
arrays on the GPU on CuPy's current stream; NumPy arrays under ``NUMBA_ENABLE_CUDASIM=1``) are those of
:mod:`kernels.warp_decode_numba`. Knobs: ``warps`` per block, ``unroll`` (chunks in flight per lane and row),
``slots`` (down: routed slots per round). Registered as ``numba:warp-decode-fp8``.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Any

import numpy as np
from numba import cuda

from kernels import simt
from kernels.checks import SIMULATOR, check_output
from kernels.contract import BF16, Dims, array_module, check_inputs, check_out
from kernels.family import Compiled, KernelFamily, Launch, Stage
from kernels.formats import FP8_BLOCK128, Quantized
from kernels.shapes import MoEShape, ceil_div
from kernels.variants import register
from kernels.warp_decode_numba import (
    FULL_MASK,
    NAN_BF16,
    NumbaKernelResources,
    _as_bits,
    _check_backend,
    _check_workspace,
    _current_stream,
    _family_workspace,
    _to_numba,
    as_f32,
    as_u32,
    bad_ids_record,
    bind_kernels,
    load16,
    loads_arrived,
    numba_offline_reports,
    simulated_cases,
)

DEFAULTS: dict[str, int] = {"warps": 8, "unroll": 2, "slots": 4}
LIMITS: dict[str, tuple[int, int]] = {"warps": (1, 32), "unroll": (1, 8), "slots": (1, 8)}
GRID: dict[str, list[int]] = {"warps": [4, 8], "unroll": [1, 2, 4], "slots": [2, 4]}
BLOCK_CHUNKS = 16  # 8-value chunks per 128-wide scale block: a chunk never straddles two blocks
KERNEL_NAMES = ("moe_gate_up_fp8_numba", "moe_down_fp8_numba")


def _knob_tuple(params: dict[str, int]) -> tuple[int, int, int]:
    return params["warps"], params["unroll"], params["slots"]


def _kernel_sources(warps: int, unroll: int, slots: int, out_f32: bool) -> tuple[Any, Any]:
    """The two Python kernel functions for one knob set (not yet jitted); knobs are closure constants."""
    # 2**120 (exact in float32): moves the e4m3fn bits, read as a float32, back to the value
    rescale = np.float32(2.0**120)
    x_words = 2 * unroll  # local array sizes must be closure constants
    slot_chunks = unroll * slots
    slot_words = 2 * slot_chunks

    def moe_gate_up_fp8_numba(x64, w13v, s13, topk_ids, intermediate16):
        # x64 [T, H/4] bf16 bits; w13v [E, 2I, H/8] e4m3fn bytes, 8 to a uint64; s13 [E, 2 IB, HB] float32
        lane = cuda.threadIdx.x & 31
        warp = cuda.blockIdx.x * warps + (cuda.threadIdx.x >> 5)
        tokens, top_k, inter = intermediate16.shape
        experts, chunks = w13v.shape[0], w13v.shape[2]
        iblocks = s13.shape[1] // 2
        if warp >= tokens * top_k * inter:  # warp-uniform exit
            return
        pair = warp // inter
        i = warp - pair * inter
        t = pair // top_k
        k = pair - t * top_k
        e = topk_ids[t, k]
        if e < 0 or e >= experts:  # guard: never read out of bounds; the slot becomes NaN
            if lane == 0:
                intermediate16[t, k, i] = np.uint16(NAN_BF16)
            return
        gate_block = i // 128
        up_block = iblocks + gate_block
        gate = np.float32(0.0)
        up = np.float32(0.0)
        xs = cuda.local.array(x_words, np.uint64)
        gs = cuda.local.array(unroll, np.uint64)
        us = cuda.local.array(unroll, np.uint64)
        sg = cuda.local.array(unroll, np.float32)
        su = cuda.local.array(unroll, np.float32)
        for base in range(0, chunks, 32 * unroll):
            for u in range(unroll):
                c = base + u * 32 + lane
                if c < chunks:
                    gs[u] = w13v[e, i, c]
                    us[u] = w13v[e, inter + i, c]
                    xs[2 * u], xs[2 * u + 1] = load16(x64[t], 2 * c)
                    sg[u] = s13[e, gate_block, c // BLOCK_CHUNKS]
                    su[u] = s13[e, up_block, c // BLOCK_CHUNKS]
                else:
                    gs[u] = np.uint64(0)
                    us[u] = np.uint64(0)
                    xs[2 * u] = np.uint64(0)
                    xs[2 * u + 1] = np.uint64(0)
                    sg[u] = np.float32(0.0)
                    su[u] = np.float32(0.0)
            sink = np.uint64(0)  # every FMA below waits for every weight load of this round
            for u in range(unroll):
                sink ^= gs[u] ^ us[u]
            arrived = loads_arrived(sink)
            for u in range(unroll):
                for v in range(8):  # value v: byte v of the weight word, bf16 v % 4 of activation word v // 4
                    xw = xs[2 * u + v // 4] | arrived
                    xb = np.uint32(np.uint32((xw >> np.uint64(16 * (v % 4))) & np.uint64(0xFFFF)) << np.uint32(16))
                    xv = as_f32(xb)
                    gb = np.uint32((gs[u] >> np.uint64(8 * v)) & np.uint64(0xFF))
                    ub = np.uint32((us[u] >> np.uint64(8 * v)) & np.uint64(0xFF))
                    gv = np.float32(as_f32(((gb & np.uint32(0x7F)) << np.uint32(20))
                                           | ((gb & np.uint32(0x80)) << np.uint32(24))) * rescale)
                    uv = np.float32(as_f32(((ub & np.uint32(0x7F)) << np.uint32(20))
                                           | ((ub & np.uint32(0x80)) << np.uint32(24))) * rescale)
                    if (gb & np.uint32(0x7F)) == np.uint32(0x7F):
                        gv = np.float32(np.nan)
                    if (ub & np.uint32(0x7F)) == np.uint32(0x7F):
                        uv = np.float32(np.nan)
                    gate = np.float32(gate + np.float32(gv * sg[u]) * xv)
                    up = np.float32(up + np.float32(uv * su[u]) * xv)
        offset = 16
        while offset > 0:  # butterfly: every lane ends with the warp's sums
            gate = np.float32(gate + cuda.shfl_xor_sync(FULL_MASK, gate, offset))
            up = np.float32(up + cuda.shfl_xor_sync(FULL_MASK, up, offset))
            offset //= 2
        if lane == 0:
            act = np.float32(gate / np.float32(np.float32(1.0) + np.float32(math.exp(-gate))) * up)  # SiLU(g) * u
            bits = as_u32(act)
            if act != act:
                intermediate16[t, k, i] = np.uint16(NAN_BF16)
            else:  # round to nearest even
                rounded = np.uint32(bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))
                intermediate16[t, k, i] = np.uint16(rounded >> np.uint32(16))

    def moe_down_fp8_numba(intermediate64, w2v, s2, topk_ids, topk_weights, out):
        # intermediate64 [T, K, I/4] bf16 bits; w2v [E, H, I/8] e4m3fn bytes; s2 [E, HB, IB]; out bf16 bits or f32
        lane = cuda.threadIdx.x & 31
        warp = cuda.blockIdx.x * warps + (cuda.threadIdx.x >> 5)
        tokens, top_k = intermediate64.shape[0], intermediate64.shape[1]
        experts, hidden, chunks = w2v.shape[0], w2v.shape[1], w2v.shape[2]
        if warp >= tokens * hidden:  # warp-uniform exit
            return
        t = warp // hidden
        h = warp - t * hidden
        h_block = h // 128
        acc = np.float32(0.0)  # the ONE FP32 accumulator of out[t, h] (per lane)
        valid = True
        for k in range(top_k):  # any bad id of the token: no weight is read, the row becomes NaN
            e = topk_ids[t, k]
            if e < 0 or e >= experts:
                valid = False
        slot_k = cuda.local.array(slots, np.int64)
        slot_e = cuda.local.array(slots, np.int64)
        slot_w = cuda.local.array(slots, np.float32)
        hs = cuda.local.array(slot_words, np.uint64)
        ws = cuda.local.array(slot_chunks, np.uint64)
        sc = cuda.local.array(slot_chunks, np.float32)
        if valid:
            for k0 in range(0, top_k, slots):  # ``slots`` routed slots per round: their loads in flight together
                for sl in range(slots):
                    k = k0 + sl
                    slot_k[sl] = k if k < top_k else 0
                    slot_e[sl] = topk_ids[t, k] if k < top_k else 0
                    slot_w[sl] = topk_weights[t, k] if k < top_k else np.float32(0.0)
                for base in range(0, chunks, 32 * unroll):
                    for sl in range(slots):
                        for u in range(unroll):
                            c = base + u * 32 + lane
                            j = sl * unroll + u
                            if c < chunks and k0 + sl < top_k:
                                ws[j] = w2v[slot_e[sl], h, c]
                                hs[2 * j], hs[2 * j + 1] = load16(intermediate64[t, slot_k[sl]], 2 * c)
                                sc[j] = s2[slot_e[sl], h_block, c // BLOCK_CHUNKS]
                            else:
                                ws[j] = np.uint64(0)
                                hs[2 * j] = np.uint64(0)
                                hs[2 * j + 1] = np.uint64(0)
                                sc[j] = np.float32(0.0)
                    sink = np.uint64(0)  # every FMA below waits for every w2 load of this round
                    for j in range(slot_chunks):
                        sink ^= ws[j]
                    arrived = loads_arrived(sink)
                    for sl in range(slots):  # slots in order: ONE accumulator, the routing weight folded per slot
                        partial = np.float32(0.0)
                        for u in range(unroll):
                            j = sl * unroll + u
                            for v in range(8):
                                hw = hs[2 * j + v // 4] | arrived
                                hb = np.uint32(np.uint32((hw >> np.uint64(16 * (v % 4))) & np.uint64(0xFFFF))
                                               << np.uint32(16))
                                wb = np.uint32((ws[j] >> np.uint64(8 * v)) & np.uint64(0xFF))
                                wv = np.float32(as_f32(((wb & np.uint32(0x7F)) << np.uint32(20))
                                                       | ((wb & np.uint32(0x80)) << np.uint32(24))) * rescale)
                                if (wb & np.uint32(0x7F)) == np.uint32(0x7F):
                                    wv = np.float32(np.nan)
                                partial = np.float32(partial + np.float32(wv * sc[j]) * as_f32(hb))
                        acc = np.float32(acc + slot_w[sl] * partial)
        offset = 16
        while offset > 0:
            acc = np.float32(acc + cuda.shfl_xor_sync(FULL_MASK, acc, offset))
            offset //= 2
        if not valid:
            acc = np.float32(np.nan)
        if lane == 0:
            if out_f32:
                out[t, h] = acc
            else:
                bits = as_u32(acc)
                if acc != acc:
                    out[t, h] = np.uint16(NAN_BF16)
                else:  # round to nearest even
                    rounded = np.uint32(bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))
                    out[t, h] = np.uint16(rounded >> np.uint32(16))

    return moe_gate_up_fp8_numba, moe_down_fp8_numba


@functools.cache
def get_kernels(warps: int = DEFAULTS["warps"], unroll: int = DEFAULTS["unroll"], slots: int = DEFAULTS["slots"],
                out_f32: bool = False) -> tuple[Any, Any]:
    """The jitted (gate_up, down) pair for one knob set, compiled lazily and cached."""
    knobs = _knob_tuple(FAMILY.resolve(None, warps=warps, unroll=unroll, slots=slots))
    gate_up, down = _kernel_sources(*knobs, out_f32)
    # a block's registers must fit the SM's 65536 (as for the bf16 Numba family)
    options = {} if simt.simulator_enabled() else {"max_registers": min(255, 65536 // (32 * knobs[0]) // 8 * 8)}
    return cuda.jit(gate_up, **options), cuda.jit(down, **options)


def _signatures(out_f32: bool) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    from numba import types

    c = types.Array
    u64, f32 = types.uint64, types.float32
    gate_up = (c(u64, 2, "C"), c(u64, 3, "C"), c(f32, 3, "C"), c(types.int32, 2, "C"), c(types.uint16, 3, "C"))
    down = (c(u64, 3, "C"), c(u64, 3, "C"), c(f32, 3, "C"), c(types.int32, 2, "C"), c(f32, 2, "C"),
            c(f32 if out_f32 else types.uint16, 2, "C"))
    return gate_up, down


_LOADED: dict[tuple[tuple[int, ...], bool], tuple[Any, Any]] = {}


def _loaded_kernels(knobs: tuple[int, ...], out_f32: bool) -> tuple[Any, Any]:
    """The pair for ``knobs``, compiled and loaded the first time (nothing compiles under graph capture)."""
    pair = get_kernels(*knobs, out_f32=out_f32)
    if simt.simulator_enabled():
        return pair
    key = (tuple(knobs), bool(out_f32))
    if key not in _LOADED:
        bind_kernels(pair, _signatures(out_f32))
        _LOADED[key] = pair
    return pair


def _check_alignment(**arrays: Any) -> None:
    """16-byte activation loads and 8-byte weight words: rows are multiples of both, so check the base addresses."""
    for name, (arr, align) in arrays.items():
        address = arr.ctypes.data if isinstance(arr, np.ndarray) else int(arr.data.ptr)
        if address % align:
            raise ValueError(f"{name} must start on a {align}-byte boundary (address {address:#x})")


def _prepare(x: Any, w13: Quantized, w2: Quantized, topk_ids: Any, topk_weights: Any, out: Any,
             workspace: Any) -> tuple[Any, ...]:
    """Bit views of every array, converted for a Numba launch (host work only: no allocation, no sync)."""
    _check_alignment(x=(x, 16), workspace=(workspace, 16), w13=(w13.values, 8), w2=(w2.values, 8))
    out_bits = out if out.dtype == np.float32 else _as_bits(out, np.uint16)
    views = (
        _as_bits(x, np.uint64), w13.values.view(np.uint8).view(np.uint64), w13.scales,
        w2.values.view(np.uint8).view(np.uint64), w2.scales, topk_ids, topk_weights,
        _as_bits(workspace, np.uint16), _as_bits(workspace, np.uint64), out_bits,
    )
    return tuple(_to_numba(v) for v in views)


def _launch(pair: tuple[Any, Any], dims: Dims, warps: int, args: tuple[Any, ...], stream: Any,
            stage: str | None = None) -> None:
    gate_up, down = pair
    x64, w13v, s13, w2v, s2, topk_ids, topk_weights, inter16, inter64, out_bits = args
    threads = 32 * warps
    if stage in (None, "gate_up"):
        gate_up[ceil_div(dims.tokens * dims.top_k * dims.intermediate, warps), threads, stream](
            x64, w13v, s13, topk_ids, inter16)
    if stage in (None, "down"):
        down[ceil_div(dims.tokens * dims.hidden, warps), threads, stream](
            inter64, w2v, s2, topk_ids, topk_weights, out_bits)


def stages(compiled: Compiled, x: Any, w13: Quantized, w2: Quantized, topk_ids: Any, topk_weights: Any,
           out: Any) -> list[Stage]:
    """The two Numba launches, each on the stream current when it runs (no allocation, no sync)."""
    knobs = _knob_tuple(compiled.params)
    pair = _loaded_kernels(knobs, out.dtype == np.float32)
    args = _prepare(x, w13, w2, topk_ids, topk_weights, out, compiled.workspace)

    def run(stage: str) -> None:
        _launch(pair, compiled.dims, knobs[0], args, _current_stream(), stage)

    return [(name, functools.partial(run, name)) for name in ("gate_up", "down")]


def warp_decode_fp8(x: Any, w13: Quantized, w2: Quantized, topk_ids: Any, topk_weights: Any, out: Any = None,
                    workspace: Any = None, **params: int) -> Any:
    """One MoE decode layer by strict warp decode on fp8-block128 weights (Numba kernels); returns ``out`` [T, H].

    CuPy inputs (values as uint8 bit patterns) run on the GPU on CuPy's current stream; NumPy inputs (values
    float8_e4m3fn or uint8) only under the CUDA simulator. With ``out`` and ``workspace`` given nothing is
    allocated. ``params``: ``warps``, ``unroll``, ``slots``."""
    dims = check_inputs(x, w13, w2, topk_ids, topk_weights, weight_format=FP8_BLOCK128)
    xp = array_module(x)
    _check_backend(xp)
    knobs = FAMILY.resolve(dims, **params)
    if out is None:
        out = xp.empty((dims.tokens, dims.hidden), BF16)
    else:
        check_out(out, dims, xp)
    if workspace is None:
        workspace = xp.empty((dims.tokens, dims.top_k, dims.intermediate), BF16)
    else:
        _check_workspace(workspace, dims, xp)
    compiled = FAMILY.compile(dims, workspace=workspace, **knobs)
    with simt.one_cpu() if xp is np else contextlib.nullcontext():
        compiled.run(x, w13, w2, topk_ids, topk_weights, out)
    return out


def build(dims: Dims, out_dtype: Any = BF16, **knobs: int) -> Launch:
    """The variant's build: resolve, allocate the intermediate, compile and load both kernels now."""
    compiled = FAMILY.compile(dims, **knobs)
    _loaded_kernels(_knob_tuple(compiled.params), np.dtype(out_dtype) == np.float32)
    return compiled.launch()


def compile_ptx(warps: int = DEFAULTS["warps"], unroll: int = DEFAULTS["unroll"], slots: int = DEFAULTS["slots"],
                out_f32: bool = False, cc: tuple[int, int] = (9, 0)) -> dict[str, str]:
    """PTX of both kernels for one knob set, keyed by readable kernel name; needs no GPU. Compiled once per process
    (as :func:`kernels.warp_decode_numba.compile_ptx`)."""
    knobs = _knob_tuple(FAMILY.resolve(None, warps=warps, unroll=unroll, slots=slots))
    return dict(_compiled_ptx(knobs, bool(out_f32), tuple(cc)))


@functools.cache
def _compiled_ptx(knobs: tuple[int, int, int], out_f32: bool, cc: tuple[int, int]) -> dict[str, str]:
    gate_up, down = _kernel_sources(*knobs, out_f32)
    sig_gate_up, sig_down = _signatures(out_f32)
    return {KERNEL_NAMES[0]: cuda.compile_ptx(gate_up, sig_gate_up, cc=cc)[0],
            KERNEL_NAMES[1]: cuda.compile_ptx(down, sig_down, cc=cc)[0]}


def offline_reports(param_sets: list[dict[str, Any]] | None = None,
                    defaults: bool = True) -> list[NumbaKernelResources]:
    """ptxas' registers / spills / stack of both kernels for sm_90 (as :func:`kernels.warp_decode_numba.
    offline_reports`)."""
    return numba_offline_reports(__name__, lambda **knobs: compile_ptx(**knobs), DEFAULTS, param_sets, defaults)


# ---------------------------------------------------------------------------------------------------------
# Checks against the reference on FP8 weights (the simulator tests, the GPU tests, the bench's CPU path)
# ---------------------------------------------------------------------------------------------------------
def compare(result: Any, x: Any, w13: Quantized, w2: Quantized, topk_ids: Any, topk_weights: Any,
            out_dtype: Any = BF16) -> dict[str, Any]:
    """``result`` against ``reference.moe_decode(mode="warp_decode", weight_format="fp8-block128")`` and the fp64
    oracle on the same (dequantized) weights, by the one output checker under :data:`kernels.checks.SIMULATOR`."""
    from kernels.reference import moe_decode

    args = (x, FP8_BLOCK128.host(w13), FP8_BLOCK128.host(w2), topk_ids, topk_weights)
    args = tuple(a.get() if hasattr(a, "get") and not isinstance(a, (np.ndarray, Quantized)) else a for a in args)
    faithful = moe_decode(*args, mode="warp_decode", out_dtype=out_dtype, weight_format=FP8_BLOCK128)
    oracle = moe_decode(*args, mode="fp64", weight_format=FP8_BLOCK128)
    return check_output(result, faithful, SIMULATOR, oracle=oracle)


# name -> (shape, tokens, routing, knobs, out dtype): partial scale blocks at both edges (tiny: H = 136, I = 48),
# a second chunk round with unroll 1 (H = 264), lanes without data and duplicate ids (H = 40); tiny at one token, as
# the bf16 family's (several tokens per launch: odd-dup; at two tokens tiny alone took ~15 of the cases' ~35 s)
SIM_CASES: dict[str, tuple[MoEShape | str, int, Any, dict[str, int], Any]] = {
    "tiny": ("tiny", 1, "zipf", {"warps": 4, "unroll": 1, "slots": 2}, np.float32),  # float32 out; bf16: the others
    "odd-dup": (MoEShape("odd-dup", 40, 24, 3, 2), 3, [[2, 2], [0, 1], [1, 1]], {"warps": 4, "slots": 1}, BF16),
    "h264-same": (MoEShape("h264-same", 264, 16, 2, 1), 1, "same", {"warps": 4, "unroll": 1, "slots": 1}, BF16),
}


def simulator_selfcheck(shapes: tuple[Any, ...] = ("tiny", "odd-dup"), seed: int = 0) -> list[dict[str, Any]]:
    """The kernels on the CUDA simulator against the reference on FP8 weights quantized from the case's problem;
    one record per case (``shapes``: names from :data:`SIM_CASES` or ``(shape, tokens, routing, knobs)``)."""
    from kernels.formats import quantize_weights

    results = []
    for name, problem, knobs, out in simulated_cases(shapes, SIM_CASES, seed):
        q13, q2 = quantize_weights(problem.w13, problem.w2, FP8_BLOCK128)
        warp_decode_fp8(problem.x, q13, q2, problem.topk_ids, problem.topk_weights, out=out, **knobs)
        results.append({"case": name, "tokens": problem.tokens, "params": {**DEFAULTS, **knobs},
                        "out_dtype": out.dtype.name,
                        **compare(out, problem.x, q13, q2, problem.topk_ids, problem.topk_weights, out.dtype)})
    return results


def simulate_bad_ids(seed: int = 0) -> dict[str, Any]:
    """Out-of-range expert ids on the simulator (the host check bypassed, as under graph capture): the bad tokens'
    rows all NaN, the other token as the reference says."""
    from kernels.formats import quantize_weights
    from kernels.problem import make_problem

    problem = make_problem(SIM_CASES["odd-dup"][0], 3, seed=seed)
    q13, q2 = quantize_weights(problem.w13, problem.w2, FP8_BLOCK128)
    ids = problem.topk_ids.copy()
    ids[0, 1] = problem.shape.experts
    ids[2, 0] = -7
    dims = check_inputs(problem.x, q13, q2, ids, problem.topk_weights, check_values=False,
                        weight_format=FP8_BLOCK128)
    out = np.full((dims.tokens, dims.hidden), 1.0, BF16)
    workspace = np.full((dims.tokens, dims.top_k, dims.intermediate), 1.0, BF16)
    knobs = _knob_tuple(FAMILY.resolve(dims, warps=4, slots=2))
    args = _prepare(problem.x, q13, q2, ids, problem.topk_weights, out, workspace)
    with simt.one_cpu():
        _launch(get_kernels(*knobs), dims, knobs[0], args, 0)
    return bad_ids_record(out, compare(out[1:2], problem.x[1:2], q13, q2, problem.topk_ids[1:2],
                                       problem.topk_weights[1:2]))


FAMILY = KernelFamily(
    name="warp-decode-numba-fp8",
    source=None,
    knobs=dict(DEFAULTS),
    limits=LIMITS,
    workspace=_family_workspace,
    stages=stages,
    offline_reports=offline_reports,
    simulate=simulator_selfcheck,
)
VARIANT = register(
    FAMILY.variant(
        "numba:warp-decode-fp8",
        backend="numba",
        family="warp-decode-fp8",
        build=build,
        reference_mode="warp_decode",
        weight_format=FP8_BLOCK128.name,
        grid={key: list(values) for key, values in GRID.items()},
        description="Numba CUDA strict warp decode on fp8-block128 weights: e4m3fn bits widened by integer moves, "
        "block scales, FP32 accumulation",
    )
)
