"""What the list kernel costs inside a layer, and how fast the roofline kernel reads exactly a layer's bytes.

One-off H200 diagnostics (2026-12-01, ~05:50 UTC), kept with their result,
results/diag-2026-12-01-list-cost-layer-reads.json. Run from the repo root on a GPU:
``PYTHONPATH=. python3 notes/diag_list_cost_layer_reads.py`` (writes ``$OUT/diag_list_cost_layer_reads.json``).
The committed result came from a first draft of this file with the same measurements (tidied afterwards).

(a) What the list kernel costs inside a layer: the batched paths timed by the bench harness as they are, and with
    ``moe_expert_lists`` run once before timing and left out of the timed graph (the routing is fixed, so the
    lists stay valid; the harness still checks the output). The difference bounds what folding the list kernel
    into gate_up could save.
(b) How long the bench's own streaming-read kernel (tools/roofline.py, the 4 GiB roofline) takes on exactly the
    weight bytes of a layer: one kernel, or 2/3 then 1/3 as two kernels (gate_up's and down's shares), each
    window of a 4 GiB buffer read once per replay (past 3x L2). Short reads do not reach the 4 GiB rate.
"""

from __future__ import annotations

import json
import os
import statistics
from typing import Any

import cupy

from kernels import warp_decode_batched as wdb
from kernels.compile import get_kernel
from kernels.shapes import get_shape
from tools import harness, roofline
from tools.roofline import ROOFLINE_SOURCE, window_read_buffers, window_read_samples


class WithoutLists:
    """A batched variant whose list kernel runs on the first call only (eagerly, before any capture)."""

    def __init__(self, variant: Any) -> None:
        self.variant = variant
        for attr in ("backend", "family", "baseline", "params", "reference_mode", "quant", "prepack"):
            setattr(self, attr, getattr(variant, attr))
        self.name = variant.name + "/no-lists"

    def make(self, dims: Any, **overrides: Any) -> Any:
        inner = self.variant.make(dims, **overrides)
        calls = [0]

        def launch(*args: Any) -> None:
            for stage, run in inner.stages(*args):
                if stage != "expert_lists" or calls[0] == 0:
                    run()
            calls[0] += 1

        launch.params = inner.params  # type: ignore[attr-defined]
        return launch


def list_kernel_cost() -> list[dict[str, Any]]:
    rows = []
    points = [(wdb.MIXED_VARIANT, "qwen3-30b-a3b", 8), (wdb.MMA_VARIANT, "qwen3-30b-a3b", 32),
              (wdb.MMA_VARIANT, "qwen3-30b-a3b", 64), (wdb.MMA_VARIANT, "qwen3-235b-a22b", 64)]
    for variant, model, tokens in points:
        bench = harness.Workbench(get_shape(model), tokens, "uniform", 0)
        for timed in (variant, WithoutLists(variant)):
            record = bench.measure(timed, repeats=10, stages=False)
            rows.append({"variant": timed.name, "model": model, "T": tokens, "status": record["status"],
                         "median_us": record.get("median_us"), "iqr_us": record.get("iqr_us"),
                         "unique": record["bytes"]["unique_experts"], "weights": record["bytes"]["weights"]})
            print(rows[-1], flush=True)
        bench.free()
    return rows


def sized_reads() -> list[dict[str, Any]]:
    sms = cupy.cuda.runtime.getDeviceProperties(0)["multiProcessorCount"]
    grid, block = roofline.BLOCKS_PER_SM * sms, roofline.THREADS_PER_BLOCK
    read = get_kernel(ROOFLINE_SOURCE, "stream_read")
    source, sink, stream = window_read_buffers()
    rows = []
    sizes = [("30b T=1", 75_497_472), ("30b T=8", 487_000_000), ("30b T=32", 1_066_401_792),
             ("30b T=64", 1_189_085_184), ("235b T=1", 302_000_000)]
    for label, nbytes in sizes:
        nbytes = nbytes // 4096 * 4096
        first = nbytes * 2 // 3 // 16 * 16
        for two_kernels in (False, True):
            parts = [(0, first), (first, nbytes - first)] if two_kernels else None
            samples = window_read_samples(read, grid, block, source, sink, stream, nbytes, parts)
            median = statistics.median(samples)
            rows.append({"what": label, "bytes": nbytes, "two_kernels": two_kernels,
                         "windows": min(48, source.nbytes // nbytes), "median_us": median,
                         "tbps": nbytes / median / 1e6, "min_us": min(samples), "max_us": max(samples)})
            print(rows[-1], flush=True)
    return rows


if __name__ == "__main__":
    result = {"lists_cost": list_kernel_cost(), "reads": sized_reads(), "roofline": roofline.measure()["read_tbps"]}
    with open(os.path.join(os.environ.get("OUT", "."), "diag_list_cost_layer_reads.json"), "w") as f:
        json.dump(result, f, indent=1)
