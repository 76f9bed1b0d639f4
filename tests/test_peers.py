"""The Triton fused-MoE peer (an optional extra): absent cleanly without PyTorch/Triton; with them, its align and
its layer checked on the CPU through Triton's interpreter, and on a GPU through the bench's harness."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernels.contract import Dims
from kernels.shapes import MoEShape

ROOT = Path(__file__).resolve().parents[1]
HAVE_PEERS = all(importlib.util.find_spec(name) is not None for name in ("torch", "triton"))
needs_peers = pytest.mark.skipif(not HAVE_PEERS, reason="needs PyTorch and Triton (pip install '.[peers]')")


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tools.peers", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={**os.environ, **(env or {})})


@pytest.mark.skipif(HAVE_PEERS, reason="checks the flow without PyTorch/Triton")
def test_without_torch_one_line_and_nothing_registered() -> None:
    import tools.peers as peers
    from kernels.variants import REGISTRY

    assert peers.WHY_NOT is not None and "pip install '.[peers]'" in peers.WHY_NOT
    assert peers.PEER not in REGISTRY
    done = _run("--batch", "1")
    assert done.returncode == 0 and done.stdout.startswith("skipped: the peers need PyTorch and Triton"), done
    assert done.stderr == ""
    done = _run("--model", "nope")  # the arguments are checked first, PyTorch or not
    assert done.returncode == 2 and "--model: unknown preset(s) 'nope'; known: qwen3-30b-a3b" in done.stderr, done
    assert done.stdout == ""


def test_cli_rejects_unknown_options() -> None:
    done = _run("--bogus")
    assert done.returncode == 2 and "unrecognized arguments: --bogus" in done.stderr


def test_config_selection_by_name_or_index() -> None:
    """--configs names tile configs by name or index (no PyTorch needed), in the order given, each once."""
    from tools.peers.__main__ import select_configs
    from tools.peers.tile_configs import CONFIGS, W4A16_CONFIGS, W8A8_CONFIGS

    assert select_configs("triton:fused-moe", None) == list(range(len(CONFIGS)))
    assert select_configs("triton:fused-moe-w8a8", f"{W8A8_CONFIGS[1].name}, 0,1") == [1, 0]
    with pytest.raises(ValueError, match="known: M16-N64-K128-G1-w4-s3"):
        select_configs("triton:fused-moe", "M16")
    assert select_configs("triton:fused-moe-w4a16", None) == list(range(len(W4A16_CONFIGS)))
    assert select_configs("triton:fused-moe-w4a16", f"2,{W4A16_CONFIGS[0].name}") == [2, 0]
    with pytest.raises(ValueError, match="triton:fused-moe-w4a16 has no tile config '7'"):
        select_configs("triton:fused-moe-w4a16", "7")


def test_w4a16_peer_names_its_format_configs_and_table_keys() -> None:
    """The W4A16 peer reads mxfp4; its tile configs step k by whole 32-value scale groups, decode-sized (BLOCK_M 16)
    and larger; its tuned entries are its own (``-w4a16``). No PyTorch needed."""
    import tools.peers as peers
    from tools.peers.tile_configs import W4A16_CONFIGS

    assert peers.PEERS[peers.PEER_W4A16] == "mxfp4" and peers.configs(peers.PEER_W4A16) is W4A16_CONFIGS
    assert all(c.block_k % 32 == 0 for c in W4A16_CONFIGS)
    assert {c.block_m for c in W4A16_CONFIGS} >= {16, 64}
    assert len({c.name for c in W4A16_CONFIGS}) == len(W4A16_CONFIGS)
    dims = Dims(4, 2048, 768, 128, 8)
    keys = {peers.shape_key(dims, peer) for peer in peers.PEERS}
    assert keys == {"2048x768x128x8", "2048x768x128x8-w8a8", "2048x768x128x8-w4a16"}


CASES = [("tiny", 3, "uniform"), ("tiny", 5, "zipf"), (MoEShape("odd", 40, 24, 3, 2), 4, "same")]


def _interpreted(script: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TRITON_INTERPRET": "1"})


@needs_peers
def test_layer_in_the_interpreter_matches_the_classical_reference() -> None:
    """Align's sorted pairs, block experts and padded total exactly; the layer within the interpreter's rounding
    (Triton's CPU interpreter narrows fp32 to bf16 by truncation, not to nearest: ~2x the GPU's error) of
    ``reference.moe_decode(mode="classical")`` for every tile config, NaN-poisoned outputs all written."""
    script = r'''
import json, numpy as np, torch
from kernels.contract import BF16, Dims
from kernels.numerics import rel_l2
from kernels.problem import make_problem
from kernels.reference import moe_decode
from kernels.shapes import MoEShape
from tools.peers.triton_fused_moe import CONFIGS, FusedMoE, as_torch
out_rows = []
for shape, tokens, routing in (("tiny", 3, "uniform"), ("tiny", 5, "zipf"),
                               (MoEShape("odd", 40, 24, 3, 2), 4, "same")):
    p = make_problem(shape, tokens, seed=tokens, routing=routing)
    d = Dims(tokens, p.shape.hidden, p.shape.intermediate, p.shape.experts, p.shape.top_k)
    ref, oracle = moe_decode(*p.arrays, mode="classical"), moe_decode(*p.arrays, mode="fp64")
    for config in CONFIGS:
        layer = FusedMoE(d, config, device="cpu")
        out = torch.full((tokens, d.hidden), float("nan"), dtype=torch.bfloat16)
        args = [as_torch(a) for a in p.arrays]
        stages = layer.stages(*args, out)
        stages[0][1]()
        total, bm, flat = int(layer.total), config.block_m, p.topk_ids.ravel()
        expect_total = sum(-(-int((flat == e).sum()) // bm) * bm for e in range(d.experts))
        sorted_ids = layer.sorted[:total].numpy()
        blocks = layer.block_expert[: total // bm].numpy()
        pairs = sorted_ids[sorted_ids < flat.size]
        ok_align = (total == expect_total and sorted(pairs.tolist()) == list(range(flat.size))
                    and all(flat[q] == blocks[i // bm] for i, q in enumerate(sorted_ids) if q < flat.size)
                    and list(blocks) == sorted(blocks))
        for _, stage in stages[1:]:
            stage()
        got = out.view(torch.int16).numpy().view(np.uint16).view(BF16).astype(np.float64)
        out_rows.append({"case": f"{p.shape.name} T={tokens} {config.name}", "align": bool(ok_align),
                         "written": bool(np.isfinite(got).all()), "vs_ref": rel_l2(got, ref.astype(np.float64)),
                         "vs_fp64": rel_l2(got, oracle), "ref_vs_fp64": rel_l2(ref.astype(np.float64), oracle)})
print(json.dumps(out_rows))
'''
    done = _interpreted(script)
    assert done.returncode == 0, done.stderr[-3000:]
    import json

    rows = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(rows) == len(CASES) * 6
    for row in rows:
        assert row["align"] and row["written"], row
        assert row["vs_ref"] < 2.5e-2 and row["vs_fp64"] < 4 * row["ref_vs_fp64"] + 1e-2, row


@needs_peers
def test_w8a8_layer_in_the_interpreter_matches_the_w8a8_reference() -> None:
    """The W8A8 form on fp8-block128 weights (partial scale blocks at both edges, w13's gate and up blocked apart):
    x quantized exactly as the reference quantizes it, and the layer within the interpreter's rounding (its bf16
    truncation moves some values across an e4m3 step) of ``reference.moe_decode(mode="classical", quant="fp8",
    weight_format="fp8-block128")``, no farther from the fp64 oracle than that reference is."""
    script = r'''
import json, numpy as np, torch
from kernels.contract import BF16, Dims
from kernels.formats import quantize_weights
from kernels.numerics import bf16_to_f32, quantize_fp8_groups, rel_l2
from kernels.problem import make_problem
from kernels.reference import moe_decode
from kernels.shapes import MoEShape
from tools.peers.triton_fused_moe import GROUP, W8A8_CONFIGS, FusedMoE, as_torch
rows = []
for shape, tokens, routing in (("tiny", 3, "uniform"), (MoEShape("h200-i136", 200, 136, 5, 3), 4, "zipf"),
                               (MoEShape("odd", 40, 24, 3, 2), 4, "same")):
    p = make_problem(shape, tokens, seed=tokens, routing=routing)
    q13, q2 = quantize_weights(p.w13, p.w2, "fp8-block128")
    d = Dims(tokens, p.shape.hidden, p.shape.intermediate, p.shape.experts, p.shape.top_k)
    args = (p.x, q13, q2, p.topk_ids, p.topk_weights)
    ref = moe_decode(*args, mode="classical", quant="fp8", weight_format="fp8-block128").astype(np.float64)
    oracle = moe_decode(*args, mode="fp64", weight_format="fp8-block128")
    for config in W8A8_CONFIGS:
        layer = FusedMoE(d, config, device="cpu", w8a8=True)
        out = torch.full((tokens, d.hidden), float("nan"), dtype=torch.bfloat16)
        w13 = (torch.from_numpy(q13.values.view(np.uint8)), torch.from_numpy(q13.scales))
        w2 = (torch.from_numpy(q2.values.view(np.uint8)), torch.from_numpy(q2.scales))
        layer(as_torch(p.x), w13, w2, as_torch(p.topk_ids), as_torch(p.topk_weights), out)
        xq = layer.x_q.float().numpy() * np.repeat(layer.x_scale.numpy(), GROUP, axis=1)[:, :d.hidden]
        got = out.view(torch.int16).numpy().view(np.uint16).view(BF16).astype(np.float64)
        rows.append({"case": f"{p.shape.name} T={tokens} {config.name}", "written": bool(np.isfinite(got).all()),
                     "x_exact": bool(np.array_equal(xq, quantize_fp8_groups(bf16_to_f32(p.x)))),
                     "vs_ref": rel_l2(got, ref), "vs_fp64": rel_l2(got, oracle), "ref_vs_fp64": rel_l2(ref, oracle)})
print(json.dumps(rows))
'''
    done = _interpreted(script)
    assert done.returncode == 0, done.stderr[-3000:]
    import json

    from tools.peers.triton_fused_moe import W8A8_CONFIGS

    rows = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(rows) == 3 * len(W8A8_CONFIGS)
    for row in rows:
        assert row["written"] and row["x_exact"], row
        assert row["vs_ref"] < 5e-2 and row["vs_fp64"] < 1.5 * row["ref_vs_fp64"] + 1e-2, row


@needs_peers
def test_w8a8_needs_128_wide_k_steps() -> None:
    from tools.peers.triton_fused_moe import CONFIGS, FusedMoE

    with pytest.raises(ValueError, match="block_k must be 128"):
        FusedMoE(Dims(2, 136, 48, 6, 2), next(c for c in CONFIGS if c.block_k != 128), device="cpu", w8a8=True)


@pytest.mark.slow
@needs_peers
def test_w4a16_layer_in_the_interpreter_matches_the_mxfp4_reference() -> None:
    """The W4A16 form on mxfp4 weights (H or I not a multiple of 32: a partial last scale group; I = 24 below one
    group), every tile config: NaN-poisoned outputs all written; the same output as the bf16 layer on the
    dequantized weights (exact in bf16), so that what separates it from ``reference.moe_decode(mode="classical",
    weight_format="mxfp4")`` is the interpreter's rounding alone (its bf16 truncation, as in the bf16 test): within
    that test's bounds of the reference and of the fp64 oracle."""
    script = r'''
import json, numpy as np, torch
from kernels.contract import BF16, Dims
from kernels.formats import MXFP4, quantize_weights
from kernels.numerics import rel_l2
from kernels.problem import make_problem
from kernels.reference import moe_decode
from kernels.shapes import MoEShape
from tools.peers.triton_fused_moe import CONFIGS, W4A16_CONFIGS, FusedMoE, as_torch

def run(layer, x, w13, w2, ids, weights, tokens, hidden):
    out = torch.full((tokens, hidden), float("nan"), dtype=torch.bfloat16)
    layer(as_torch(x), w13, w2, as_torch(ids), as_torch(weights), out)
    return out.view(torch.int16).numpy().view(np.uint16).view(BF16).astype(np.float64)

rows = []
for shape, tokens, routing in (("tiny", 3, "uniform"), (MoEShape("h200-i136", 200, 136, 5, 3), 4, "zipf"),
                               (MoEShape("odd", 40, 24, 3, 2), 4, "same")):
    p = make_problem(shape, tokens, seed=tokens, routing=routing)
    q13, q2 = quantize_weights(p.w13, p.w2, "mxfp4")
    d = Dims(tokens, p.shape.hidden, p.shape.intermediate, p.shape.experts, p.shape.top_k)
    args = (p.x, q13, q2, p.topk_ids, p.topk_weights)
    ref = moe_decode(*args, mode="classical", weight_format="mxfp4").astype(np.float64)
    oracle = moe_decode(*args, mode="fp64", weight_format="mxfp4")
    routed = (p.x, p.topk_ids, p.topk_weights, tokens, d.hidden)
    dequantized = [np.stack([MXFP4.expert(q, e, m) for e in range(d.experts)]) for q, m in ((q13, "w13"), (q2, "w2"))]
    exact = all(np.array_equal(w.astype(BF16).astype(np.float32), w) for w in dequantized)
    w13, w2 = (as_torch(w.astype(BF16)) for w in dequantized)
    bf16 = run(FusedMoE(d, CONFIGS[0], device="cpu"), p.x, w13, w2, *routed[1:])
    packed = [(torch.from_numpy(q.values), torch.from_numpy(q.scales)) for q in (q13, q2)]
    for config in W4A16_CONFIGS:
        got = run(FusedMoE(d, config, device="cpu", w4a16=True), p.x, *packed, *routed[1:])
        rows.append({"case": f"{p.shape.name} T={tokens} {config.name}", "written": bool(np.isfinite(got).all()),
                     "exact": exact, "vs_bf16_layer": rel_l2(got, bf16), "vs_ref": rel_l2(got, ref),
                     "vs_fp64": rel_l2(got, oracle), "ref_vs_fp64": rel_l2(ref, oracle)})
print(json.dumps(rows))
'''
    done = _interpreted(script)
    assert done.returncode == 0, done.stderr[-3000:]
    import json

    from tools.peers.tile_configs import W4A16_CONFIGS

    rows = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(rows) == 3 * len(W4A16_CONFIGS)
    for row in rows:
        assert row["written"] and row["exact"] and row["vs_bf16_layer"] < 1e-3, row
        assert row["vs_ref"] < 2.5e-2 and row["vs_fp64"] < 4 * row["ref_vs_fp64"] + 1e-2, row


