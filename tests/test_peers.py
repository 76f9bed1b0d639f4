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
    assert done.returncode == 0 and done.stdout.startswith("skipped: the peers needs PyTorch and Triton"), done
    assert done.stderr == ""


def test_cli_rejects_unknown_options() -> None:
    done = _run("--bogus")
    assert done.returncode == 2 and "unrecognized arguments: --bogus" in done.stderr


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
