"""Batch invariance: a token's output row bitwise the same whatever batch it rides in.

``kernels.moe_decode(..., policy="batch_invariant")`` promises it (kernels/dispatch.py says why: the grouped
tensor-core path and its per-pair form share one numerics). The proof: a probe token run alone, then at a random
position among T - 1 random other tokens for T = 2..256, under every routing generator and duplicate ids, at the
presets and odd shapes, eager and replayed from a CUDA graph, bf16 and fp8-block128 weights -- its row compared bit
for bit. The other policies switch paths whose sums differ, and a test holds that too. On the CPU: the g++ emulation
of both invariant paths (tests/test_warp_decode_batched.py) and here the Numba strict kernels on the simulator,
whose per-output warps never read another token.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from kernels.contract import BF16
from kernels.formats import format_of
from kernels.problem import make_problem
from kernels.routing import GENERATORS, make_routing
from kernels.shapes import PRESETS, MoEShape

REPO = Path(__file__).resolve().parents[1]
BATCHES = (2, 3, 8, 16, 31, 64, 128, 256)
DUPLICATES = "duplicates"  # the other tokens list each of their experts twice


def _probe(shape: MoEShape, seed: int) -> SimpleNamespace:
    """One token's x, ids and routing weights (host; no weights generated)."""
    ids, wts = make_routing(1, shape.experts, shape.top_k, "uniform", seed)
    x = np.random.default_rng([seed, 1]).standard_normal((1, shape.hidden), dtype=np.float32).astype(BF16)
    return SimpleNamespace(x=x, topk_ids=ids, topk_weights=wts)


def _batch(shape: MoEShape, probe: Any, tokens: int, routing: str, seed: int) -> tuple[Any, int]:
    """Host arrays (x, ids, weights) of a batch of ``tokens`` holding ``probe``'s token at a seeded random position;
    the position. Only the activations and the routing are made here (the weights stay on the device)."""
    rng = np.random.default_rng([seed, tokens])
    ids, wts = make_routing(tokens, shape.experts, shape.top_k, "uniform" if routing == DUPLICATES else routing,
                            seed + tokens)
    x = rng.standard_normal((tokens, shape.hidden), dtype=np.float32).astype(BF16)
    if routing == DUPLICATES and shape.top_k >= 2:
        ids[:, 1::2] = ids[:, 0::2][:, : ids[:, 1::2].shape[1]]
    position = int(rng.integers(tokens))
    x[position], ids[position], wts[position] = probe.x[0], probe.topk_ids[0], probe.topk_weights[0]
    return (x, ids, wts), position


def _run(cupy: Any, w13: Any, w2: Any, host: tuple[Any, ...], policy: str, graph: bool = False) -> np.ndarray:
    from kernels import dispatch

    x, ids, wts = (cupy.asarray(a) for a in host)
    out = cupy.empty((x.shape[0], x.shape[1]), BF16)
    out.view(cupy.uint16).fill(0x7FC0)
    fmt = format_of(w13)
    dims = dispatch.check_inputs(x, w13, w2, ids, wts, weight_format=fmt)
    ws = dispatch.make_workspace(dims, policy=policy, weight_format=fmt)
    if not graph:
        dispatch.moe_decode(x, w13, w2, ids, wts, out=out, workspace=ws, policy=policy)
    else:
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            dispatch.moe_decode(x, w13, w2, ids, wts, out=out, workspace=ws, policy=policy)  # compile outside
            stream.synchronize()
            out.view(cupy.uint16).fill(0x7FC0)
            stream.begin_capture()
            dispatch.moe_decode(x, w13, w2, ids, wts, out=out, workspace=ws, policy=policy)
            stream.end_capture().launch(stream)
            stream.synchronize()
    cupy.cuda.runtime.deviceSynchronize()
    return out.get().view(np.uint16)