@needs_peers
def test_w4a16_widening_is_exact_for_every_byte_and_scale() -> None:
    """Every packed byte under scale bytes from 0 (2^-127) to 254 and 255 (NaN), two scale groups a tile: both
    nibbles widened to bf16 exactly as the format's value table times its scale table gives them. The products below
    fp32's normal range (scale byte 0, codes 1-3) may read 0 here: the interpreter's float conversions flush
    subnormals, where the compiled kernel's (mul.f32, cvt.rn.bf16x2.f32) keep them."""
    script = r'''
import json, numpy as np, torch, triton, triton.language as tl
from kernels.formats_fp4 import E2M1_VALUES, E8M0_VALUES
from tools.peers.triton_fused_moe import _widen_mxfp4

@triton.jit
def widen(packed_ptr, scale_ptr, even_ptr, odd_ptr):
    rows = tl.arange(0, 32)[:, None] * 16 + tl.arange(0, 16)[None, :]
    packed = tl.load(packed_ptr + rows).to(tl.int32)
    s = tl.load(scale_ptr + tl.program_id(0) * 32 + tl.arange(0, 2)[:, None] * 16 + tl.arange(0, 16)[None, :])
    even, odd = _widen_mxfp4(packed, s.to(tl.int32), 64, 16)
    out = tl.program_id(0) * 512 + rows
    tl.store(even_ptr + out, even.to(tl.float32))
    tl.store(odd_ptr + out, odd.to(tl.float32))

scale_bytes = np.array([0, 1, 2, 100, 127, 128, 200, 253, 254, 255], np.uint8)
programs = len(scale_bytes) - 1  # program i: group 0 under scale_bytes[i], group 1 under scale_bytes[i + 1]
packed = np.tile(np.arange(256, dtype=np.uint8).reshape(16, 16), (2, 1))  # [32 byte rows, 16 columns]
scales = np.stack([np.stack([np.full(16, scale_bytes[i + g], np.uint8) for g in range(2)]) for i in range(programs)])
even, odd = (torch.empty(programs, 32, 16) for _ in range(2))
widen[(programs,)](torch.from_numpy(packed), torch.from_numpy(scales), even, odd)
group_scale = E8M0_VALUES[np.repeat(scales[:, :, :1], 16, axis=1)]  # [programs, 32, 1]
ok = True
for got, codes in ((even, packed & 15), (odd, packed >> 4)):
    want = (E2M1_VALUES[codes][None] * group_scale).astype(np.float32)
    with np.errstate(over="ignore"):
        want = torch.from_numpy(want).to(torch.bfloat16).float().numpy()  # overflow past bf16 / fp32: inf
    tiny = (want != 0) & (np.abs(want) < 2.0**-126)
    ok &= bool(np.array_equal(got.numpy()[~tiny], want[~tiny], equal_nan=True))
    ok &= bool(np.all((got.numpy()[tiny] == 0) | (got.numpy()[tiny] == want[tiny])))
print(json.dumps({"exact": ok}))
'''
    done = _interpreted(script)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == '{"exact": true}', done.stdout[-2000:]


