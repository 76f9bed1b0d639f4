"""Checks shared by the GPU tests of the warp-decode family (strict CuPy and batched): input stand-ins,
NaN-poisoned outputs, host references from the touched experts only, and the comparison rule.

The comparison rule (see tests/test_warp_decode_cupy.py's docstring for the derivation): every output within
``ulp(|ref|) + ulp(RMS(ref) / 4)`` of ``reference.moe_decode(mode="warp_decode")``, at least ``MIN_BITWISE``
of them bitwise equal, and rel-L2 against the fp64 oracle below ``MAX_REL_L2``.
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from kernels.contract import BF16
from kernels.numerics import bf16_ulp, rel_l2
from kernels.problem import Problem
from kernels.reference import moe_decode
from kernels.shapes import PRESETS, MoEShape


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


MAX_REL_L2 = 5e-3


MIN_BITWISE = 0.85


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


def _assert_matches(got: np.ndarray, faithful: np.ndarray, oracle: np.ndarray, what: str) -> dict[str, float]:
    assert got.shape == faithful.shape, what
    g = got.astype(np.float64)
    r = faithful.astype(np.float64)
    assert np.all(np.isfinite(g)), f"{what}: {np.sum(~np.isfinite(g))} outputs not written (NaN poison) or inf"
    rms = float(np.sqrt(np.mean(r * r)))
    if got.dtype == BF16:
        tol = bf16_ulp(r) + bf16_ulp(np.full_like(r, rms / 4))
        bitwise = float(np.mean(got.view(np.uint16) == faithful.view(np.uint16)))
    else:  # fp32 out: no final rounding; allow the pre-rounding difference only
        tol = np.abs(r) * 2.0**-16 + rms * 2.0**-9
        bitwise = float(np.mean(got.view(np.uint32) == faithful.view(np.uint32)))
    excess = np.abs(g - r) - tol
    worst = int(np.argmax(excess))
    assert excess.flat[worst] <= 0, (
        f"{what}: |got - ref| beyond tolerance at {np.unravel_index(worst, r.shape)}: got {g.flat[worst]!r} "
        f"ref {r.flat[worst]!r} tol {tol.flat[worst]!r} (rms {rms:.3g})"
    )
    if got.dtype == BF16:
        assert bitwise >= MIN_BITWISE, f"{what}: only {bitwise:.3%} bitwise equal to mode='warp_decode'"
    rel = rel_l2(g, oracle)
    assert rel < MAX_REL_L2, f"{what}: rel-L2 vs fp64 {rel:.3g}"
    return {"bitwise": bitwise, "rel_l2": rel}


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