CASES = [("qwen3-30b-a3b", "bf16"), ("qwen3-235b-a22b", "bf16"), ("qwen3-30b-a3b", "fp8-block128"),
         ("h200-i136", "bf16"), ("tiny", "fp8-block128"), ("qwen3-235b-a22b", "fp8-block128-t16"),
         ("qwen3-30b-a3b", "bf16-t16"), ("gpt-oss-120b", "mxfp4"), ("h200-i136", "mxfp4")]


@pytest.mark.gpu
@pytest.mark.parametrize(("model", "weight_format"), CASES)
def test_batch_invariant_policy_on_the_gpu(model: str, weight_format: str) -> None:
    """The probe's row alone equals its row in every batch (T = 2..256, every routing generator and duplicate ids),
    eager and graph-replayed, bit for bit; every row written."""
    import cupy

    from kernels.formats import quantize_weights

    shape = PRESETS[model] if model in PRESETS else MoEShape(model, 200, 136, 24, 4)
    seed = 11
    weights = make_problem(shape.with_(experts=min(shape.experts, 64)), 1, seed=seed, xp=cupy)
    w13, w2 = weights.w13, weights.w2
    if weight_format != "bf16":
        w13, w2 = quantize_weights(w13, w2, weight_format)
    run_shape = weights.shape
    probe = _probe(run_shape, seed + 1)
    alone = _run(cupy, w13, w2, (probe.x, probe.topk_ids, probe.topk_weights), "batch_invariant")
    assert alone.shape == (1, run_shape.hidden) and not np.any((alone & 0x7F80) == 0x7F80), "NaN/inf in the probe"
    assert np.array_equal(_run(cupy, w13, w2, (probe.x, probe.topk_ids, probe.topk_weights), "batch_invariant",
                               graph=True), alone)
    mismatches = []
    for routing in (*GENERATORS, DUPLICATES):
        for tokens in BATCHES:
            host, position = _batch(run_shape, probe, tokens, routing, seed)
            got = _run(cupy, w13, w2, host, "batch_invariant", graph=tokens in (16, 256))
            assert not np.any((got & 0x7FC0) == 0x7FC0), f"{routing} T={tokens}: output not fully written"
            if not np.array_equal(got[position], alone[0]):
                mismatches.append((routing, tokens, int((got[position] != alone[0]).sum())))
    assert not mismatches, f"the probe's row changed (routing, T, elements): {mismatches}"


@pytest.mark.gpu
@pytest.mark.parametrize("weight_format", ["bf16", "fp8-block128", "mxfp4"])
def test_invariant_forms_agree_in_any_batch_on_the_gpu(weight_format: str) -> None:
    """Both forms the policy switches between, at their library knobs (GB_KSPLIT ranges: a warp per range in the
    per-pair form, the ranges in turn in the grouped path): the per-pair form alone and in batches up to 8, the
    grouped path in batches of 2..256, under every routing, give the probe the same bits -- whichever form the policy
    picks at a T."""
    import cupy

    from kernels import batched
    from kernels.batched.mma import grouped_knobs
    from kernels.formats import get_format, quantize_weights

    shape = PRESETS["qwen3-30b-a3b"].with_(experts=64)
    seed = 13
    weights = make_problem(shape, 1, seed=seed, xp=cupy)
    w13, w2 = weights.w13, weights.w2
    if weight_format != "bf16":
        w13, w2 = quantize_weights(w13, w2, weight_format)
    pairs, grouped = ("pairs", {}), ("mma", grouped_knobs(get_format(weight_format)))  # each form: (path, knobs)
    ranges = [batched.family(path, weight_format).resolve(None, **knobs)["GB_KSPLIT"]
              for path, knobs in (pairs, grouped)]
    assert ranges[0] == ranges[1] > 1  # the same k ranges: the numerics both forms share

    def run(host: tuple[Any, ...], form: tuple[str, dict[str, int]]) -> np.ndarray:
        x, ids, wts = (cupy.asarray(a) for a in host)
        out = cupy.empty((x.shape[0], x.shape[1]), BF16)
        out.view(cupy.uint16).fill(0x7FC0)
        batched.warp_decode_batched(x, w13, w2, ids, wts, out=out, path=form[0], **form[1])
        cupy.cuda.runtime.deviceSynchronize()
        return out.get().view(np.uint16)

    probe = _probe(shape, seed + 1)
    alone = run((probe.x, probe.topk_ids, probe.topk_weights), pairs)
    assert not np.any((alone & 0x7F80) == 0x7F80), "NaN/inf in the probe"
    assert np.array_equal(run((probe.x, probe.topk_ids, probe.topk_weights), grouped), alone)
    mismatches = []
    for routing in (*GENERATORS, DUPLICATES):
        for tokens in BATCHES:
            host, position = _batch(shape, probe, tokens, routing, seed)
            for name, form in (("grouped", grouped), ("pairs", pairs)) if tokens <= 8 else (("grouped", grouped),):
                got = run(host, form)
                assert not np.any((got & 0x7FC0) == 0x7FC0), f"{name} {routing} T={tokens}: output not fully written"
                if not np.array_equal(got[position], alone[0]):
                    mismatches.append((name, routing, tokens, int((got[position] != alone[0]).sum())))
    assert not mismatches, f"the probe's row changed (form, routing, T, elements): {mismatches}"