@needs_peers
def test_w4a16_needs_whole_scale_groups() -> None:
    from tools.peers.tile_configs import CONFIGS, TileConfig
    from tools.peers.triton_fused_moe import FusedMoE

    with pytest.raises(ValueError, match="block_k must be a multiple of 32"):
        FusedMoE(Dims(2, 136, 48, 6, 2), TileConfig(16, 64, 16, 1, 4, 3), device="cpu", w4a16=True)
    with pytest.raises(ValueError, match="choose one"):
        FusedMoE(Dims(2, 136, 48, 6, 2), CONFIGS[0], device="cpu", w8a8=True, w4a16=True)


@pytest.mark.gpu
@needs_peers
def test_gpu_peer_through_the_harness(tmp_path: Path) -> None:
    """Every tile config benched and checked (before and after timing) like a lab path; the tuned row recorded."""
    path = tmp_path / "peers.json"
    done = _run("--model", "tiny", "--batch", "1,5", "--repeats", "3", "--json", str(path))
    assert done.returncode == 0, done.stderr[-3000:]
    import json

    data = json.loads(path.read_text())
    rows = [r for r in data["results"] if r["variant"].startswith("triton:fused-moe[")]
    assert len(rows) == 2 * 6 and all(r["status"] == "ok" and r["check"]["ok"] for r in rows), rows
    tuned = [r for r in data["results"] if r["variant"] == "triton:fused-moe"]
    assert len(tuned) == 2 and all(r["tuned_from"].startswith("triton:fused-moe[") for r in tuned)


