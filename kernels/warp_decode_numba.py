"""Warp decode in Numba CUDA: ``moe_gate_up_3d_batched`` then ``moe_down_3d_batched``, one warp per output.

    gate_up  warp (t, k, i0..i0+ROWS-1): e = topk_ids[t, k]; streams gate row w13[e, i, :] and up row
             w13[e, I + i, :] for each of its ROWS neurons and x[t] once, accumulates both dots in FP32 per
             lane, reduces with xor-shuffles, stores bf16(SiLU(g) * u) into intermediate[t, k, i] (RNE).
    down     warp (t, h0..h0+ROWS-1): for k = 0..K-1 (SLOTS per round, their loads in flight together) reads
             w2[e, h, :] and intermediate[t, k, :], folds topk_weights[t, k] * (lane's partial dot) into ONE
             FP32 accumulator per row (k in order), reduces once and writes out[t, h] (bf16, or float32).

An expert id outside [0, E) is never dereferenced: gate_up writes NaN into that slot's intermediate and down
makes the whole token's output NaN. bf16 travels as raw bits: arrays are viewed as uint64 (4 bf16 per word) and
widened by integer shifts (exact).

Loads are 16 bytes per lane, ``ld.global.nc.v2.u64``: Numba alone emits 8-byte ``ld.global.u64`` at best (no
alignment proof, no read-only marking), so the ``load16`` intrinsic emits an aligned ``<2 x i64>``
``!invariant.load`` (the host checks every base address). Each lane holds ``unroll`` chunks per row (times
``slots`` in down) in local arrays LLVM keeps in registers (no stack, no spills: ``offline_reports``); the
``loads_arrived`` intrinsic makes every FMA of a round wait for all its loads, so ptxas issues them first.

:data:`FAMILY` declares the kernels (no CUDA C: ``compiled.kernels`` is empty, its stages launch the Numba kernels):
knobs ``warps`` per block, ``rows`` (outputs per warp: 1, 2, 4 or 8), ``unroll`` (16-byte loads per lane per row
in flight), ``slots`` (down: routed slots per round), their limits, the [T, K, I] workspace, the offline compile
report and the simulator self-check. Outputs are checked by ``kernels.checks.check_output`` (``SIMULATOR``).

Runs on CuPy arrays on the GPU (CuPy's current stream; no allocation and no host sync when ``out`` and
``workspace`` are given) and on NumPy arrays under Numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1`` set before
numba is imported; :mod:`kernels.simt` supplies the warp shuffles).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Iterator
from typing import Any

import numpy as np
from numba import cuda

from kernels import simt
from kernels.checks import SIMULATOR, check_output
from kernels.compile import KernelResources
from kernels.contract import BF16, Dims, array_module, check_inputs, check_out
from kernels.family import Compiled, KernelFamily, Launch, Stage
from kernels.shapes import MoEShape, ceil_div, get_shape
from kernels.variants import register

simt.install()  # adds warp shuffles to the CUDA simulator; does nothing off the simulator


# Bit casts between uint32 and float32. On the GPU these are LLVM intrinsics (a register move): a scalar
# ``.view`` would work too, but Numba compiles it as an overload that needs a live GPU to be typed, which
# would break offline ``compile_ptx``. Under the simulator the same names are NumPy views (kernels.simt).
if simt.simulator_enabled():
    as_f32, as_u32, load16, loads_arrived = simt.as_f32, simt.as_u32, simt.load16, simt.loads_arrived
else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def as_f32(typingctx: Any, bits: Any) -> Any:
        """uint32 bits -> the float32 with those bits."""

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            return builder.bitcast(args[0], ir.FloatType())

        return types.float32(types.uint32), codegen

    @intrinsic
    def as_u32(typingctx: Any, value: Any) -> Any:
        """float32 -> its uint32 bits."""

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            return builder.bitcast(args[0], ir.IntType(32))

        return types.uint32(types.float32), codegen

    @intrinsic
    def load16(typingctx: Any, row: Any, word: Any) -> Any:
        """``(row[word], row[word + 1])`` of a C-contiguous uint64 row as ONE 16-byte read-only load.

        Emits ``ld.global.nc.v2.u64``: the address is 16-byte aligned because ``word`` is even and the host
        checks every array's base address (rows of H or I bf16 are multiples of 16 bytes); the data must
        not change during the kernel (``!invariant.load``): true of x, w13, w2 and, in the down kernel,
        the intermediate.
        """
        if not (isinstance(row, types.Array) and row.ndim == 1 and row.dtype == types.uint64 and row.layout == "C"):
            return None
        pair = ir.VectorType(ir.IntType(64), 2)

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            data = context.make_array(signature.args[0])(context, builder, args[0]).data
            address = builder.bitcast(builder.gep(data, [args[1]]), ir.PointerType(pair))
            loaded = builder.load(builder.addrspacecast(address, ir.PointerType(pair, 1)), align=16)
            loaded.set_metadata("invariant.load", builder.module.add_metadata([]))
            low = builder.extract_element(loaded, ir.Constant(ir.IntType(32), 0))
            high = builder.extract_element(loaded, ir.Constant(ir.IntType(32), 1))
            return context.make_tuple(builder, signature.return_type, (low, high))

        return types.UniTuple(types.uint64, 2)(row, types.intp), codegen

    @intrinsic
    def loads_arrived(typingctx: Any, sink: Any) -> Any:
        """A uint64 zero that depends on ``sink`` (the XOR of a round's loaded words) through an opaque
        ``fma.rn.f32 x, 0, 0`` in inline PTX (x = the folded sink, made finite by a mask).

        ptxas otherwise sinks each load next to its first FMA, leaving one or two loads in flight per lane
        whatever the unroll; OR-ing this zero into the activation words makes every FMA of the round wait
        for *all* of its loads, so all of them are issued first. Nothing can fold it away: only the PTX
        instruction knows the result is zero. (SASS of the nvJitLink cubin at the default knobs: gate_up issues
        6 LDG.E.128.CONSTANT then 33 FFMA, down 16 then 69 FFMA, at 56 / 126 registers.)
        """
        if sink != types.uint64:
            return None

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            i32, i64 = ir.IntType(32), ir.IntType(64)
            high = builder.lshr(args[0], ir.Constant(i64, 32))
            folded = builder.xor(builder.trunc(args[0], i32), builder.trunc(high, i32))
            finite = builder.bitcast(builder.and_(folded, ir.Constant(i32, 0x007FFFFF)), ir.FloatType())
            zero = builder.asm(ir.FunctionType(ir.FloatType(), [ir.FloatType()]),
                               "fma.rn.f32 $0, $1, 0f00000000, 0f00000000;", "=f,f", [finite], False)
            return builder.zext(builder.bitcast(zero, i32), i64)

        return types.uint64(types.uint64), codegen

DEFAULTS: dict[str, int] = {"warps": 8, "rows": 1, "unroll": 2, "slots": 4}
GRID: dict[str, list[int]] = {"warps": [4, 8, 16], "rows": [1, 2], "unroll": [1, 2, 4], "slots": [1, 2, 4]}

FULL_MASK = 0xFFFFFFFF
NAN_BF16 = 0x7FC0
WORDS_PER_LOAD = 2  # uint64 words a lane loads per row per step: 16 bytes = 8 bf16


LIMITS: dict[str, tuple[int, int]] = {"warps": (1, 32), "rows": (1, 8), "unroll": (1, 8), "slots": (1, 8)}
ROWS = (1, 2, 4, 8)  # a divisor of 8, so it divides H and I
UNROLLS = (1, 2, 3, 4, 6, 8)


def rules(dims: Dims | None, values: dict[str, int]) -> dict[str, int]:
    """The family's rules on validated knobs (names, int types and :data:`LIMITS` checked): ``rows`` and
    ``unroll`` take only the values the kernels are written for (ValueError)."""
    if values["rows"] not in ROWS:
        raise ValueError(f"rows (outputs per warp) must be 1, 2, 4 or 8 (a divisor of 8), got {values['rows']}")
    if values["unroll"] not in UNROLLS:
        raise ValueError(f"unroll (16-byte loads in flight per lane per row) must be 1-4, 6 or 8, "
                         f"got {values['unroll']}")
    return values


def _knob_tuple(params: dict[str, int]) -> tuple[int, int, int, int]:
    return params["warps"], params["rows"], params["unroll"], params["slots"]


def _check_params(warps: int, rows: int, unroll: int, slots: int = 4) -> tuple[int, int, int, int]:
    """The knobs validated by the family (``FAMILY.resolve``), as the (warps, rows, unroll, slots) tuple."""
    return _knob_tuple(FAMILY.resolve(None, warps=warps, rows=rows, unroll=unroll, slots=slots))


# ---------------------------------------------------------------------------------------------------------
# Kernel sources. One factory per parameter set: warps, rows, unroll, slots are closure constants Numba folds.
# Every bf16 <-> f32 conversion is spelled out inline (integer shifts, then the as_f32 / as_u32 bitcasts):
# @cuda.jit device functions need a live GPU just to be typed, which would break offline compile_ptx.
# ---------------------------------------------------------------------------------------------------------
def _kernel_sources(warps: int, rows: int, unroll: int, slots: int, out_f32: bool) -> tuple[Any, Any]:
    """The two Python kernel functions for one knob set (not yet jitted)."""
    step = 32 * WORDS_PER_LOAD * unroll  # uint64 words the warp consumes per row per step
    lane_words = WORDS_PER_LOAD * unroll  # uint64 words one lane holds in flight per row
    lane_row_words = lane_words * rows
    slot_words = lane_words * slots  # down: uint64 words one lane holds in flight over SLOTS routed slots
    slot_row_words = lane_row_words * slots

    def moe_gate_up_3d_batched(x64, w13_64, topk_ids, intermediate16):
        # x64 [T, H/4], w13_64 [E, 2I, H/4]: bf16 bits 4 to a uint64; intermediate16 [T, K, I] bf16 bits
        lane = cuda.threadIdx.x & 31
        warp = cuda.blockIdx.x * warps + (cuda.threadIdx.x >> 5)
        tokens, top_k, inter = intermediate16.shape
        experts = w13_64.shape[0]
        words = x64.shape[1]
        groups = inter // rows
        if warp >= tokens * top_k * groups:  # warp-uniform exit
            return
        pair = warp // groups  # flat (t, k)
        i0 = (warp - pair * groups) * rows
        t = pair // top_k
        k = pair - t * top_k
        e = topk_ids[t, k]
        if e < 0 or e >= experts:  # guard: never read out of bounds; the slot becomes NaN
            if lane < rows:
                intermediate16[t, k, i0 + lane] = np.uint16(NAN_BF16)
            return
        gate = cuda.local.array(rows, np.float32)  # per-lane FP32 partial sums, in registers
        up = cuda.local.array(rows, np.float32)
        for r in range(rows):
            gate[r] = np.float32(0.0)
            up[r] = np.float32(0.0)
        xs = cuda.local.array(lane_words, np.uint64)  # this step's loads, all issued before any FMA
        gs = cuda.local.array(lane_row_words, np.uint64)
        us = cuda.local.array(lane_row_words, np.uint64)
        for base in range(0, words, step):
            for u in range(unroll):  # lane's 16 bytes of step u: words c, c+1 (c < words => c+1 < words)
                c = base + (u * 32 + lane) * 2
                if c < words:
                    xs[2 * u], xs[2 * u + 1] = load16(x64[t], c)
                    for r in range(rows):
                        gs[(2 * u) * rows + r], gs[(2 * u + 1) * rows + r] = load16(w13_64[e, i0 + r], c)
                        us[(2 * u) * rows + r], us[(2 * u + 1) * rows + r] = load16(w13_64[e, inter + i0 + r], c)
                else:
                    xs[2 * u] = np.uint64(0)
                    xs[2 * u + 1] = np.uint64(0)
                    for r in range(rows):
                        gs[(2 * u) * rows + r] = np.uint64(0)
                        gs[(2 * u + 1) * rows + r] = np.uint64(0)
                        us[(2 * u) * rows + r] = np.uint64(0)
                        us[(2 * u + 1) * rows + r] = np.uint64(0)
            sink = np.uint64(0)  # every FMA below waits for every weight load of this step (loads_arrived)
            for j in range(lane_row_words):
                sink ^= gs[j] ^ us[j]
            arrived = loads_arrived(sink)
            for j in range(lane_words):
                xw = xs[j] | arrived
                for q in range(4):  # the 4 bf16 of a word: bits 16q..16q+15 -> f32 by a shift
                    xf = np.uint32(np.uint32((xw >> np.uint64(16 * q)) & np.uint64(0xFFFF)) << np.uint32(16))
                    xv = as_f32(xf)
                    for r in range(rows):
                        gw = gs[j * rows + r]
                        uw = us[j * rows + r]
                        gb = np.uint32(np.uint32((gw >> np.uint64(16 * q)) & np.uint64(0xFFFF)) << np.uint32(16))
                        ub = np.uint32(np.uint32((uw >> np.uint64(16 * q)) & np.uint64(0xFFFF)) << np.uint32(16))
                        gate[r] = np.float32(gate[r] + xv * as_f32(gb))
                        up[r] = np.float32(up[r] + xv * as_f32(ub))
        for r in range(rows):  # butterfly: every lane ends with the warp's sums
            g = gate[r]
            v = up[r]
            offset = 16
            while offset > 0:
                g = np.float32(g + cuda.shfl_xor_sync(FULL_MASK, g, offset))
                v = np.float32(v + cuda.shfl_xor_sync(FULL_MASK, v, offset))
                offset //= 2
            if lane == r:
                act = np.float32(g / np.float32(np.float32(1.0) + np.float32(math.exp(-g))) * v)  # SiLU(g) * u
                bits = as_u32(act)
                if act != act:
                    intermediate16[t, k, i0 + r] = np.uint16(NAN_BF16)
                else:  # round to nearest even
                    rounded = np.uint32(bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))
                    intermediate16[t, k, i0 + r] = np.uint16(rounded >> np.uint32(16))

    def moe_down_3d_batched(intermediate64, w2_64, topk_ids, topk_weights, out):
        # intermediate64 [T, K, I/4], w2_64 [E, H, I/4]: bf16 bits 4 to a uint64; out [T, H] bf16 bits or f32
        lane = cuda.threadIdx.x & 31
        warp = cuda.blockIdx.x * warps + (cuda.threadIdx.x >> 5)
        tokens, top_k, words = intermediate64.shape
        experts, hidden = w2_64.shape[0], w2_64.shape[1]
        groups = hidden // rows
        if warp >= tokens * groups:  # warp-uniform exit
            return
        t = warp // groups
        h0 = (warp - t * groups) * rows
        acc = cuda.local.array(rows, np.float32)  # the ONE FP32 accumulator per output (per lane)
        for r in range(rows):
            acc[r] = np.float32(0.0)
        valid = True
        slot_k = cuda.local.array(slots, np.int64)  # this round's routed slots: k, expert, weight, loadable
        slot_e = cuda.local.array(slots, np.int64)
        slot_w = cuda.local.array(slots, np.float32)
        slot_ok = cuda.local.array(slots, np.bool_)
        hs = cuda.local.array(slot_words, np.uint64)  # per slot: the intermediate's words, then w2's
        ws = cuda.local.array(slot_row_words, np.uint64)
        for k0 in range(0, top_k, slots):  # SLOTS routed slots per round: their w2 loads are in flight together
            for sl in range(slots):
                k = k0 + sl
                slot_ok[sl] = False
                slot_w[sl] = np.float32(0.0)
                slot_k[sl] = 0
                slot_e[sl] = 0
                if k < top_k:
                    e = topk_ids[t, k]
                    if e < 0 or e >= experts:  # guard: never load, poison the token
                        valid = False
                    else:
                        slot_ok[sl] = True
                        slot_k[sl] = k
                        slot_e[sl] = e
                        slot_w[sl] = topk_weights[t, k]
            for base in range(0, words, step):
                for sl in range(slots):
                    for u in range(unroll):
                        c = base + (u * 32 + lane) * 2
                        j = sl * lane_words + 2 * u  # this load's slot in hs (and, times rows, in ws)
                        if c < words and slot_ok[sl]:
                            hs[j], hs[j + 1] = load16(intermediate64[t, slot_k[sl]], c)
                            for r in range(rows):
                                ws[j * rows + r], ws[(j + 1) * rows + r] = load16(w2_64[slot_e[sl], h0 + r], c)
                        else:
                            hs[j] = np.uint64(0)
                            hs[j + 1] = np.uint64(0)
                            for r in range(rows):
                                ws[j * rows + r] = np.uint64(0)
                                ws[(j + 1) * rows + r] = np.uint64(0)
                sink = np.uint64(0)  # every FMA below waits for every w2 load of this step (loads_arrived)
                for j in range(slot_row_words):
                    sink ^= ws[j]
                arrived = loads_arrived(sink)
                for r in range(rows):
                    for sl in range(slots):  # slots in order: one FP32 accumulator, weight folded per slot
                        partial = np.float32(0.0)
                        for jj in range(lane_words):
                            j = sl * lane_words + jj
                            hw = hs[j] | arrived
                            ww = ws[j * rows + r]
                            for q in range(4):
                                shift = np.uint64(16 * q)
                                hb = np.uint32(np.uint32((hw >> shift) & np.uint64(0xFFFF)) << np.uint32(16))
                                wb = np.uint32(np.uint32((ww >> shift) & np.uint64(0xFFFF)) << np.uint32(16))
                                partial = np.float32(partial + as_f32(hb) * as_f32(wb))
                        acc[r] = np.float32(acc[r] + slot_w[sl] * partial)
        for r in range(rows):
            s = acc[r]
            offset = 16
            while offset > 0:
                s = np.float32(s + cuda.shfl_xor_sync(FULL_MASK, s, offset))
                offset //= 2
            if not valid:
                s = np.float32(np.nan)
            if lane == r:
                if out_f32:
                    out[t, h0 + r] = s
                else:
                    bits = as_u32(s)
                    if s != s:
                        out[t, h0 + r] = np.uint16(NAN_BF16)
                    else:  # round to nearest even
                        rounded = np.uint32(bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))
                        out[t, h0 + r] = np.uint16(rounded >> np.uint32(16))

    return moe_gate_up_3d_batched, moe_down_3d_batched


@functools.cache
def get_kernels(
    warps: int = 8, rows: int = 1, unroll: int = 2, slots: int = 4, out_f32: bool = False
) -> tuple[Any, Any]:
    """The jitted (gate_up, down) kernel pair for one knob set, compiled lazily and cached."""
    knobs = _check_params(warps, rows, unroll, slots)
    gate_up, down = _kernel_sources(*knobs, out_f32)
    # a block of 32 * warps threads must fit the SM's 65536 registers, or the launch fails with
    # CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES (seen on the H200: down uses 126 registers, warps=16 needs <= 128)
    options = {} if simt.simulator_enabled() else {"max_registers": min(255, 65536 // (32 * knobs[0]) // 8 * 8)}
    return cuda.jit(gate_up, **options), cuda.jit(down, **options)


def _gate_up_signature() -> tuple[Any, ...]:
    from numba import types

    c = types.Array
    return (c(types.uint64, 2, "C"), c(types.uint64, 3, "C"), c(types.int32, 2, "C"), c(types.uint16, 3, "C"))


def _down_signature(out_f32: bool) -> tuple[Any, ...]:
    from numba import types

    c = types.Array
    out = c(types.float32 if out_f32 else types.uint16, 2, "C")
    return (c(types.uint64, 3, "C"), c(types.uint64, 3, "C"), c(types.int32, 2, "C"), c(types.float32, 2, "C"), out)


# ---------------------------------------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------------------------------------
def _as_bits(arr: Any, dtype: Any) -> Any:
    """A bf16 array's raw bits viewed as ``dtype`` (uint16, or uint64 = 4 bf16 per word); no copy."""
    return arr.view(np.uint16).view(dtype)


def _to_numba(arr: Any) -> Any:
    """A CuPy array as a Numba device array (no copy, no stream sync); NumPy passes through (simulator)."""
    if isinstance(arr, np.ndarray):
        return arr
    return cuda.from_cuda_array_interface(arr.__cuda_array_interface__, owner=arr, sync=False)


_STREAMS: dict[int, Any] = {}


def _current_stream() -> Any:
    """CuPy's current stream as a Numba stream (cached per handle); 0 under the simulator."""
    if simt.simulator_enabled():
        return 0
    import cupy

    handle = int(cupy.cuda.get_current_stream().ptr)
    stream = _STREAMS.get(handle)
    if stream is None:
        stream = cuda.default_stream() if handle == 0 else cuda.external_stream(handle)
        _STREAMS[handle] = stream
    return stream


def _check_workspace(workspace: Any, dims: Dims, xp: Any) -> None:
    if array_module(workspace) is not xp:
        raise TypeError(f"workspace must be a {xp.__name__} array like x")
    want = (dims.tokens, dims.top_k, dims.intermediate)
    if tuple(int(d) for d in workspace.shape) != want:
        raise ValueError(
            f"workspace must be the [T, K, I] = {list(want)} bf16 intermediate, got {tuple(workspace.shape)}"
        )
    if workspace.dtype != BF16:
        raise TypeError(f"workspace must have dtype bfloat16, got {workspace.dtype}")
    if not workspace.flags.c_contiguous:
        raise ValueError("workspace must be C-contiguous")


def _check_alignment(**arrays: Any) -> None:
    """16-byte loads need 16-byte aligned rows; rows are multiples of 16 bytes, so check the base addresses."""
    for name, arr in arrays.items():
        address = arr.ctypes.data if isinstance(arr, np.ndarray) else int(arr.data.ptr)
        if address % 16:
            raise ValueError(f"{name} must start on a 16-byte boundary for 16-byte loads (address {address:#x})")


def _check_backend(xp: Any) -> None:
    if xp is np and not simt.simulator_enabled():
        raise TypeError(
            "the Numba backend runs on CuPy arrays (GPU); NumPy arrays only under the CUDA simulator "
            "(NUMBA_ENABLE_CUDASIM=1 set before numba is imported)"
        )


def _launch(kernels: tuple[Any, Any], dims: Dims, params: tuple[int, ...], args: tuple[Any, ...], stream: Any,
            stage: str | None = None) -> None:
    """Launch gate_up and/or down. ``args`` are the already-converted (bit-view, Numba) arrays."""
    gate_up, down = kernels
    warps, rows = params[0], params[1]
    x64, w13_64, w2_64, topk_ids, topk_weights, inter16, inter64, out_bits = args
    threads = warps * 32
    if stage in (None, "gate_up"):
        gate_up_warps = dims.tokens * dims.top_k * (dims.intermediate // rows)
        gate_up[ceil_div(gate_up_warps, warps), threads, stream](x64, w13_64, topk_ids, inter16)
    if stage in (None, "down"):
        down_warps = dims.tokens * (dims.hidden // rows)
        down[ceil_div(down_warps, warps), threads, stream](inter64, w2_64, topk_ids, topk_weights, out_bits)


def _prepare(x: Any, w13: Any, w2: Any, topk_ids: Any, topk_weights: Any, out: Any, workspace: Any) -> tuple[Any, ...]:
    """Bit views of every array, converted for a Numba launch (host work only: no allocation, no sync)."""
    _check_alignment(x=x, w13=w13, w2=w2, workspace=workspace)
    out_bits = out if out.dtype == np.float32 else _as_bits(out, np.uint16)
    views = (
        _as_bits(x, np.uint64), _as_bits(w13, np.uint64), _as_bits(w2, np.uint64), topk_ids, topk_weights,
        _as_bits(workspace, np.uint16), _as_bits(workspace, np.uint64), out_bits,
    )
    return tuple(_to_numba(v) for v in views)


_LOADED: dict[tuple[tuple[int, ...], bool], tuple[Any, Any]] = {}


def _loaded_kernels(knobs: tuple[int, ...], out_f32: bool) -> tuple[Any, Any]:
    """The jitted (gate_up, down) pair for ``knobs``, compiled and its modules loaded into the context the first
    time (so a launch under CUDA-graph capture compiles and loads nothing); under the simulator, just the pair."""
    pair = get_kernels(*knobs, out_f32=out_f32)
    if simt.simulator_enabled():
        return pair
    key = (tuple(knobs), bool(out_f32))
    if key not in _LOADED:
        bind_kernels(pair, (_gate_up_signature(), _down_signature(out_f32)))
        _LOADED[key] = pair
    return pair


def bind_kernels(kernels: tuple[Any, ...], signatures: tuple[tuple[Any, ...], ...]) -> None:
    """Compile each jitted kernel for its signature and load its module into the current context now (``bind``),
    so that a later launch -- possibly under CUDA-graph capture -- compiles and loads nothing."""
    for kernel, signature in zip(kernels, signatures, strict=True):
        kernel.compile(signature).bind()


def _family_workspace(dims: Dims, params: dict[str, int]) -> Any:
    """The [T, K, I] bf16 intermediate (CuPy, current device)."""
    import cupy

    return cupy.empty((dims.tokens, dims.top_k, dims.intermediate), BF16)


def stages(compiled: Compiled, x: Any, w13: Any, w2: Any, topk_ids: Any, topk_weights: Any, out: Any) -> list[Stage]:
    """The layer as the two Numba launches (gate_up, down) into ``compiled``'s workspace, each on the stream
    current when it runs. Host work only: bit views and Numba array wrappers, no allocation, no sync."""
    knobs = _knob_tuple(compiled.params)
    pair = _loaded_kernels(knobs, out.dtype == np.float32)
    args = _prepare(x, w13, w2, topk_ids, topk_weights, out, compiled.workspace)
    dims = compiled.dims
    return [(name, functools.partial(_launch_stage, pair, dims, knobs, args, name)) for name in ("gate_up", "down")]


def _launch_stage(pair: tuple[Any, Any], dims: Dims, knobs: tuple[int, ...], args: tuple[Any, ...],
                  stage: str) -> None:
    _launch(pair, dims, knobs, args, _current_stream(), stage)


def warp_decode(
    x: Any,
    w13: Any,
    w2: Any,
    topk_ids: Any,
    topk_weights: Any,
    out: Any = None,
    workspace: Any = None,
    **params: int,
) -> Any:
    """One MoE decode layer by warp decode (Numba kernels); returns ``out`` [T, H].

    CuPy inputs run on the GPU on CuPy's current stream; with ``out`` and ``workspace`` (the [T, K, I] bf16
    intermediate) given nothing is allocated and the host never waits. NumPy inputs run under the CUDA
    simulator only. ``params``: ``warps``, ``rows``, ``unroll``, ``slots`` (see :data:`FAMILY`).
    """
    dims = check_inputs(x, w13, w2, topk_ids, topk_weights)
    xp = array_module(x)
    _check_backend(xp)
    knobs = FAMILY.resolve(dims, **params)  # knob errors before any allocation
    if out is None:
        out = xp.empty((dims.tokens, dims.hidden), BF16)
    else:
        check_out(out, dims, xp)
    if workspace is None:
        workspace = xp.empty((dims.tokens, dims.top_k, dims.intermediate), BF16)
    else:
        _check_workspace(workspace, dims, xp)
    compiled = FAMILY.compile(dims, workspace=workspace, **knobs)
    with simt.one_cpu() if xp is np else contextlib.nullcontext():  # the simulator: faster on one CPU
        compiled.run(x, w13, w2, topk_ids, topk_weights, out)
    return out


def build(dims: Dims, out_dtype: Any = BF16, **knobs: int) -> Launch:
    """The variant's build: resolve the knobs, allocate the intermediate, compile and load both kernels for
    ``out_dtype`` now (another out dtype compiles at its first launch); returns the :class:`Launch`."""
    compiled = FAMILY.compile(dims, **knobs)
    _loaded_kernels(_knob_tuple(compiled.params), np.dtype(out_dtype) == np.float32)
    return compiled.launch()


# ---------------------------------------------------------------------------------------------------------
# Offline compile (no GPU): PTX for sm_90 through Numba, then ptxas' resource report through nvJitLink
# ---------------------------------------------------------------------------------------------------------
KERNEL_NAMES = ("moe_gate_up_3d_batched", "moe_down_3d_batched")


def compile_ptx(warps: int = DEFAULTS["warps"], rows: int = DEFAULTS["rows"], unroll: int = DEFAULTS["unroll"],
                slots: int = DEFAULTS["slots"], out_f32: bool = False, cc: tuple[int, int] = (9, 0)) -> dict[str, str]:
    """PTX of both kernels for one knob set, keyed by readable kernel name; needs no GPU. Compiled once per process
    (Numba's typing and LLVM take about a second a kernel, and the compile report and the tests ask for the same
    knobs more than once)."""
    return dict(_compiled_ptx(_check_params(warps, rows, unroll, slots), bool(out_f32), tuple(cc)))


@functools.cache
def _compiled_ptx(knobs: tuple[int, int, int, int], out_f32: bool, cc: tuple[int, int]) -> dict[str, str]:
    gate_up, down = _kernel_sources(*knobs, out_f32)
    return {
        KERNEL_NAMES[0]: cuda.compile_ptx(gate_up, _gate_up_signature(), cc=cc)[0],
        KERNEL_NAMES[1]: cuda.compile_ptx(down, _down_signature(out_f32), cc=cc)[0],
    }


def ptx_load_widths(ptx: str) -> dict[str, int]:
    """Counts of each global/local load and store instruction form in ``ptx`` (e.g. ``ld.global.nc.v2.u64``)."""
    import re
    from collections import Counter

    return dict(Counter(re.findall(r"\b((?:ld|st)\.(?:global|local)[\w.]*)", ptx)))


@dataclasses.dataclass(frozen=True)
class NumbaKernelResources(KernelResources):
    """ptxas' report for one Numba kernel, with the knobs it was compiled with (for ``tools.compile_report``)."""

    params: dict[str, Any] = dataclasses.field(default_factory=dict)
    is_default: bool = True
    threads_per_block: int = 0


def offline_reports(param_sets: list[dict[str, Any]] | None = None,
                    defaults: bool = True) -> list[NumbaKernelResources]:
    """ptxas' registers / spills / stack of both kernels for sm_90, no GPU needed: (with ``defaults``) the default
    knobs with bf16 and with float32 ``out``, then each of ``param_sets``, each distinct set compiled once. Kernels
    carry their readable names (``moe_gate_up_3d_batched``), not Numba's mangled ones; ``params`` holds the knobs."""
    return numba_offline_reports(__name__, lambda **knobs: compile_ptx(**knobs), DEFAULTS, param_sets, defaults)


def numba_offline_reports(module: str, compile_fn: Any, knob_defaults: dict[str, int],
                          param_sets: list[dict[str, Any]] | None, defaults: bool) -> list[NumbaKernelResources]:
    """A Numba family's offline report (what :func:`offline_reports` says), for any family whose ``module`` has an
    ``offline_reports(param_sets, defaults)`` and whose ``compile_fn(**knobs, out_f32=)`` returns {kernel: PTX}:
    under the simulator (which cannot emit PTX) it runs in a child Python without it."""
    from kernels.compile import ptx_report

    if simt.simulator_enabled():
        return _offline_reports_without_simulator(module, param_sets, defaults)
    sets: list[dict[str, Any]] = []
    for knobs in [*([dict(knob_defaults), {**knob_defaults, "out_f32": True}] if defaults else []),
                  *(param_sets or [])]:
        if {**knob_defaults, **knobs} not in sets:
            sets.append({**knob_defaults, **knobs})
    reports = []
    for index, knobs in enumerate(sets):
        for name, ptx in compile_fn(**knobs).items():
            for report in ptx_report(ptx):
                fields = {f.name: getattr(report, f.name) for f in dataclasses.fields(KernelResources)}
                fields["kernel"] = name
                reports.append(NumbaKernelResources(
                    **fields, params=dict(knobs), is_default=defaults and index < 2,
                    threads_per_block=32 * int(knobs["warps"])
                ))
    return reports


def _offline_reports_without_simulator(module: str, param_sets: list[dict[str, Any]] | None,
                                       defaults: bool = True) -> list[NumbaKernelResources]:
    """``module.offline_reports`` run in a child Python without ``NUMBA_ENABLE_CUDASIM`` (the bench's CPU path
    simulates the kernels and reports their registers in the same run)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parent.parent)
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    code = ("import dataclasses, json, sys\n"
            f"from {module} import offline_reports\n"
            "print(json.dumps([dataclasses.asdict(r) for r in offline_reports(json.loads(sys.argv[1]), "
            "sys.argv[2] == 'defaults')]))")
    done = subprocess.run([sys.executable, "-c", code, json.dumps(param_sets or []), "defaults" if defaults else "-"],
                          env=env, cwd=root,
                          capture_output=True, text=True, timeout=300)
    if done.returncode:
        raise RuntimeError(f"offline Numba compile failed: {done.stderr.strip()[-400:]}")
    return [NumbaKernelResources(**fields) for fields in json.loads(done.stdout.strip().splitlines()[-1])]


# ---------------------------------------------------------------------------------------------------------
# Checks against the reference (used by the simulator tests, the GPU tests and the bench's CPU path)
# ---------------------------------------------------------------------------------------------------------
def compare(result: Any, problem: Any, out_dtype: Any = BF16) -> dict[str, Any]:
    """``result`` against ``reference.moe_decode(mode="warp_decode")`` and the fp64 oracle by the one output
    checker under :data:`kernels.checks.SIMULATOR`; returns its record (``ok``, ``max_ulp``, ``rel_l2_fp64``,
    ``bitwise_fraction``, ``all_written``, ``why`` on failure, ...)."""
    from kernels.reference import moe_decode

    host = problem.compact() if not isinstance(problem.x, np.ndarray) else problem
    faithful = moe_decode(*host.arrays, mode="warp_decode", out_dtype=out_dtype)
    oracle = moe_decode(*host.arrays, mode="fp64")
    return check_output(result, faithful, SIMULATOR, oracle=oracle)


# Cases small enough for the simulator (one Python thread per CUDA thread; rows=8 / few warps per block keep
# the thread count down): name -> (shape, tokens, routing, knobs, out dtype)
SIM_CASES: dict[str, tuple[MoEShape | str, int, Any, dict[str, int], Any]] = {
    # the tiny preset (H = 136, I = 48), one token, float32 out (several tokens per launch: h8-k1-e1-t5 and odd-dup;
    # bf16 out: the others)
    "tiny": ("tiny", 1, "zipf", {"rows": 8, "warps": 4, "unroll": 1, "slots": 3}, np.float32),
    "h8-k1-e1": (MoEShape("h8-k1-e1", 8, 8, 1, 1), 1, "uniform", {"rows": 1, "warps": 1}, BF16),
    "h8-k1-e1-t5": (MoEShape("h8-k1-e1", 8, 8, 1, 1), 5, "uniform", {"rows": 8, "warps": 2}, BF16),
    # H = 40: 10 uint64 words per row, so lanes 5..31 hold no data; duplicate expert ids add (tokens 0 and 2)
    "odd-dup": (
        MoEShape("odd-dup", 40, 24, 3, 2), 3, [[2, 2], [0, 1], [1, 1]],
        {"rows": 4, "warps": 4, "slots": 1}, BF16,
    ),
    # H = 264 with unroll=1: two trips of the 256-bf16 step, the second partial
    "h264-same": (
        MoEShape("h264-same", 264, 16, 2, 1), 1, "same", {"rows": 8, "unroll": 1, "warps": 4, "slots": 1}, BF16
    ),
}


def simulator_selfcheck(shapes: tuple[Any, ...] = ("tiny", "odd-dup"), seed: int = 0) -> list[dict[str, Any]]:
    """Run the real kernels on the CUDA simulator and compare with the reference; one dict per case: ``case``,
    ``tokens``, ``params``, ``out_dtype`` and the checker's record (:func:`compare`).

    ``shapes``: names from :data:`SIM_CASES`, or ``(shape, tokens, routing, knobs)`` tuples. Needs
    ``NUMBA_ENABLE_CUDASIM=1`` set before numba was first imported in this process.
    """
    results = []
    for name, problem, knobs, out in simulated_cases(shapes, SIM_CASES, seed):
        warp_decode(*problem.arrays, out=out, **knobs)
        results.append({"case": name, "tokens": problem.tokens, "params": {**DEFAULTS, **knobs},
                        "out_dtype": out.dtype.name, **compare(out, problem, out.dtype)})
    return results


def simulated_cases(shapes: tuple[Any, ...], table: dict[str, tuple[Any, ...]],
                    seed: int) -> Iterator[tuple[str, Any, dict[str, int], np.ndarray]]:
    """``(name, problem, knobs, NaN-filled out)`` of each simulator case: a name from ``table`` (name -> (shape,
    tokens, routing, knobs, out dtype)) or a ``(shape, tokens, routing, knobs)`` tuple (bf16 out). The Numba
    families' self-checks share it; needs the simulator on."""
    from kernels.problem import make_problem

    if not simt.simulator_enabled():
        raise RuntimeError("simulator_selfcheck needs NUMBA_ENABLE_CUDASIM=1 before numba is imported")
    for case in shapes:
        if isinstance(case, str):
            if case not in table:
                raise ValueError(f"unknown simulator case {case!r}; known: {', '.join(table)}")
            name, (shape, tokens, routing, knobs, out_dtype) = case, table[case]
        else:
            shape, tokens, routing, knobs = case
            out_dtype, name = BF16, f"{get_shape(shape).name}-T{tokens}"
        problem = make_problem(shape, tokens, seed=seed, routing=routing)
        yield name, problem, dict(knobs), np.full((tokens, get_shape(shape).hidden), np.nan, np.dtype(out_dtype))


def bad_ids_record(out: np.ndarray, good_row: dict[str, Any]) -> dict[str, Any]:
    """The bad-id self-check's record: ``good_row`` (the checker's record of the one good token, row 1) with whether
    rows 0 and 2 (the tokens given bad ids) are all NaN and row 1 is not."""
    rows_nan = [bool(np.all(np.isnan(out[t].astype(np.float32)))) for t in range(3)]
    return {**good_row, "bad_rows_nan": rows_nan[0] and rows_nan[2], "good_row_finite": not rows_nan[1]}


def simulate_bad_ids(seed: int = 0) -> dict[str, Any]:
    """Out-of-range expert ids on the simulator (bypassing the host check, as under graph capture):
    the bad tokens' rows must be all NaN, the other token must match the reference."""
    from kernels.problem import make_problem

    problem = make_problem(SIM_CASES["odd-dup"][0], 3, seed=seed)
    ids = problem.topk_ids.copy()
    ids[0, 1] = problem.shape.experts  # one past the end
    ids[2, 0] = -7
    dims = check_inputs(problem.x, problem.w13, problem.w2, ids, problem.topk_weights, check_values=False)
    out = np.full((dims.tokens, dims.hidden), 1.0, BF16)
    workspace = np.full((dims.tokens, dims.top_k, dims.intermediate), 1.0, BF16)
    knobs = _check_params(**{**DEFAULTS, "rows": 4, "warps": 4, "slots": 2})
    arrays = _prepare(problem.x, problem.w13, problem.w2, ids, problem.topk_weights, out, workspace)
    with simt.one_cpu():
        _launch(get_kernels(*knobs), dims, knobs, arrays, 0)
    good = problem.to_numpy()
    good.tokens = 1
    good.x, good.topk_ids, good.topk_weights = problem.x[1:2], problem.topk_ids[1:2], problem.topk_weights[1:2]
    return bad_ids_record(out, compare(out[1:2], good))


FAMILY = KernelFamily(
    name="warp-decode-numba",
    source=None,
    knobs=dict(DEFAULTS),
    limits=LIMITS,
    rules=rules,
    workspace=_family_workspace,
    stages=stages,
    offline_reports=offline_reports,
    simulate=simulator_selfcheck,
)
VARIANT = register(
    FAMILY.variant(
        "numba:warp-decode",
        backend="numba",
        family="warp-decode",
        build=build,
        reference_mode="warp_decode",
        grid={key: list(values) for key, values in GRID.items()},
        description="Numba CUDA warp decode: one warp per output scalar, 16-byte ld.global.nc loads, FP32 "
        "accumulation, xor-shuffle reductions (gate_up + down kernels)",
    )
)