@pytest.mark.gpu
def test_the_other_policies_are_not_batch_invariant() -> None:
    """"fastest" and "warp_decode" switch paths with T (strict at T = 1, tensor cores at T = 64 on qwen3-30b):
    their sums differ, so the probe's row moves -- what the batch-invariant policy is for."""
    import cupy

    shape = PRESETS["qwen3-30b-a3b"]
    weights = make_problem(shape, 1, seed=5, xp=cupy)
    probe = _probe(shape, 6)
    for policy in ("fastest", "warp_decode"):
        alone = _run(cupy, weights.w13, weights.w2, (probe.x, probe.topk_ids, probe.topk_weights), policy)
        host, position = _batch(shape, probe, 64, "uniform", 5)
        moved = int((_run(cupy, weights.w13, weights.w2, host, policy)[position] != alone[0]).sum())
        assert moved > 0, f"{policy}: the probe's row did not move between T = 1 and T = 64"


_SIM_SCRIPT = r"""
import json, os, sys
if hasattr(os, "sched_setaffinity"):
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
import numpy as np
from kernels.contract import BF16
from kernels.problem import make_problem
from kernels.shapes import MoEShape
from kernels.warp_decode_numba import warp_decode
shape = MoEShape("h40-i8", 40, 8, 4, 2)  # H = 40: a partial chunk round; small, as the simulator runs a thread each
weights = make_problem(shape, 1, seed=3)
probe = make_problem(shape, 1, seed=4)
rows = []
for tokens, position, routing in ((1, 0, "uniform"), (3, 2, "zipf"), (4, 1, "same")):
    other = make_problem(shape, tokens, seed=10 + tokens, routing=routing)
    x, ids, wts = other.x.copy(), other.topk_ids.copy(), other.topk_weights.copy()
    x[position], ids[position], wts[position] = probe.x[0], probe.topk_ids[0], probe.topk_weights[0]
    out = np.full((tokens, weights.shape.hidden), np.nan, BF16)
    warp_decode(x, weights.w13, weights.w2, ids, wts, out=out, warps=4, rows=8, slots=2)
    assert not np.isnan(out.astype(np.float32)).any(), f"T = {tokens}: an output left unwritten"
    rows.append(out[position].view(np.uint16).tolist())
print(json.dumps(rows))
"""


@pytest.mark.slow
def test_numba_strict_kernels_are_batch_invariant_on_the_simulator() -> None:
    """The Numba strict kernels at fixed knobs (the simulator path): a warp per output reads only its token's x,
    ids and weights and sums in a fixed lane order, so the probe's row is bitwise the same alone and in batches of
    3 and 4 under other routings (every output written)."""
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", _SIM_SCRIPT], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(rows) == 3 and rows[1] == rows[0] and rows[2] == rows[0]
