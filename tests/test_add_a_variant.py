"""The README's "add a variant" walkthrough, done as a newcomer would: one new file, no edit anywhere else.

``tests/data/toy_warp_decode.py`` (its own CUDA source, knob, rules, workspace and stages: a complete warp decode
in ~120 lines) is copied into a temporary folder named by ``WARP_DECODE_PROTOTYPES``; then, in fresh processes as
a user would run them, it is registered as a prototype, compiled offline for sm_90 (NVRTC), checked on the bench's
CPU path (its compile report with the knob its rules resolve, the reference in its mode) -- and on a GPU benched
and checked against the reference -- and listed by the sweep. The checkout's files stay untouched.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOY = ROOT / "tests" / "data" / "toy_warp_decode.py"
NAME = "proto:toy-warp-decode"


def _run(args: list[str], folder: Path, expect: int = 0) -> subprocess.CompletedProcess:
    env = {**os.environ, "WARP_DECODE_PROTOTYPES": str(folder), "COLUMNS": "200"}
    done = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == expect, f"{args}: rc {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    return done


def _status() -> str:
    return subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=ROOT, capture_output=True,
                          text=True).stdout


@pytest.fixture(scope="module")
def toy_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("my_experiments")
    shutil.copy(TOY, folder / TOY.name)
    return folder


def test_registered_with_its_family(toy_folder: Path) -> None:
    script = (
        "import json, prototypes\n"
        "from kernels.contract import Dims\n"
        "from kernels.variants import REGISTRY\n"
        "names = prototypes.load()\n"
        f"v = REGISTRY[{NAME!r}]\n"
        "print(json.dumps({'names': names, 'prototype': v.prototype, 'source': v.source.name,\n"
        "  'small': v.resolve(Dims(1, 136, 48, 8, 2))['WARPS'],\n"
        "  'large': v.resolve(Dims(64, 2048, 768, 128, 8))['WARPS'],\n"
        "  'format': v.weight_format}))\n"
    )
    out = json.loads(_run(["-c", script], toy_folder).stdout.strip().splitlines()[-1])
    assert "toy_warp_decode" in out["names"] and out["prototype"] is True
    assert out["source"] == "toy_warp_decode" and out["format"] == "bf16"
    assert (out["small"], out["large"]) == (1, 4)  # its own rules resolved the auto knob


def test_bench_cpu_path_and_gpu(toy_folder: Path, tmp_path: Path) -> None:
    before = _status()
    path = tmp_path / "bench.json"
    _run(["-m", "tools.bench", "--prototypes", "--variants", NAME, "--model", "tiny", "--batch", "1,3",
          "--repeats", "3", "--json", str(path)], toy_folder)
    data = json.loads(path.read_text())
    assert data["config"]["variants"] == [NAME]
    if data.get("cpu") is None:  # a GPU ran it: timed, and checked against the reference before and after
        rows = [r for r in data["results"] if r["variant"] == NAME]
        assert len(rows) == 2 and all(r["status"] == "ok" and r["check"]["ok"] for r in rows), rows
    else:
        cpu = data["cpu"]
        compiled = {row["kernel"]: row for row in cpu["compile"] if row.get("variant") == NAME}
        assert set(compiled) == {"toy_gate_up", "toy_down"}, cpu["compile"]
        for row in compiled.values():  # compiled offline with the knob its rules pick at tiny, T = 1: one warp
            assert not row["error"] and row["registers"] > 0 and row["params"]["WARPS"] == 1
            assert row["spill_stores"] == row["spill_loads"] == 0 and row["threads_per_block"] == 32
        assert {r["mode"] for r in cpu["reference"]} == {"warp_decode"}  # its reference mode, checked vs fp64
        assert all(r["rel_l2"] < 5e-3 for r in cpu["reference"])  # warp decode's numerics: ~bf16 output rounding
    assert _status() == before  # nothing in the checkout was edited


def test_listed_by_the_sweep(toy_folder: Path, tmp_path: Path) -> None:
    path = tmp_path / "sweep.json"
    done = _run(["-m", "tools.sweep", NAME, "--model", "tiny", "--batch", "1", "--grid", "WARPS=1,2",
                 "--repeats", "3", "--json", str(path)], toy_folder)
    record = json.loads(path.read_text())
    assert [p["params"] for p in record["points"]] == [{"WARPS": 1}, {"WARPS": 2}]
    assert all(p["compile"] == "ok" and p["registers"] > 0 and p["spills"] == 0 for p in record["points"])
    assert "WARPS" in done.stdout
    bad = _run(["-m", "tools.sweep", NAME, "--model", "tiny", "--grid", "WRAPS=1"], toy_folder, expect=2)
    assert "WRAPS" in bad.stderr and "WARPS" in bad.stderr