@pytest.mark.gpu
@needs_peers
def test_gpu_w8a8_peer_through_the_harness(tmp_path: Path) -> None:
    """--weight-format fp8-block128: every W8A8 config benched on fp8 copies of the weights and checked against the
    W8A8 reference like a lab path, beside the lab's FP8 auto-dispatch; the tuned row recorded."""
    path = tmp_path / "peers-w8a8.json"
    done = _run("--weight-format", "fp8-block128", "--model", "tiny", "--batch", "1,5", "--repeats", "3", "--json",
                str(path))
    assert done.returncode == 0, done.stderr[-3000:]
    import json

    from tools.peers.triton_fused_moe import W8A8_CONFIGS

    data = json.loads(path.read_text())
    rows = [r for r in data["results"] if r["variant"].startswith("triton:fused-moe-w8a8[")]
    assert len(rows) == 2 * len(W8A8_CONFIGS) and all(r["status"] == "ok" and r["check"]["ok"] for r in rows), rows
    assert all(r["bytes"]["weight_format"] == "fp8-block128" and r["quant"] == "fp8" for r in rows)
    lab = [r for r in data["results"] if r["variant"] == "cupy:auto-fp8"]
    assert len(lab) == 2 and all(r["status"] == "ok" for r in lab), lab
    tuned = [r for r in data["results"] if r["variant"] == "triton:fused-moe-w8a8"]
    assert len(tuned) == 2


