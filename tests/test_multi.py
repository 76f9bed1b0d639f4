"""``python -m tools.multi``: the launcher (a process per rank), its error paths and its arguments, on the CPU.

The host backend runs each rank's shard through the reference and sums the partials: the split layer checked against
the whole one, TP and EP. A rank that raises, one that dies, one that hangs: named, the others stopped. The NCCL
backend needs a multi-GPU machine (notes/multi-gpu.md).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tools.multi import RankFailed, launch

ROOT = Path(__file__).resolve().parents[1]


# module-level targets: the spawned ranks import them by name
def doubled(rank: int, ranks: int, payload: int) -> int:
    return rank * payload + ranks


def raises_on_one(rank: int, ranks: int, payload: object) -> int:
    if rank == 1:
        raise ValueError("rank one's shard cannot be built")
    return rank


def dies_on_zero(rank: int, ranks: int, payload: object) -> int:
    if rank == 0:
        os._exit(3)
    time.sleep(30)  # the launcher stops this one once rank 0 is named
    return rank


def sleeps(rank: int, ranks: int, payload: float) -> int:
    time.sleep(payload)
    return rank


def test_launch_results_in_rank_order_and_failures_named() -> None:
    assert launch(doubled, 3, 2) == [3, 5, 7]
    with pytest.raises(RankFailed, match="rank 1 failed: ValueError: rank one's shard cannot be built") as failed:
        launch(raises_on_one, 3, None)
    assert failed.value.rank == 1 and "Traceback" in failed.value.why
    start = time.monotonic()
    with pytest.raises(RankFailed, match="rank 0 failed: exited with code 3 before giving a result"):
        launch(dies_on_zero, 2, None)
    assert time.monotonic() - start < 25  # the other rank was stopped, not waited for
    with pytest.raises(TimeoutError, match=r"ranks \[0\] gave no result within 1 s"):
        launch(sleeps, 1, 20.0, timeout=1.0)
    for bad in (0, -2, True, 1.5):
        with pytest.raises(ValueError, match="ranks must be an int >= 1"):
            launch(doubled, bad, 1)  # type: ignore[arg-type]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tools.multi", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)


def test_host_backend_runs_tp_and_ep_splits() -> None:
    """tiny (I = 48: 6 units of 8; E = 6) split TP over 2 ranks from the command line and EP over 3 on mxfp4 weights
    through ``run``, the host backend: each sum within the tensor-core tolerance of the whole layer; progress on
    stderr."""
    from tools.multi import Job, run

    done = _run("--split", "tp", "--ranks", "2", "--model", "tiny", "--batch", "3", "--backend", "reference")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "tp x 2 tiny T=3 bf16: ok, rel-L2 to fp64" in done.stdout
    assert "rank 1 done (2 of 2)" in done.stderr or "rank 0 done (2 of 2)" in done.stderr
    lines: list[str] = []
    record = run(Job("ep", "tiny", 4, 0, "same", "mxfp4", "reference"), 3, 600.0, lines.append)
    assert record["ok"] and record["ranks"] == 3 and len(lines) == 3, record


def test_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    """Unknown options and bad values exit 2 naming them; more ranks than the split allows names the most; backend
    nccl without a GPU says so and exits 0."""
    from tools.multi import main

    for args, message in ((["--bogus"], "unrecognized arguments: --bogus"),
                          (["--split", "pp"], "argument --split: invalid choice: 'pp'"),
                          (["--ranks", "0"], "argument --ranks: expected an int >= 1, got 0"),
                          (["--format", "bf16-t16"], "argument --format: invalid choice: 'bf16-t16'"),
                          (["--model", "tiny", "--ranks", "7", "--backend", "reference"],
                           r"--ranks 7: ranks must be 1..6 (I = 48 holds 6 whole units of 8 values (bf16))"),
                          (["--model", "tiny", "--split", "ep", "--ranks", "7", "--backend", "reference"],
                           "--ranks 7: ranks must be 1..6 (E = 6 experts"),
                          (["--experts", "-1", "--backend", "reference"], "--experts: expected an int >= 0")):
        with pytest.raises(SystemExit) as exited:
            main(args)
        assert exited.value.code == 2 and message in capsys.readouterr().err, args
    import shutil

    if shutil.which("nvidia-smi") is None:
        assert main(["--model", "tiny", "--batch", "1"]) == 0
        assert capsys.readouterr().out.startswith("NO RUN:")
