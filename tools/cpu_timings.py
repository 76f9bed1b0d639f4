"""How long the CPU paths take on this machine, measured (the test suite checks behaviour, never speed).

    python -m tools.cpu_timings                    # a table on stdout, a line on stderr before each step
    python -m tools.cpu_timings --json results/cpu-timings.json

Rows: the fp64 oracle (``reference.moe_decode(mode="fp64")``) and the warp_decode reference mode at
qwen3-235b-a22b, T = 64 -- the weights are a few distinct random experts tiled to all 128, so generating
4.8 GB of normals does not dominate (the routing and the work per expert are the real ones) -- and
``python -m tools.accuracy --model tiny --seeds 2 --layers 3`` end to end (a subprocess: wall time,
interpreter start included). One run each: a busy machine reads slower, so the JSON records the environment.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kernels.contract import BF16
from kernels.reference import moe_decode
from kernels.routing import make_routing
from kernels.shapes import MoEShape, get_shape
from tools.cli import examples

ROOT = Path(__file__).resolve().parents[1]
ACCURACY_ARGS = ("--model", "tiny", "--seeds", "2", "--layers", "3")


def tiled_problem(shape: MoEShape, tokens: int, distinct: int = 8, seed: int = 0) -> tuple[np.ndarray, ...]:
    """``(x, w13, w2, topk_ids, topk_weights)`` whose weights are ``distinct`` random experts tiled to E."""
    rng = np.random.default_rng(seed)
    distinct = min(distinct, shape.experts)
    copies = -(-shape.experts // distinct)
    h, i, e = shape.hidden, shape.intermediate, shape.experts
    w13 = np.tile((rng.standard_normal((distinct, 2 * i, h), np.float32) * 0.015).astype(BF16), (copies, 1, 1))[:e]
    w2 = np.tile((rng.standard_normal((distinct, h, i), np.float32) * 0.025).astype(BF16), (copies, 1, 1))[:e]
    x = rng.standard_normal((tokens, h), np.float32).astype(BF16)
    ids, weights = make_routing(tokens, e, shape.top_k, "uniform", seed=seed)
    return x, w13, w2, ids, weights


def time_reference(arrays: tuple[np.ndarray, ...], mode: str) -> float:
    """Seconds one ``moe_decode(*arrays, mode=mode)`` call takes."""
    start = time.perf_counter()
    moe_decode(*arrays, mode=mode)
    return time.perf_counter() - start


def time_accuracy_cli() -> float:
    """Wall seconds of ``python -m tools.accuracy`` with :data:`ACCURACY_ARGS` in a fresh interpreter."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "tools.accuracy", *ACCURACY_ARGS], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if proc.returncode != 0:
        raise RuntimeError(f"tools.accuracy exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    return time.perf_counter() - start


def environment() -> dict[str, Any]:
    """Where the numbers were taken."""
    return {"date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "python": platform.python_version(), "numpy": np.__version__, "cpu_count": os.cpu_count(),
            "platform": platform.platform()}


def record(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The JSON written by ``--json``: the environment and one ``{what, seconds, note}`` per row."""
    return {"environment": environment(), "rows": rows}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tools.cpu_timings", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=examples("python -m tools.cpu_timings          # a table on stdout",
                                                     "python -m tools.cpu_timings --json results/cpu-timings.json"))
    parser.add_argument("--json", type=Path, metavar="PATH",
                        help="also write the figures and the environment here (default: not written)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from rich.console import Console
    from rich.table import Table

    model, tokens = "qwen3-235b-a22b", 64
    print(f"building {model} T={tokens} inputs (8 distinct experts tiled) ...", file=sys.stderr, flush=True)
    arrays = tiled_problem(get_shape(model), tokens)
    tiled = f"weights: 8 distinct experts tiled to {get_shape(model).experts}, built untimed"
    steps = [
        (f"fp64 oracle at {model} T={tokens}", lambda: time_reference(arrays, "fp64"), tiled),
        (f"warp_decode reference at {model} T={tokens}", lambda: time_reference(arrays, "warp_decode"), tiled),
        (f"python -m tools.accuracy {' '.join(ACCURACY_ARGS)}", time_accuracy_cli,
         "subprocess, wall time incl. interpreter start"),
    ]
    rows = []
    for what, measure, note in steps:
        print(f"{what} ...", file=sys.stderr, flush=True)
        rows.append({"what": what, "seconds": round(measure(), 3), "note": note})
    blob = record(rows)
    env = blob["environment"]
    table = Table(title=f"CPU timings ({env['cpu_count']} CPUs, numpy {env['numpy']}, {env['date_utc']})")
    for column, justify in (("what", "left"), ("seconds", "right"), ("note", "left")):
        table.add_column(column, justify=justify)
    for row in rows:
        table.add_row(row["what"], f"{row['seconds']:.2f}", row["note"])
    Console().print(table)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(blob, indent=2) + "\n")
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