@pytest.mark.gpu
@needs_peers
def test_gpu_w4a16_peer_through_the_harness(tmp_path: Path) -> None:
    """--weight-format mxfp4: two W4A16 configs (a BLOCK_M 16 and a 64 one: the whole set took past 150 s of Triton
    compiles on the H200) benched on mxfp4 copies of the weights and checked against
    ``reference.moe_decode(mode="classical", weight_format="mxfp4")`` like a lab path; the tuned row recorded."""
    from tools.peers.tile_configs import W4A16_CONFIGS

    chosen = [0, next(i for i, c in enumerate(W4A16_CONFIGS) if c.block_m == 64)]
    path = tmp_path / "peers-w4a16.json"
    done = _run("--weight-format", "mxfp4", "--model", "tiny", "--batch", "1,5", "--repeats", "3",
                "--configs", ",".join(map(str, chosen)), "--json", str(path))
    assert done.returncode == 0, done.stderr[-3000:]
    import json

    data = json.loads(path.read_text())
    rows = [r for r in data["results"] if r["variant"].startswith("triton:fused-moe-w4a16[")]
    assert len(rows) == 2 * len(chosen) and all(r["status"] == "ok" and r["check"]["ok"] for r in rows), rows
    assert all(r["bytes"]["weight_format"] == "mxfp4" and r.get("quant") is None for r in rows)
    tuned = [r for r in data["results"] if r["variant"] == "triton:fused-moe-w4a16"]
    assert len(tuned) == 2 and all(r["tuned_from"].startswith("triton:fused-moe-w4a16[") for r in tuned)


def test_tuned_config_lookup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import tools.peers as peers

    monkeypatch.setattr(peers, "TUNED_DIR", tmp_path)
    dims = Dims(10, 2048, 768, 128, 8)
    assert peers.tuned_config(dims, "some-gpu") == 0  # nothing measured: the first config
    (tmp_path / "some-gpu.json").write_text('{"2048x768x128x8": {"1": 2, "8": 4, "16": 5}}')
    assert peers.tuned_config(dims, "some-gpu") == 4  # the nearest measured batch, the smaller on a tie
    assert peers.tuned_config(Dims(12, 2048, 768, 128, 8), "some-gpu") == 4
    assert peers.tuned_config(Dims(13, 2048, 768, 128, 8), "some-gpu") == 5
    assert peers.tuned_config(Dims(1, 4096, 1536, 128, 8), "some-gpu") == 0  # another shape
    assert peers.tuned_config(dims, "some-gpu", peers.PEER_W8A8) == 0  # the W8A8 peer: its own entries
    (tmp_path / "some-gpu.json").write_text('{"2048x768x128x8": {"1": 2}, "2048x768x128x8-w4a16": {"1": 3}}')
    assert peers.tuned_config(dims, "some-gpu", peers.PEER_W4A16) == 3  # the W4A16 peer: likewise
    assert peers.tuned_config(dims, "some-gpu") == 2
